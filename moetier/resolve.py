"""What `--model` names: a converted store, a Hugging Face folder (converted on first use into a cache), or a
built-in model's name."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from moetier.errors import ModelNotFoundError, StoreError
from moetier.store.checkpoint import read_config
from moetier.store.convert import convert
from moetier.store.format import MANIFEST, Manifest

BUILTIN_DIR = Path(__file__).resolve().parent.parent / "models"


def builtin_models() -> dict[str, Path]:
    """Models shipped in the repository's models/ folder, by folder name."""
    if not BUILTIN_DIR.is_dir():
        return {}
    return {p.name: p for p in sorted(BUILTIN_DIR.iterdir()) if (p / "config.json").exists()}


def default_cache_dir() -> Path:
    return Path(os.environ.get("MOETIER_CACHE", Path.home() / ".cache" / "moetier"))


def _fingerprint(model_dir: Path) -> str:
    """Changes when the checkpoint does: its path, and each file's name, size and modification time."""
    h = hashlib.sha256(str(model_dir.resolve()).encode())
    for f in sorted(model_dir.iterdir()):
        if f.is_file():
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def resolve_model(model: str | Path, cache_dir: Path | str | None = None, progress: bool = True) -> Path:
    """The store directory for `model`, converting a Hugging Face folder into the cache if needed."""
    builtin = builtin_models()
    path = builtin[str(model)] if str(model) in builtin else Path(model).expanduser()
    if (path / MANIFEST).exists():
        return path
    if not path.exists():
        names = ", ".join(builtin) or "none shipped yet"
        raise ModelNotFoundError(f"no model at {path}",
                                 hint=f"give a Hugging Face model folder, a converted store, or a built-in "
                                      f"model name ({names})")
    read_config(path)  # clear errors for a folder without a readable config.json
    store = Path(cache_dir or default_cache_dir()) / f"{path.name}-{_fingerprint(path)}"
    if (store / MANIFEST).exists():
        try:
            Manifest.load(store)
            return store
        except StoreError:
            pass  # an earlier conversion was damaged: convert again
    return convert(path, store, overwrite=True, progress=progress)
