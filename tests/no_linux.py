"""A process as one on an OS without Linux's calls (tests/test_portable.py): `take_away` removes them from `os` and
makes /proc and /sys unreadable to moetier's code (psutil, which reads them on Linux, has its own backend for each
OS). Standalone — no imports beyond the standard library — so a subprocess's sitecustomize can run it before
moetier is imported."""

import builtins
import os
import pathlib
import sys

LINUX_ONLY = ("O_DIRECT", "posix_fadvise", "sched_getaffinity")


def take_away(set_attr, del_attr) -> None:
    """`set_attr(obj, name, value)` and `del_attr(obj, name)`: setattr and delattr, or a monkeypatch's (undone after
    a test)."""
    for name in LINUX_ONLY:
        if hasattr(os, name):
            del_attr(os, name)
    real_open, real_read = builtins.open, pathlib.Path.read_text

    def refuse(path) -> None:
        caller = sys._getframe(2).f_globals.get("__name__", "")
        if str(path).startswith(("/proc", "/sys")) and caller.startswith("moetier"):
            raise FileNotFoundError(2, "No such file or directory", str(path))

    def opened(file, *args, **kwargs):
        refuse(file)
        return real_open(file, *args, **kwargs)

    def read_text(self, *args, **kwargs):
        refuse(self)
        return real_read(self, *args, **kwargs)

    set_attr(builtins, "open", opened)
    set_attr(pathlib.Path, "read_text", read_text)
