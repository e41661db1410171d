"""An opened, validated store: its manifest, model spec, dense weights and tokenizer."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from moetier.config import ModelSpec
from moetier.errors import StoreError
from moetier.model.families import parse_spec
from moetier.store.format import DENSE, Manifest, check_files


class Store:
    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self.manifest = Manifest.load(self.path)
        check_files(self.path, self.manifest)
        self.spec: ModelSpec = parse_spec(self.manifest.config)

    @property
    def native_layout(self):
        return self.manifest.precisions[self.manifest.native_precision]

    def load_dense(self) -> dict[str, torch.Tensor]:
        try:
            return load_file(str(self.path / DENSE))
        except Exception as e:  # safetensors' own error types
            raise StoreError(f"cannot read {self.path / DENSE}: {e}", hint="re-convert the model") from None

    @property
    def tokenizer_path(self) -> Path | None:
        path = self.path / "tokenizer.json"
        return path if path.exists() else None

    def total_expert_bytes(self) -> int:
        return self.manifest.expert_bytes()
