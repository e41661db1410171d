"""moetier off Linux: each call another OS lacks (O_DIRECT, posix_fadvise, the affinity mask, /proc, cgroups) has its
fallback (moetier/portable.py and the /proc readers), checked here on Linux with the calls taken away — the engine's
tokens those of a run with them, and the CLI's demo run whole. Not a Mac: what a Mac adds beyond their absence
(F_NOCACHE, Apple's clang without OpenMP: the torch kernels) is not run."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moetier import portable
from moetier.store.store import Store
from tests import no_linux


def test_without_o_direct_a_file_is_read_plainly_and_its_pages_dropped_where_the_os_can(tmp_path, monkeypatch):
    path = tmp_path / "blob"
    path.write_bytes(b"x" * 8192)
    fd, direct = portable.open_uncached(path, direct=False)
    os.close(fd)
    assert not direct
    dropped = []
    monkeypatch.setattr(os, "posix_fadvise", lambda *args: dropped.append(args[1:3]))
    monkeypatch.delattr(os, "O_DIRECT")
    fd, direct = portable.open_uncached(path)
    try:
        assert not direct and os.pread(fd, 4, 0) == b"xxxx"
        portable.drop_cached(fd, 0, 4096)
        assert dropped == [(0, 4096)]
    finally:
        os.close(fd)


def test_where_there_is_no_posix_fadvise_reads_go_uncached_by_f_nocache(tmp_path, monkeypatch):
    import fcntl

    path = tmp_path / "blob"
    path.write_bytes(b"x" * 4096)
    asked = []
    for name in ("O_DIRECT", "posix_fadvise"):
        monkeypatch.delattr(os, name)
    monkeypatch.setattr(fcntl, "F_NOCACHE", 48, raising=False)  # (macOS's value; Linux has none)
    monkeypatch.setattr(fcntl, "fcntl", lambda fd, cmd, arg: asked.append((cmd, arg)))
    fd, direct = portable.open_uncached(path)
    os.close(fd)
    portable.drop_cached(fd, 0, 4096)  # (nothing to call: F_NOCACHE kept the pages out)
    assert not direct and asked == [(48, 1)]


def test_cores_without_an_affinity_mask_are_the_machines(monkeypatch):
    assert portable.usable_cores() == len(os.sched_getaffinity(0))
    monkeypatch.delattr(os, "sched_getaffinity")
    assert portable.usable_cores() == os.cpu_count()


def test_the_engine_without_linuxs_calls_gives_the_same_tokens(tiny_store, monkeypatch):
    from moetier import Engine
    from moetier.config import MemoryBudget
    from moetier.engine.cpu_share import CpuShare
    from moetier.engine.engine import EngineConfig

    _, path = tiny_store("olmoe", dtype=torch.bfloat16, num_hidden_layers=2)
    prompt = torch.randint(3, 128, (9,), generator=torch.Generator().manual_seed(6)).tolist()

    def run():
        config = EngineConfig(expert_memory=MemoryBudget.parse("40%"))
        with Engine(Store(path), config, progress=False) as engine:
            out = engine.generate([prompt], max_new_tokens=8, ignore_eos=True)
        return out.token_ids[0], out.stats

    tokens, _ = run()
    no_linux.take_away(monkeypatch.setattr, monkeypatch.delattr)
    assert not hasattr(os, "O_DIRECT")
    elsewhere, stats = run()
    assert elsewhere == tokens
    assert stats["decode"]["loads"] > 0 and stats["peak_rss_bytes"] > 0
    share = CpuShare()
    assert share.cores == os.cpu_count()
    share()  # (no /proc/loadavg: the threads stay as they are)
    assert share.current == share.full


def test_the_demo_runs_from_the_cli_without_linuxs_calls(tmp_path):
    """`moetier generate` in a process whose `os` lacks them and whose /proc and /sys cannot be read (a
    sitecustomize takes them away before moetier is imported): it exits 0 with the tokens on stdout."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(f"import sys\nsys.path.insert(0, {str(Path(no_linux.__file__).parent)!r})\n"
                                           "import no_linux\nno_linux.take_away(setattr, delattr)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
           "MOETIER_CACHE": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, "-m", "moetier.cli", "generate", "--model", "demo-fine", "--prompt", "It was",
                        "--max-tokens", "6", "--temperature", "0", "--kernels", "torch"], capture_output=True,
                       text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() and "Traceback" not in r.stderr
    check = subprocess.run([sys.executable, "-c", "import os; print(hasattr(os, 'O_DIRECT'))"], capture_output=True,
                           text=True, env=env, timeout=60)
    assert check.stdout.strip() == "False"  # (the sitecustomize took effect)


if not sys.platform.startswith("linux"):  # (elsewhere the calls are absent for real: nothing to take away)
    pytestmark = pytest.mark.skip(reason="takes Linux's calls away; this OS has none of them to begin with")
