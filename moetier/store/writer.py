"""Writes a store into a temporary directory and renames it into place only when complete."""

from __future__ import annotations

import os
import shutil
import tempfile
import zlib
from pathlib import Path

import torch
from safetensors.torch import save_file

from moetier.errors import StoreError
from moetier.store.format import DENSE, BlobRef, Manifest, PrecisionLayout


def tensor_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")


class StoreWriter:
    """with StoreWriter(dest) as w: w.write_dense(...); w.add_expert(...); w.commit(...)"""

    def __init__(self, dest: Path | str, overwrite: bool = False) -> None:
        self.dest = Path(dest)
        self.overwrite = overwrite
        self.blobs: list[BlobRef] = []
        self._files: dict[str, object] = {}

    def __enter__(self) -> StoreWriter:
        if self.dest.exists() and not self.overwrite:
            raise StoreError(f"{self.dest} already exists", hint="choose another path or pass --force to replace it")
        self.dest.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.dest.name}.tmp-", dir=self.dest.parent))
        os.chmod(self.tmp, 0o755)  # mkdtemp makes it private; a store is an ordinary folder
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        for f in self._files.values():
            f.close()
        if exc_type is not None and self.tmp.exists():
            shutil.rmtree(self.tmp, ignore_errors=True)

    def write_dense(self, tensors: dict[str, torch.Tensor]) -> None:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(self.tmp / DENSE))

    def add_expert(self, layer: int, expert: int, layout: PrecisionLayout, tensors: dict[str, torch.Tensor]) -> BlobRef:
        """Append one expert's blob (tensors packed by `layout`, zero-padded to the alignment)."""
        rel = f"experts/{layout.name}/layer_{layer:03d}.bin"
        f = self._files.get(rel)
        if f is None:
            (self.tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            f = self._files[rel] = open(self.tmp / rel, "wb")
        offset = f.tell()
        crc, written = 0, 0
        for t in layout.tensors:
            data = tensors[t.name]
            if tuple(data.shape) != t.shape:
                raise StoreError(f"expert {expert} of layer {layer}: {t.name} has shape {tuple(data.shape)}, "
                                 f"expected {t.shape}")
            assert written == t.offset, "layout offsets must be contiguous in tensor order"
            buf = tensor_bytes(data)
            f.write(buf)
            crc = zlib.crc32(buf, crc)
            written += len(buf)
        pad = bytes(layout.blob_bytes - written)
        f.write(pad)
        crc = zlib.crc32(pad, crc)
        ref = BlobRef(layer, expert, layout.name, rel, offset, layout.blob_bytes, crc)
        self.blobs.append(ref)
        return ref

    def copy_files(self, src_dir: Path, names: list[str]) -> tuple[str, ...]:
        for name in names:
            shutil.copy2(src_dir / name, self.tmp / name)
        return tuple(names)

    def commit(self, manifest: Manifest) -> Path:
        """Flush everything, write the manifest last, then rename the directory into place."""
        for f in self._files.values():
            f.flush()
            os.fsync(f.fileno())
            f.close()
        self._files.clear()
        manifest.save(self.tmp)
        if self.dest.exists():
            shutil.rmtree(self.dest)
        os.replace(self.tmp, self.dest)
        return self.dest
