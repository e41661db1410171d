"""Store format version 1: the manifest and the layout of one expert blob.

STORE/
  manifest.json                           written last; a store without it (or with complete=false) is invalid
  dense.safetensors                       every non-expert weight, under our canonical names
  experts/<precision>/layer_<NNN>.bin     one 4096-aligned blob per expert: gate_up_proj [2I, H], down_proj [H, I]
  tokenizer files                         copied from the checkpoint

A blob's layout is described per precision as a list of tensors with byte offsets, so later precisions
(int8/int4 with their scales) add tensors without changing the format.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path

import torch

from moetier.atomic import atomic_write_json
from moetier.errors import StoreError

FORMAT = "moetier-store"
VERSION = 1
ALIGN = 4096  # O_DIRECT needs block-aligned offsets, lengths and buffers
MANIFEST = "manifest.json"
DENSE = "dense.safetensors"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PRECISION_OF_DTYPE = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def align_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


@dataclass(frozen=True)
class TensorLayout:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # bytes from the start of the blob

    @property
    def nbytes(self) -> int:
        n = DTYPES[self.dtype].itemsize
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class PrecisionLayout:
    """How one expert's tensors sit in a blob of this precision."""

    name: str
    tensors: tuple[TensorLayout, ...]

    @property
    def nbytes(self) -> int:
        return max(t.offset + t.nbytes for t in self.tensors)

    @property
    def blob_bytes(self) -> int:
        return align_up(self.nbytes)

    @classmethod
    def swiglu(cls, name: str, dtype: str, hidden: int, intermediate: int) -> PrecisionLayout:
        gate_up = TensorLayout("gate_up_proj", dtype, (2 * intermediate, hidden), 0)
        down = TensorLayout("down_proj", dtype, (hidden, intermediate), gate_up.nbytes)
        return cls(name, (gate_up, down))

    @classmethod
    def from_json(cls, d: dict) -> PrecisionLayout:
        return cls(d["name"], tuple(TensorLayout(t["name"], t["dtype"], tuple(t["shape"]), t["offset"])
                                    for t in d["tensors"]))


@dataclass(frozen=True)
class BlobRef:
    """Where one expert at one precision lives on disk."""

    layer: int
    expert: int
    precision: str
    file: str  # relative to the store
    offset: int
    length: int  # padded to ALIGN
    crc32: int


@dataclass(frozen=True)
class Manifest:
    family: str
    config: dict
    precisions: dict[str, PrecisionLayout]
    native_precision: str
    blobs: tuple[BlobRef, ...]
    tokenizer_files: tuple[str, ...] = ()
    source: str = ""
    complete: bool = True
    version: int = VERSION

    def blob(self, layer: int, expert: int, precision: str | None = None) -> BlobRef:
        return self._index[(layer, expert, precision or self.native_precision)]

    @cached_property  # writes the instance __dict__ directly, so it works on a frozen dataclass
    def _index(self) -> dict[tuple[int, int, str], BlobRef]:
        return {(b.layer, b.expert, b.precision): b for b in self.blobs}

    def expert_bytes(self, precision: str | None = None) -> int:
        """Bytes of all experts at one precision, as the cache holds them (padded blobs)."""
        p = precision or self.native_precision
        return sum(b.length for b in self.blobs if b.precision == p)

    def to_json(self) -> dict:
        return {
            "format": FORMAT, "version": self.version, "complete": self.complete, "family": self.family,
            "source": self.source, "config": self.config, "tokenizer_files": list(self.tokenizer_files),
            "native_precision": self.native_precision,
            "precisions": {k: asdict(v) for k, v in self.precisions.items()},
            "experts": [[b.layer, b.expert, b.precision, b.file, b.offset, b.length, b.crc32] for b in self.blobs],
        }

    def save(self, store_dir: Path) -> None:
        atomic_write_json(store_dir / MANIFEST, self.to_json())

    @classmethod
    def load(cls, store_dir: Path) -> Manifest:
        path = store_dir / MANIFEST
        try:
            d = json.loads(path.read_text())
        except FileNotFoundError:
            raise StoreError(f"{store_dir} is not a moetier store (no {MANIFEST})",
                             hint="convert a Hugging Face checkpoint with `moetier convert HF_DIR STORE`") from None
        except (OSError, json.JSONDecodeError) as e:
            raise StoreError(f"cannot read {path}: {e}", hint="re-convert the model") from None
        if d.get("format") != FORMAT or d.get("version") != VERSION:
            raise StoreError(f"{path}: format {d.get('format')!r} version {d.get('version')!r} is not "
                             f"{FORMAT!r} version {VERSION}", hint="re-convert the model with this moetier")
        if not d.get("complete"):
            raise StoreError(f"{store_dir} is incomplete (conversion did not finish)", hint="re-convert the model")
        return cls(
            family=d["family"], config=d["config"], source=d.get("source", ""),
            tokenizer_files=tuple(d.get("tokenizer_files", ())), native_precision=d["native_precision"],
            precisions={k: PrecisionLayout.from_json(v) for k, v in d["precisions"].items()},
            blobs=tuple(BlobRef(*row) for row in d["experts"]),
        )


def check_files(store_dir: Path, manifest: Manifest) -> None:
    """A truncated store (a file shorter than its blobs reach) is refused before anything runs."""
    needed: dict[str, int] = {DENSE: 1}
    for b in manifest.blobs:
        needed[b.file] = max(needed.get(b.file, 0), b.offset + b.length)
    for name, size in needed.items():
        path = store_dir / name
        actual = path.stat().st_size if path.exists() else -1
        if actual < size:
            what = "is missing" if actual < 0 else f"is truncated ({actual} of {size} bytes)"
            raise StoreError(f"store file {path} {what}", hint="the store is damaged; re-convert the model")
