"""Directories that appear whole or not at all, and the rules for replacing one.

A directory is written under a temporary name beside its destination, `.NAME.tmp-PID-START-XXXX` (the owner
process's id and start time), and renamed into place when complete. Replacing an existing one moves the old one
aside (`.NAME.old-PID-START-XXXX`), renames the new one in and removes the old one last, so a kill at any moment
leaves the old directory or the new one whole; in the instant between the two renames the old one waits aside,
and the next sweep puts it back. Any later write into the same folder sweeps what dead owners left behind.

Replacing is allowed only for what moetier made (`check_replaceable`), never for the source being read; writers
of the same target in several processes take `target_lock` in turn.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import secrets
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil

from moetier.config import format_bytes
from moetier.errors import MoetierError

_LEFTOVER = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old)-(?P<pid>\d+)-(?P<start>\d+)-[A-Za-z0-9_]+$")


class ReplaceError(MoetierError):
    """A destination moetier refuses to write: a file, the source itself, or a folder it did not make."""


class DiskFullError(MoetierError):
    """What is to be written does not fit, or the disk filled up while writing it (nothing of it is left)."""


FULL = (errno.ENOSPC, errno.EDQUOT)
FREE_HINT = "free disk space, or write somewhere else (a store goes to --cache-dir or $MOETIER_CACHE when converted " \
            "on first use)"


def check_free_space(dest: Path | str, needed: int, what: str) -> None:
    """Refuse, before anything is written, `what` of `needed` bytes that the filesystem holding `dest` (or the
    nearest folder of it that exists) has no room for."""
    dest = Path(dest).absolute()
    existing = next(p for p in [dest, *dest.parents] if p.exists())
    free = shutil.disk_usage(existing).free
    if needed > free:
        raise DiskFullError(f"{what} needs {format_bytes(needed)} at {dest}; {existing} has {format_bytes(free)} free",
                            hint=FREE_HINT)


def is_disk_full(error: OSError, where: Path) -> bool:
    """ENOSPC or EDQUOT, or a short write that says no errno (numpy's `tofile`) on a filesystem with no room left."""
    if error.errno in FULL:
        return True
    try:
        st = os.statvfs(where)
        return error.errno is None and st.f_bavail * st.f_frsize < (1 << 20)
    except OSError:
        return False


def disk_full(dest: Path | str, error: OSError) -> DiskFullError:
    """The one line for a disk that filled up while `dest` was written (its partial files already removed)."""
    return DiskFullError(f"the disk filled up while writing {dest} ({error.strerror or error}); nothing of it was "
                         f"kept",
                         hint=FREE_HINT)


def _start_time(pid: int) -> int:
    return int(psutil.Process(pid).create_time() * 100)  # centiseconds: tells a reused pid from the owner


def _owner_tag() -> str:
    return f"{os.getpid()}-{_start_time(os.getpid())}"


def _owner_alive(pid: int, start: int) -> bool:
    try:
        return abs(_start_time(pid) - start) <= 1
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:  # someone else's live process
        return True


def umask() -> int:
    """The process's umask, read without changing it (Linux's /proc; elsewhere set and restored at once)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def ordinary_mode(directory: bool = False) -> int:
    """The mode an ordinary file (0666) or folder (0777) gets under the umask: what a library that writes its files
    private (safetensors, mkdtemp: 0600/0700) is given back, so a store one user made another can read."""
    return (0o777 if directory else 0o666) & ~umask()


def sweep(folder: Path | str) -> list[Path]:
    """Remove the temporary directories of dead owners in `folder` and put back any old directory left aside
    without its replacement. Returns what was removed or restored."""
    folder = Path(folder)
    done = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return done
    for entry in entries:
        m = _LEFTOVER.match(entry.name)
        if m is None or not entry.is_dir(follow_symlinks=False) or _owner_alive(int(m["pid"]), int(m["start"])):
            continue
        path, dest = Path(entry.path), folder / m["name"]
        try:
            if m["kind"] == "old" and not os.path.lexists(dest):
                os.rename(path, dest)  # killed between the two renames of a replacement: the old one returns
            else:
                shutil.rmtree(path)
            done.append(path)
        except OSError:  # another process swept it first
            pass
    return done


@contextmanager
def atomic_dir(dest: Path | str) -> Iterator[Path]:
    """with atomic_dir(dest) as tmp: write into tmp. On success tmp replaces dest (the old one removed last); on
    failure tmp is removed and dest is untouched."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    sweep(dest.parent)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-{_owner_tag()}-", dir=dest.parent))
    os.chmod(tmp, ordinary_mode(directory=True))  # mkdtemp makes it private; the result is an ordinary folder
    try:
        yield tmp
        _swap_in(tmp, dest)
    except OSError as e:
        full = is_disk_full(e, dest.parent)  # (asked before the partial files go and free the space again)
        shutil.rmtree(tmp, ignore_errors=True)
        if full:
            raise disk_full(dest, e) from None
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def discard_dir(path: Path | str) -> None:
    """Remove a directory moetier made so that a kill at any moment leaves it whole or gone: it is first renamed
    to a temporary name of this process (one rename), which the next sweep removes if this process dies midway."""
    path = Path(path)
    aside = path.parent / f".{path.name}.tmp-{_owner_tag()}-{secrets.token_hex(4)}"
    os.rename(path, aside)
    shutil.rmtree(aside, ignore_errors=True)


