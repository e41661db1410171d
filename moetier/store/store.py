"""An opened, validated store: its manifest, model spec, dense weights and tokenizer files, each checked against
the manifest's checksums as it is read."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from zlib_ng.zlib_ng import crc32

from moetier.config import ModelSpec
from moetier.errors import ChecksumError, StoreError
from moetier.model.families import parse_spec
from moetier.store.checkpoint import ST_DTYPES, safetensors_header
from moetier.store.format import DAMAGED, DTYPES, Manifest, check_files, is_store
from moetier.store.names import DENSE
from moetier.store.row_pages import mapped_rows
from moetier.store.writer import tensor_bytes

SAFETENSORS_ITEMSIZE = {"F32": 4, "BF16": 2, "F16": 2, "I8": 1, "U8": 1, "I64": 8, "I32": 4}


class Store:
    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self.manifest = Manifest.load(self.path)
        check_files(self.path, self.manifest)
        self.spec: ModelSpec = parse_spec(self.manifest.config)

    def trained_dir(self, folder: str = "policies") -> Path:
        """Where trained files for this model live (`folder`: policies, or predictors): beside the store, or beside
        the model it was converted from (the built-in models ship theirs), or, for a store inflated or merged from
        another (the same routers: a merged store's router sums each group's share of the same routing, and its
        predictors' scores are grouped the same way), where that one's live."""
        return _trained_dir(self.path, self.manifest, folder)

    @property
    def native_layout(self):
        return self.manifest.precisions[self.manifest.native_precision]

    @property
    def dense_bytes(self) -> int:
        """Size of the dense weights as loaded (the file, less its small header): known before loading them."""
        return (self.path / DENSE).stat().st_size

    def dense_tensors(self) -> dict[str, tuple[tuple[int, ...], int]]:
        """Each dense tensor's (shape, bytes), from the file's header alone."""
        with safe_open(self.path / DENSE, "pt") as f:
            out = {}
            for name in f.keys():
                piece = f.get_slice(name)
                shape = tuple(piece.get_shape())
                numel = 1
                for d in shape:
                    numel *= d
                out[name] = (shape, numel * SAFETENSORS_ITEMSIZE[piece.get_dtype()])
            return out

    def load_dense(self, convert: Callable[[str, torch.Tensor], object] | None = None,
                   by_row: tuple[str, ...] = (), skip: tuple[str, ...] = ()) -> dict:
        """Every dense tensor, each verified against its CRC-32: ~0.43 s per GB of dense weights here (0.41 s for
        OLMoE-1B-7B's 0.95 GB; safetensors maps the file lazily, so this is also the first touch of its pages).
        `convert(name, tensor)`, if given, makes what is kept of each tensor as it is read (a quantized copy): the
        tensors are then read one at a time into memory of their own, not mapped, and each one's pages of the file
        are dropped from the page cache once read — so the file is never all in memory beside what it becomes (under
        a memory cgroup its cached pages count against the limit). `by_row`: names of tensors a run reads a row at a
        time (an untied embedding table, not empty), each mapped on its own, its pages handed back as they are
        checked (store/row_pages.py). `skip`: names of mapped tensors not to load (a GGUF's float copies of what its
        blocks hold, when the blocks are what the run computes: `load_dense_blocks`), never touched."""
        expected = self.manifest.dense_crc32
        try:
            if convert is None:
                return self._dense_mapped(expected, by_row, skip)
            return self._dense_read(expected, convert)
        except (StoreError, ChecksumError):
            raise
        except Exception as e:  # safetensors' own error types, a damaged header
            raise StoreError(f"cannot read {self.path / DENSE}: {e}", hint=DAMAGED) from None

    def _check_names(self, names, expected: dict[str, int]) -> None:
        if set(names) != set(expected):
            diff = sorted(set(names) ^ set(expected))
            raise StoreError(f"{self.path / DENSE} does not hold the tensors its manifest lists ({diff[:3]} differ)",
                             hint=DAMAGED)

    def _check_crc(self, name: str, data, expected: dict[str, int], crc: int | None = None) -> None:
        """`data`'s CRC-32 (or `crc`, where it was summed as the data was read) against the manifest's."""
        if (crc32(data) if crc is None else crc) != expected[name]:
            raise ChecksumError(f"dense tensor {name} in {self.path / DENSE} fails its checksum", hint=DAMAGED)

    def _dense_mapped(self, expected: dict[str, int], by_row: tuple[str, ...],
                      skip: tuple[str, ...]) -> dict[str, torch.Tensor]:
        """Each tensor but those skipped a view of the file's mapping (paged in as it is used), checked; those
        `by_row` in mappings of their own, their pages handed back as they are."""
        with safe_open(self.path / DENSE, "pt") as f:
            self._check_names(f.keys(), expected)
            out = {name: f.get_tensor(name) for name in f.keys() if name not in by_row and name not in skip}
        header, start = safetensors_header(self.path / DENSE) if by_row else ({}, 0)
        for name in by_row:  # (each in a mapping of its own: the file's whole one goes with the other tensors)
            entry = header[name]
            (begin, end), dtype = entry["data_offsets"], DTYPES[ST_DTYPES[entry["dtype"]]]
            out[name], crc = mapped_rows(self.path / DENSE, start + begin, end - begin, dtype, tuple(entry["shape"]))
            self._check_crc(name, None, expected, crc)
        for name, t in out.items():
            if name not in by_row:
                self._check_crc(name, tensor_bytes(t), expected)
        return out

    def _dense_read(self, expected: dict[str, int], convert) -> dict[str, object]:
        """Each tensor read into memory of its own, checked, `convert`ed, its file pages dropped."""
        header, start = safetensors_header(self.path / DENSE)
        self._check_names(header, expected)
        out = {}
        fd = os.open(self.path / DENSE, os.O_RDONLY)
        try:
            for name, entry in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
                begin, end = entry["data_offsets"]
                data = bytearray(end - begin)
                if os.preadv(fd, [data], start + begin) != len(data):
                    raise StoreError(f"{self.path / DENSE} ends inside tensor {name}", hint=DAMAGED)
                os.posix_fadvise(fd, start + begin, end - begin, os.POSIX_FADV_DONTNEED)
                self._check_crc(name, data, expected)  # before any work is done on it
                dtype = DTYPES[ST_DTYPES[entry["dtype"]]]
                t = torch.frombuffer(data, dtype=dtype).view(entry["shape"]) if data else \
                    torch.empty(entry["shape"], dtype=dtype)
                out[name] = convert(name, t)
        finally:
            os.close(fd)
        return out

    def load_dense_blocks(self) -> dict:
        """A GGUF store's attention projections and head in the file's block formats (model/dense_quant.py's
        BlockMatrix), read from the file and checked against their checksums; {} for any other store."""
        from moetier.model.dense_quant import BlockMatrix
        from moetier.store.gguf_file import unpermute

        out = {}
        for name, block in self.manifest.dense_blocks.items():
            where = self.manifest.sources[block.source].path
            data = _read_at(where, block.offset, block.nbytes)
            if len(data) != block.nbytes or crc32(data) != block.crc32:
                raise ChecksumError(f"dense tensor {name} in {where} fails its checksum", hint=DAMAGED)
            rows = torch.frombuffer(data, dtype=torch.uint8).view(block.rows, -1)
            if block.heads:  # the converter's rotary permutation of Q/K rows, undone row by row
                rows = unpermute(rows, block.heads).contiguous()
            out[name] = BlockMatrix(rows, block.fmt, (block.rows, block.in_features))
        return out

    def read_expert(self, layer: int, expert: int, precision: str | None = None) -> dict[str, torch.Tensor]:
        """One expert's tensors, read synchronously and verified against its checksum (for tools that rewrite
        a store; the engine reads through ExpertReader)."""
        blob = self.manifest.blob(layer, expert, precision)
        data, crc, where = bytearray(blob.length), 0, self.path / blob.file
        if blob.linked:  # its segments, in blob order: the CRC covers them back to back
            for seg in sorted(blob.segments, key=lambda s: s.dest):
                where = self.manifest.sources[seg.source].path
                piece = _read_at(where, seg.offset, seg.length)
                data[seg.dest:seg.dest + len(piece)] = piece
                crc = crc32(piece, crc)
        else:
            piece = _read_at(where, blob.offset, blob.length)
            data[:len(piece)] = piece
            crc = crc32(piece) if len(piece) == blob.length else None
        if crc != blob.crc32:
            raise ChecksumError(f"expert {expert} of layer {layer} in {where} fails its checksum", hint=DAMAGED)
        return self.manifest.precisions[blob.precision].views(torch.frombuffer(data, dtype=torch.uint8), layer)

    def read_expert_values(self, layer: int, expert: int) -> dict[str, torch.Tensor]:
        """The native expert's tensors as values: a GGUF's block-format matrices dequantized (float32, as ggml does),
        float tensors as they are — what a quantized copy is made from."""
        from moetier.quant.ggml_blocks import FORMATS, dequantize

        tensors = self.read_expert(layer, expert)
        formats = {t.name: t.dtype for t in self.native_layout.tensors_of(layer)}
        return {name: dequantize(t.reshape(t.shape[0], -1), formats[name]) if formats[name] in FORMATS else t
                for name, t in tensors.items()}

    def read_file(self, name: str) -> bytes:
        """A copied file (tokenizer.json, ...), verified against its checksum."""
        data = (self.path / name).read_bytes()
        if name in self.manifest.file_crc32 and crc32(data) != self.manifest.file_crc32[name]:
            raise ChecksumError(f"{self.path / name} fails its checksum", hint=DAMAGED)
        return data

    @property
    def tokenizer_path(self) -> Path | None:
        path = self.path / "tokenizer.json"
        return path if path.exists() else None

    def total_expert_bytes(self) -> int:
        return self.manifest.expert_bytes()


def _read_at(path: str | Path, offset: int, length: int) -> bytearray:
    """`length` bytes of the file from `offset` (fewer where it ends first) in memory of their own — read there, not
    copied there (a GGUF's head is 0.6 GB) — and the page cache's copy let go."""
    data = bytearray(length)
    fd = os.open(path, os.O_RDONLY)
    try:
        n = os.preadv(fd, [data], offset) if length else 0
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    del data[n:]
    return data


def _trained_dir(path: Path, manifest: Manifest, folder: str) -> Path:
    if (path / folder).is_dir():
        return path
    source = Path(manifest.source) if manifest.source else None
    if source is not None and (source / folder).is_dir():
        return source
    base = (manifest.config.get("moetier_inflated") or manifest.config.get("moetier_merged") or {}).get("from")
    if base and is_store(Path(base)):
        found = _trained_dir(Path(base), Manifest.load(Path(base)), folder)
        if (found / folder).is_dir():
            return found
    return path
