"""Faults a test can make on this machine: a read-only folder and a small filesystem that fills up, each mounted in
a private mount namespace of one child process (`unshare -m`), so nothing outlives that process even if the test
dies. Where the machine cannot make them (no unshare, no right to mount), the test skips and says why."""

from __future__ import annotations

import functools
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


@functools.cache
def _unshare() -> tuple[list[str], str | None]:
    """The unshare command that gives a child its own mounts, or why there is none."""
    if shutil.which("unshare") is None:
        return [], "no unshare command"
    cmd = ["unshare", "-m"] if os.geteuid() == 0 else ["unshare", "-r", "-m"]  # (a user namespace maps us to root)
    probe = subprocess.run([*cmd, "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt 2>&1 || mount -t tmpfs -o "
                                               "size=1m tmpfs /tmp"], capture_output=True, text=True)
    if probe.returncode != 0:
        return [], f"cannot mount in a private namespace here ({(probe.stderr or probe.stdout).strip()[:80]})"
    return cmd, None


def need_mounts() -> None:
    if _unshare()[1] is not None:
        pytest.skip(_unshare()[1])


def run_with_mounts(argv: list[str], read_only: tuple[Path, ...] = (), small: dict[Path, int] | None = None,
                    env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`argv` run with each of `read_only` bound read-only onto itself and each folder of `small` a fresh tmpfs of
    that many bytes (its contents hidden meanwhile); skipped where the machine cannot."""
    need_mounts()
    lines = ["set -e"]
    for p in read_only:
        lines += [f"mount --bind {shlex.quote(str(p))} {shlex.quote(str(p))}",
                  f"mount -o remount,ro,bind {shlex.quote(str(p))}"]
    for p, size in (small or {}).items():
        lines.append(f"mount -t tmpfs -o size={size} tmpfs {shlex.quote(str(p))}")
    lines.append('exec "$@"')
    return subprocess.run([*_unshare()[0], "sh", "-c", "\n".join(lines), "sh", *argv], capture_output=True,
                          text=True, env=env, timeout=timeout)


def moetier(*args: str) -> list[str]:
    """The `moetier` command as a child process runs it."""
    return [sys.executable, "-m", "moetier.cli", *args]
