"""What a store's files are called and what a GGUF file is — the names `--model` is checked against before torch or
anything else loads (moetier/resolve.py's model_path): nothing here imports more than pathlib."""

from __future__ import annotations

from pathlib import Path

MANIFEST = "manifest.json"
DENSE = "dense.safetensors"
RECONVERT = ("re-convert it (`moetier generate --reconvert` for a model converted on first use, "
             "`moetier convert --force SRC STORE` otherwise)")


def is_gguf(path: Path | str) -> bool:
    return Path(path).suffix.lower() == ".gguf"
