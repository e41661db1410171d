"""What moetier asks of Linux that another OS answers otherwise or not at all, one fallback each, so that a missing
call is a slower path and never a traceback. moetier is built and tested on Linux; elsewhere (macOS) these
fallbacks are what runs — tested on Linux with the calls taken away (tests/test_portable.py), not on a Mac.

- `usable_cores`: the cores this process may run on (Linux's affinity mask; elsewhere every core).
- `open_uncached`: a file opened so that reading it leaves the OS page cache alone: O_DIRECT where the OS and the
  filesystem take it; else a plain descriptor, with macOS's F_NOCACHE (reads through it keep no cached pages) where
  there is one, and `drop_cached` after each read where there is not.
- `drop_cached`: the page cache's copy of a span just read given back (posix_fadvise DONTNEED; nothing where the OS
  has no such call)."""

from __future__ import annotations

import os


def usable_cores() -> int:
    """The cores this process may run on: its affinity mask where the OS has one (Linux), else the machine's."""
    getaffinity = getattr(os, "sched_getaffinity", None)
    return len(getaffinity(0)) if getaffinity is not None else (os.cpu_count() or 1)


def open_uncached(path: str | os.PathLike, direct: bool = True) -> tuple[int, bool]:
    """(descriptor, whether it reads with O_DIRECT — whose reads need aligned offsets, lengths and memory). Raises
    OSError where the file cannot be opened at all."""
    flag = getattr(os, "O_DIRECT", None)
    if direct and flag is not None:
        try:
            return os.open(path, os.O_RDONLY | flag), True
        except OSError:  # e.g. tmpfs: no O_DIRECT
            pass
    fd = os.open(path, os.O_RDONLY)
    _no_cache(fd)
    return fd, False


def drop_cached(fd: int, offset: int, length: int) -> None:
    """The page cache's pages of fd's [offset, offset + length) given back, where the OS can be asked."""
    fadvise = getattr(os, "posix_fadvise", None)
    if fadvise is not None:
        fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)


def _no_cache(fd: int) -> None:
    """macOS's F_NOCACHE on `fd`: its reads keep no pages in the cache (where the OS has no posix_fadvise to drop
    them after). Nothing elsewhere."""
    if hasattr(os, "posix_fadvise"):
        return
    try:
        import fcntl
    except ImportError:  # (Windows)
        return
    flag = getattr(fcntl, "F_NOCACHE", None)
    if flag is not None:
        try:
            fcntl.fcntl(fd, flag, 1)
        except OSError:
            pass
