"""Writes a store into a temporary directory and renames it into place only when complete."""

from __future__ import annotations

import dataclasses
import os
import shutil
from contextlib import ExitStack
from pathlib import Path
from typing import BinaryIO

import torch
from safetensors.torch import save_file
from zlib_ng.zlib_ng import crc32

from moetier.atomic import atomic_dir, check_free_space, check_replaceable, ordinary_mode
from moetier.errors import StoreError
from moetier.store.format import DTYPES, BlobRef, Manifest, PrecisionLayout, Segment, is_store
from moetier.store.names import DENSE


def tensor_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()).cast("B")


def file_crc32(path: Path, chunk: int = 16 << 20) -> int:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            crc = crc32(block, crc)
    return crc


def expert_file(precision: str, layer: int) -> str:
    """Where a layer's experts at one precision live, relative to the store."""
    return f"experts/{precision}/layer_{layer:03d}.bin"


def write_blob(f: BinaryIO, layout: PrecisionLayout, tensors: dict[str, torch.Tensor], what: str,
               blob_bytes: int | None = None) -> int:
    """Write one expert's tensors packed by `layout` (zeros between them and up to the blob's padded length,
    `blob_bytes` where a layer's layout is smaller than the precision's slots) at `f`'s position; returns the
    blob's CRC-32."""
    crc, written = 0, 0
    for t in layout.tensors:
        data = tensors[t.name]
        if tuple(data.shape) != t.shape or data.dtype != DTYPES[t.dtype]:
            raise StoreError(f"{what}: {t.name} is {data.dtype} {tuple(data.shape)}, expected {t.dtype} {t.shape}")
        assert written <= t.offset, "layout offsets must ascend in tensor order"
        for buf in (bytes(t.offset - written), tensor_bytes(data)):  # the gap to its start, then the tensor
            f.write(buf)
            crc = crc32(buf, crc)
        written = t.offset + t.nbytes
    pad = bytes((blob_bytes or layout.blob_bytes) - written)
    f.write(pad)
    return crc32(pad, crc)


MANIFEST_BYTES_PER_BLOB = 256  # a blob's entry in manifest.json is ~130 characters; the rest is slack
MANIFEST_BYTES_PER_LINKED_BLOB = 768  # with its segments: ~60 characters each beside the file name, up to three


def store_bytes(dense_bytes: int, blobs: int, blob_bytes: int, file_bytes: int = 0) -> int:
    """What a store of `blobs` expert blobs of `blob_bytes` (on average), `dense_bytes` of dense tensors and
    `file_bytes` of copied files takes on disk, its manifest included (a safetensors header and the folder's own
    blocks are inside the 64 KiB of slack)."""
    return dense_bytes + blobs * (blob_bytes + MANIFEST_BYTES_PER_BLOB) + file_bytes + (64 << 10)


class StoreWriter:
    """with StoreWriter(dest) as w: w.write_dense(...); w.add_expert(...); w.commit(...)

    `overwrite` replaces an existing store (only a store: any other folder is refused), never one of `sources`.
    `expected_bytes` (see `store_bytes`): refused before anything is written if the disk has no room for it."""

    def __init__(self, dest: Path | str, overwrite: bool = False, sources: tuple[Path, ...] = (),
                 expected_bytes: int = 0) -> None:
        self.dest = Path(dest)
        self.overwrite = overwrite
        self.sources = sources
        self.expected_bytes = expected_bytes
        self.blobs: list[BlobRef] = []
        self.dense_crc32: dict[str, int] = {}
        self.file_crc32: dict[str, int] = {}
        self._files: dict[str, object] = {}
        self._committed = False
        self._stack = ExitStack()

    def __enter__(self) -> StoreWriter:
        check_replaceable(self.dest, "store", is_store, self.overwrite, self.sources)
        check_free_space(self.dest, self.expected_bytes, f"the store {self.dest.name}")
        self.tmp = self._stack.enter_context(atomic_dir(self.dest))  # renamed into place on a clean exit
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        for f in self._files.values():
            f.close()
        if exc_type is None and not self._committed:  # never let a store without its manifest land
            exc = StoreError(f"{self.dest}: the store was not committed")
            self._stack.__exit__(type(exc), exc, None)
            raise exc
        self._stack.__exit__(exc_type, exc, tb)

    def write_dense(self, tensors: dict[str, torch.Tensor]) -> None:
        tensors = {k: v.contiguous() for k, v in tensors.items()}
        self.dense_crc32 = {k: crc32(tensor_bytes(v)) for k, v in tensors.items()}
        save_file(tensors, str(self.tmp / DENSE))
        os.chmod(self.tmp / DENSE, ordinary_mode())  # safetensors writes it 0600; the store's other files are not

    def add_expert(self, layer: int, expert: int, layout: PrecisionLayout, tensors: dict[str, torch.Tensor]) -> BlobRef:
        """Append one expert's blob (tensors packed by `layout`, zero-padded to the alignment)."""
        rel = expert_file(layout.name, layer)
        f = self._files.get(rel)
        if f is None:
            (self.tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            f = self._files[rel] = open(self.tmp / rel, "wb")
        offset = f.tell()
        # (a layout that differs by layer: this layer's tensors, padded to the largest layer's blob)
        crc = write_blob(f, layout.for_layer(layer), tensors, f"expert {expert} of layer {layer}", layout.blob_bytes)
        ref = BlobRef(layer, expert, layout.name, rel, offset, layout.blob_bytes, crc)
        self.blobs.append(ref)
        return ref

    def add_linked(self, layer: int, expert: int, layout: PrecisionLayout, segments: tuple[Segment, ...],
                   crc: int) -> BlobRef:
        """A blob that stays in the source's files: its segments there, and their checksum."""
        ref = BlobRef(layer, expert, layout.name, "", 0, layout.blob_bytes, crc, segments)
        self.blobs.append(ref)
        return ref

    def copy_files(self, src_dir: Path, names: list[str]) -> tuple[str, ...]:
        for name in names:
            shutil.copyfile(src_dir / name, self.tmp / name)  # the bytes; the mode is the umask's, as the rest
            self.add_file(name)
        return tuple(names)

    def add_file(self, name: str) -> None:
        """Checksum a file written into the store (tokenizer, generation config)."""
        self.file_crc32[name] = file_crc32(self.tmp / name)

    def commit(self, manifest: Manifest) -> Path:
        """Flush everything and write the manifest last; the directory is renamed into place when the `with`
        block ends."""
        for f in self._files.values():
            f.flush()
            os.fsync(f.fileno())
            f.close()
        self._files.clear()
        manifest = dataclasses.replace(manifest, dense_crc32=self.dense_crc32, file_crc32=self.file_crc32)
        manifest.save(self.tmp)
        self._committed = True
        return self.dest
