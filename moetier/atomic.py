"""Directories that appear whole or not at all: written under a temporary name beside the destination, then
renamed into place; removed if anything fails."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_dir(dest: Path | str) -> Iterator[Path]:
    """with atomic_dir(dest) as tmp: write into tmp. On success tmp replaces dest; on failure it is removed."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the result is an ordinary folder
    try:
        yield tmp
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def atomic_write_json(path: Path | str, obj) -> None:
    """Write `obj` as JSON to `path` through a temporary file renamed into place, so readers see the old file or
    the new one, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(json.dumps(obj, indent=1) + "\n")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
