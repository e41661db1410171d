"""A memory cap for one benchmark run: a memory cgroup (v2, or v1's memory hierarchy) the command is started in,
its peak memory read back afterwards, and the page cache of the model's files dropped before it starts — so a
capped run reads what it needs from disk instead of finding it cached by the previous run.

Made for the peer comparison (bench/peers/compare.py); nothing here is imported by moetier."""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

V2, V1 = Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/memory")


@dataclass(frozen=True)
class Cage:
    """A memory cgroup of `limit` bytes at `path`; `v2` says which files it has."""

    path: Path
    limit: int
    v2: bool

    def wrap(self, argv: list[str]) -> list[str]:
        """`argv` started inside the cgroup (the shell enters it, then becomes the command)."""
        return ["sh", "-c", f'echo $$ > {self.path}/cgroup.procs && exec "$@"', "sh", *argv]

    def peak(self) -> int:
        """The most memory the cgroup held (page cache included) since it was made."""
        name = "memory.peak" if self.v2 else "memory.max_usage_in_bytes"
        try:
            return int((self.path / name).read_text())
        except (OSError, ValueError):
            return -1

    def remove(self) -> None:
        for _ in range(50):  # the last process may take a moment to leave
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def make_cage(limit: int, name: str) -> Cage | str:
    """A fresh memory cgroup of `limit` bytes, or the reason none can be made here."""
    tried = []
    for base, v2 in ((V2, True), (V1, False)):
        limit_file = "memory.max" if v2 else "memory.limit_in_bytes"
        if v2 and not (base / "cgroup.controllers").exists():
            continue
        if not v2 and not (base / limit_file).exists():
            continue
        path = base / f"{name}-{os.getpid()}"
        try:
            path.mkdir()
        except OSError as e:
            tried.append(f"{path}: {e.strerror}")
            continue
        try:
            (path / limit_file).write_text(str(limit))
            if not v2:  # no swap here, but where there is, a cap must not become a swap file
                _try_write(path / "memory.swappiness", "0")
            else:
                _try_write(path / "memory.swap.max", "0")
            return Cage(path, limit, v2)
        except OSError as e:
            path.rmdir()
            tried.append(f"{path / limit_file}: {e.strerror}")
    return "no memory cgroup can be made here (" + ("; ".join(tried) or "neither cgroup v2 nor v1 memory") + ")"


def _try_write(path: Path, text: str) -> None:
    try:
        path.write_text(text)
    except OSError:
        pass


def drop_cache(paths: list[Path]) -> None:
    """Drop the page cache of every file under `paths` (POSIX_FADV_DONTNEED: clean pages go; no root needed)."""
    for root in paths:
        files = [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file()]
        for f in files:
            try:
                fd = os.open(f, os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def run_caged(argv: list[str], limit: int | None, name: str, timeout: float,
              env: dict | None = None) -> tuple[subprocess.CompletedProcess, int]:
    """Run `argv` under a cap of `limit` bytes (None: no cap); (the finished process, the cgroup's peak or -1)."""
    if limit is None:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env), -1
    cage = make_cage(limit, name)
    if isinstance(cage, str):
        raise RuntimeError(cage)
    try:
        proc = subprocess.run(cage.wrap(argv), capture_output=True, text=True, timeout=timeout, env=env)
        return proc, cage.peak()
    finally:
        cage.remove()