def _swap_in(new: Path, dest: Path) -> None:
    if not os.path.lexists(dest):
        os.rename(new, dest)
        return
    old = dest.parent / f".{dest.name}.old-{_owner_tag()}-{secrets.token_hex(4)}"
    os.rename(dest, old)
    try:
        os.rename(new, dest)
    except BaseException:
        os.rename(old, dest)
        raise
    shutil.rmtree(old, ignore_errors=True)


@contextmanager
def target_lock(dest: Path | str, on_wait: Callable[[str], None] | None = None) -> Iterator[None]:
    """Hold an exclusive lock on `dest` (a `.NAME.lock` file beside it) while writing it. A second process waits
    (telling `on_wait` once) and then sees the first one's result. The kernel releases the lock if the holder
    dies, even by SIGKILL. If `dest` does not exist when the holder is done (an attempt refused or failed), the
    lock file goes too: the holder unlinks it while still holding it, and a waiter that then wins the lock on the
    unlinked file sees the path no longer names it and locks the path afresh, so two writers never both hold it."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    lock, told = dest.parent / f".{dest.name}.lock", False
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait is not None and not told:
                on_wait(f"waiting for another moetier process writing {dest}")
                told = True
            fcntl.flock(fd, fcntl.LOCK_EX)
        if _names(lock, fd):
            break
        os.close(fd)  # the holder before us removed this lock file: lock the one the path names now
    try:
        yield
    finally:
        if not os.path.lexists(dest):
            with contextlib.suppress(OSError):
                os.unlink(lock)
        os.close(fd)  # releases the lock


def _names(path: Path, fd: int) -> bool:
    """True if `path` still names the file open as `fd`."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino)


def check_replaceable(dest: Path | str, what: str, is_ours: Callable[[Path], bool], force: bool,
                      sources: tuple[Path | str, ...] = ()) -> None:
    """Refuse, before any work, a destination that cannot or must not be written: a file or a path under one, the
    source of the operation (or a folder inside it or around it), an existing folder without `force`, and with
    `force` any non-empty folder that is not a `what` moetier made (`is_ours`)."""
    dest = Path(dest).expanduser()
    for parent in [dest, *dest.parents]:
        if parent.exists() and not parent.is_dir():
            where = "is a file" if parent == dest else f"cannot be created: {parent} is a file"
            raise ReplaceError(f"{dest} {where}", hint=f"give a folder path for the {what}")
    target = dest.resolve()
    here = Path.cwd().resolve()
    if target == here or target in here.parents:  # `--out ""` is `.`: never replace the folder the user is in
        where = "the folder you are in" if target == here else "a folder around the one you are in"
        raise ReplaceError(f"{str(dest) or '(an empty path)'} is {where}",
                           hint=f"give a new folder path for the {what}")
    for source in sources:
        src = Path(source).expanduser().resolve()
        if target == src or src in target.parents or target in src.parents:
            relation = "is" if target == src else "is inside" if src in target.parents else "holds"
            raise ReplaceError(f"{dest} {relation} {source}, which this command reads",
                               hint=f"write the {what} somewhere else")
    if not dest.exists():
        return
    if not force:
        raise ReplaceError(f"{dest} already exists", hint=f"choose another path, or pass --force to replace the {what}")
    if not any(dest.iterdir()) or is_ours(dest):
        return
    shown = sorted(p.name for p in dest.iterdir())
    listing = ", ".join(shown[:4]) + (f" and {len(shown) - 4} more" if len(shown) > 4 else "")
    raise ReplaceError(f"{dest} is not a moetier {what} (it holds {listing}); --force replaces only a {what} "
                       f"moetier made", hint="choose another path, or move that folder away yourself")


def marked_json(path: Path, key: str, value: str) -> bool:
    """True if `path` is a JSON object whose `key` is `value` (how a store's manifest or a trace's meta.json says
    moetier wrote the folder)."""
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(d, dict) and d.get(key) == value


def atomic_write_json(path: Path | str, obj) -> None:
    """Write `obj` as JSON to `path` through a temporary file renamed into place, so readers see the old file or
    the new one, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps(obj, indent=1) + "\n")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
