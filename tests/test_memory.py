"""The memory a run may take: the host's and every enclosing cgroup's (v1 and v2), on hand-made cgroup trees."""

from moetier.memory import cgroup_limits, memory_available

GiB = 2**30


def write(path, **files):
    path.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (path / name.replace("_", ".", 1)).write_text(text)


def test_v2_takes_the_tightest_level_and_does_not_count_reclaimable_cache(tmp_path):
    root = tmp_path / "cgroup"
    write(root, cgroup_controllers="memory")
    write(root / "outer", memory_max=str(4 * GiB), memory_current=str(3 * GiB), memory_stat=f"inactive_file {GiB}\n")
    write(root / "outer" / "inner", memory_max="max", memory_current=str(GiB))
    views = cgroup_limits("0::/outer/inner\n", root)
    assert [(v.source, v.available) for v in views] == [("cgroup v2 /outer", 2 * GiB)]  # 4 - (3 - 1) GiB
    view = memory_available(tmp_path / "proc", root, host_available=20 * GiB)
    assert view.available == 20 * GiB and view.source == "host"  # no /proc file: the host only
    (tmp_path / "proc").write_text("0::/outer/inner\n")
    view = memory_available(tmp_path / "proc", root, host_available=20 * GiB)
    assert view.available == 2 * GiB and "limit 4.0 GiB" in view.describe()


def test_v1_memory_hierarchy_with_an_unlimited_leaf(tmp_path):
    root = tmp_path / "cgroup"
    mem = root / "memory"
    write(mem, memory_limit_in_bytes=str(2**63 - 4096), memory_usage_in_bytes=str(9 * GiB))
    write(mem / "docker", memory_limit_in_bytes=str(GiB), memory_usage_in_bytes=str(GiB // 2),
          memory_stat=f"cache 0\ntotal_inactive_file {GiB // 4}\n")
    write(mem / "docker" / "app", memory_limit_in_bytes=str(2**63 - 4096), memory_usage_in_bytes="0")
    text = "12:pids:/docker/app\n4:memory:/docker/app\n1:name=systemd:/\n"
    views = cgroup_limits(text, root)
    assert [(v.source, v.available) for v in views] == [("cgroup v1 /docker", GiB - GiB // 4)]


def test_a_namespaced_mount_is_the_containers_own_cgroup(tmp_path):
    """Inside a cgroup namespace /proc/self/cgroup names a path that does not exist under the mount: the mount
    itself is the container's cgroup."""
    root = tmp_path / "cgroup"
    write(root, cgroup_controllers="memory", memory_max=str(GiB), memory_current=str(GiB // 4))
    views = cgroup_limits("0::/kubepods/pod1/abc\n", root)
    assert [v.available for v in views] == [3 * GiB // 4]


def test_no_cgroup_limits_means_the_host(tmp_path):
    root = tmp_path / "cgroup"
    write(root, cgroup_controllers="memory", memory_max="max", memory_current=str(GiB))
    assert cgroup_limits("0::/\n", root) == []
    assert memory_available(tmp_path / "missing", root, host_available=5).available == 5
