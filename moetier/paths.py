"""Where moetier keeps what it makes on its own: converted models, calibrated profiles, built models."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """`$MOETIER_CACHE`, or ~/.cache/moetier; read at each call, so a test or a user can point it elsewhere."""
    return Path(os.environ.get("MOETIER_CACHE") or Path.home() / ".cache" / "moetier").expanduser()
