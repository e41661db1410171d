"""How much memory this process may still take: the host's available memory and, inside a container, what each
enclosing cgroup (v1 or v2) still allows — whichever is smallest. psutil alone sees the host, and a budget sized
from it is killed without a word inside a smaller container.

A cgroup's usage counts the page cache; its inactive file pages are reclaimable, so they are not counted as used
(the "working set" container runtimes report)."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import psutil

from moetier.config import format_bytes

UNLIMITED = 1 << 60  # v1 writes "no limit" as a page-rounded 2**63 - 1


@dataclass(frozen=True)
class MemoryView:
    """What bounds this process's memory right now."""

    available: int  # bytes the process may still allocate
    source: str  # what sets it: "host" or "cgroup v2 /a/b"
    limit: int | None = None  # the bounding cgroup's limit (None for the host)
    used: int | None = None  # that cgroup's usage, less reclaimable page cache

    def describe(self) -> str:
        if self.limit is None:
            return f"{format_bytes(self.available)} available ({self.source})"
        return (f"{format_bytes(self.available)} available ({self.source}: limit {format_bytes(self.limit)}, "
                f"{format_bytes(self.used or 0)} in use)")


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return None if value >= UNLIMITED else value


def _stat(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _levels(mount: Path, cgroup_path: str) -> list[Path]:
    """The cgroup's directory and each ancestor up to the mount, those that are visible (in a container with a
    cgroup namespace the mount is the container's own cgroup and the path may not exist under it)."""
    here = mount / cgroup_path.lstrip("/")
    dirs = [here, *[p for p in here.parents if p == mount or mount in p.parents]]
    return [d for d in dirs if d.is_dir()] or ([mount] if mount.is_dir() else [])


def cgroup_limits(proc_cgroup: str, root: Path = Path("/sys/fs/cgroup")) -> list[MemoryView]:
    """One view per limited level of this process's memory cgroups; `proc_cgroup` is /proc/self/cgroup's text."""
    views = []
    for line in proc_cgroup.splitlines():
        hierarchy, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hierarchy == "0" and controllers == "":  # cgroup v2 (unified; in hybrid mode under unified/)
            mount = root if (root / "cgroup.controllers").exists() else root / "unified"
            files, version = ("memory.max", "memory.current", "inactive_file"), "v2"
        elif "memory" in controllers.split(","):
            mount = root / "memory" if (root / "memory").is_dir() else root / controllers
            files, version = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"), "v1"
        else:
            continue
        for level in _levels(mount, path):
            limit = _read_int(level / files[0])
            if limit is None:
                continue
            usage = _read_int(level / files[1]) or 0
            used = max(0, usage - _stat(level / "memory.stat", files[2]))
            name = "/" + str(level.relative_to(mount)).strip(".")
            views.append(MemoryView(max(0, limit - used), f"cgroup {version} {name}", limit, used))
    return views


def memory_available(proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup"),
                     host_available: int | None = None) -> MemoryView:
    """The tightest of the host's available memory and every enclosing cgroup's remaining allowance."""
    host = MemoryView(psutil.virtual_memory().available if host_available is None else host_available, "host")
    try:
        text = proc_cgroup.read_text()
    except OSError:  # not Linux, or no /proc: the host is all we know
        return host
    return min([host, *cgroup_limits(text, root)], key=lambda v: v.available)


def release_freed_memory() -> None:
    """Give memory the process freed back to the system (glibc keeps freed heap memory for reuse: after the dense
    weights were read and quantized, ~1.4 GB of an OLMoE-width model's temporaries stayed in RSS). Nothing where
    there is no glibc."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
