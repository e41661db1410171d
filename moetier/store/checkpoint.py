"""Reads a Hugging Face checkpoint folder: config.json and tensors spread over *.safetensors shards."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from moetier.errors import CheckpointError, ModelNotFoundError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "generation_config.json", "chat_template.jinja")


def read_config(model_dir: Path) -> dict:
    if not model_dir.exists():
        raise ModelNotFoundError(f"model folder {model_dir} does not exist",
                                 hint="give a Hugging Face model folder, a converted store, or a built-in model name")
    if not model_dir.is_dir():
        raise ModelNotFoundError(f"{model_dir} is not a folder", hint="give the folder that holds config.json")
    path = model_dir / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelNotFoundError(f"{model_dir} has no config.json",
                                 hint="a Hugging Face model folder holds config.json and *.safetensors") from None
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None


ST_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "I8": "int8", "U8": "uint8"}


@dataclass(frozen=True)
class Located:
    """Where a tensor's bytes lie in its safetensors file (row-major, contiguous: safetensors stores no strides)."""

    path: Path
    offset: int  # from the start of the file
    nbytes: int
    dtype: str  # torch's name ("bfloat16"), or safetensors' own for types torch has no name for here
    shape: tuple[int, ...]

    def slice(self, index: int) -> Located:
        """The `index`-th slice along the first dimension (one expert of a stacked tensor)."""
        step = self.nbytes // self.shape[0]
        return Located(self.path, self.offset + index * step, step, self.dtype, self.shape[1:])


def safetensors_header(path: Path) -> tuple[dict, int]:
    """(the header's tensor entries, where the data begins) of a safetensors file."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header, 8 + size


class Checkpoint:
    """Lazy access to named tensors across shards; each tensor is read only when asked for."""

    def __init__(self, model_dir: Path) -> None:
        self.dir = model_dir
        self.config = read_config(model_dir)
        shards = sorted(model_dir.glob("*.safetensors"))
        if not shards:
            raise CheckpointError(f"{model_dir} has no *.safetensors files",
                                  hint="moetier reads safetensors checkpoints; re-save the model with "
                                       "save_pretrained(safe_serialization=True)")
        self._where: dict[str, Path] = {}
        self._handles: dict[Path, object] = {}
        self._headers: dict[Path, tuple[dict, int]] = {}
        for shard in shards:
            try:
                with safe_open(str(shard), framework="pt") as f:
                    for name in f.keys():
                        self._where[name] = shard
            except Exception as e:  # safetensors raises its own error types for corrupt headers
                raise CheckpointError(f"cannot read {shard}: {e}", hint="the checkpoint file is damaged") from None

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def _handle(self, name: str):
        shard = self._where.get(name)
        if shard is None:
            raise CheckpointError(f"tensor {name!r} is missing from the checkpoint in {self.dir}",
                                  hint="the checkpoint is incomplete or not of the family its config.json names")
        handle = self._handles.get(shard)
        if handle is None:
            handle = self._handles[shard] = safe_open(str(shard), framework="pt")
        return handle

    def get(self, name: str) -> torch.Tensor:
        return self._handle(name).get_tensor(name)

    def get_slice(self, name: str, index: int) -> torch.Tensor:
        """`get(name)[index]`, reading only that slice (one expert of a tensor stacking them all)."""
        return self._handle(name).get_slice(name)[index]

    def locate(self, name: str) -> Located:
        """Where tensor `name`'s bytes lie on disk (read from its shard's header, once per shard)."""
        self._handle(name)  # a missing tensor is refused as `get` refuses it
        shard = self._where[name]
        if shard not in self._headers:
            self._headers[shard] = safetensors_header(shard)
        header, start = self._headers[shard]
        entry = header[name]
        begin, end = entry["data_offsets"]
        return Located(shard, start + begin, end - begin, ST_DTYPES.get(entry["dtype"], entry["dtype"]),
                       tuple(entry["shape"]))

    def tokenizer_files(self) -> list[str]:
        return [n for n in TOKENIZER_FILES if (self.dir / n).exists()]
