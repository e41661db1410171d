"""Store format: the manifest and the layout of one expert blob.

STORE/
  manifest.json                           written last; a store without it (or with complete=false) is invalid
  dense.safetensors                       every non-expert weight, under our canonical names
  experts/<precision>/layer_<NNN>.bin     one 4096-aligned blob per expert: gate_up_proj [2I, H], down_proj [H, I]
  tokenizer files                         copied from the checkpoint

A blob's layout is described per precision as a list of tensors with byte offsets, so later precisions
(int8/int4 with their scales) add tensors without changing the format. Every byte a run depends on has a CRC-32 in
the manifest: each expert blob, each dense tensor, each copied file (version 2 added the last two; a version 1
store is refused with a hint to re-convert).

Version 3 (a *linked* store) adds blobs that are not in the store: the model's own experts read where they lie in
the checkpoint's safetensors files, each blob a list of segments (a file, an offset and a length there, and where
the bytes go in the blob). The manifest names each such source file with its size and modification time, checked
at every open: a changed source is never read. Quantized copies are always real blobs in the store. A store
without segments is written as version 2, which every moetier since reads alike.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path, PurePosixPath

import torch

from moetier.atomic import atomic_write_json, marked_json
from moetier.config import ALIGN
from moetier.errors import StoreError, integer, parsing
from moetier.quant.ggml_blocks import FORMATS as BLOCK_FORMATS
from moetier.store.names import DENSE, MANIFEST, RECONVERT

FORMAT = "moetier-store"
VERSION = 2
LINKED_VERSION = 3  # a store whose blobs may point into its source's files
VERSIONS = (VERSION, LINKED_VERSION)
DAMAGED = f"the store is damaged; {RECONVERT}"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int8": torch.int8,
          "uint8": torch.uint8,  # the integer ones: quantized codes (moetier/quant/codes.py)
          **{fmt: torch.uint8 for fmt in BLOCK_FORMATS}}  # GGML's blocks, as bytes
# [N, row bytes] (moetier/quant/ggml_blocks.py): the dtype names the format a kernel reads them in
PRECISION_OF_DTYPE = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


TENSOR_ALIGN = 64  # a tensor's start inside a blob of several (a cache line)
PHASE_ALIGN = 8  # a linked slot's offset into its page is a multiple of this (safetensors pads its header to 8):
# the slot's tensor views need their elements aligned


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
    """How one expert's tensors sit in a blob of this precision. `layers`: the layers whose experts sit otherwise
    (a GGUF's Q4_K_M keeps some layers' down_proj in Q6_K, the rest in Q4_K: one precision, two layouts); a slot
    is sized for the largest, and its views are made for the layer of the expert that lands in it."""

    name: str
    tensors: tuple[TensorLayout, ...]
    layers: dict[int, tuple[TensorLayout, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for tensors in (self.tensors, *self.layers.values()):
            if [t.name for t in tensors] != [t.name for t in self.tensors]:
                raise ValueError(f"precision {self.name}: a layer's layout names other tensors than the others'")

    def tensors_of(self, layer: int | None) -> tuple[TensorLayout, ...]:
        """The tensors of an expert of `layer` (None: the layout most layers have)."""
        return self.layers.get(layer, self.tensors) if self.layers else self.tensors

    @property
    def nbytes(self) -> int:
        return max(t.offset + t.nbytes for tensors in (self.tensors, *self.layers.values()) for t in tensors)

    @property
    def blob_bytes(self) -> int:
        return align_up(self.nbytes)

    def views(self, blob: torch.Tensor, layer: int | None = None) -> dict[str, torch.Tensor]:
        """One expert's tensors (of `layer`, where layers differ) as views of its bytes `blob` [>= nbytes] uint8."""
        return {t.name: blob[t.offset:t.offset + t.nbytes].view(DTYPES[t.dtype]).view(t.shape)
                for t in self.tensors_of(layer)}

    def formats(self, layer: int | None = None) -> dict[str, str]:
        """Each tensor's dtype name in `layer`'s experts (a block format's name for GGML blocks)."""
        return {t.name: t.dtype for t in self.tensors_of(layer)}

    def for_layer(self, layer: int) -> PrecisionLayout:
        """The layout of `layer`'s experts alone."""
        return PrecisionLayout(self.name, self.tensors_of(layer))

    @classmethod
    def swiglu(cls, name: str, dtype: str, hidden: int, intermediate: int) -> PrecisionLayout:
        gate_up = TensorLayout("gate_up_proj", dtype, (2 * intermediate, hidden), 0)
        down = TensorLayout("down_proj", dtype, (hidden, intermediate), gate_up.nbytes)
        return cls(name, (gate_up, down))

    @classmethod
    def packed(cls, name: str, tensors: list[tuple[str, str, tuple[int, ...]]]) -> PrecisionLayout:
        """(name, dtype, shape) in order, each starting at a multiple of TENSOR_ALIGN (a kernel's vector loads
        and a dtype view both want an aligned start)."""
        out, offset = [], 0
        for tname, dtype, shape in tensors:
            t = TensorLayout(tname, dtype, tuple(shape), offset)
            out.append(t)
            offset = align_up(t.offset + t.nbytes, TENSOR_ALIGN)
        return cls(name, tuple(out))



@dataclass(frozen=True)
class Segment:
    """Bytes of a linked blob that lie in a source file: `length` bytes at `offset` there, at `dest` in the blob."""

    source: str  # a key of Manifest.sources
    offset: int
    length: int
    dest: int


@dataclass(frozen=True)
class SourceFile:
    """A file a linked store reads from, as it was when the store indexed it."""

    path: str  # absolute
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, path: Path) -> SourceFile:
        st = path.stat()
        return cls(str(path.resolve()), st.st_size, st.st_mtime_ns)


@dataclass(frozen=True)
class DenseBlock:
    """A dense matrix a GGUF keeps in a block format, computed in it (model/dense_quant.py's BlockMatrix): its
    `nbytes` at `offset` in source file `source` — [rows, in_features] weights in `fmt` — their CRC-32, and the
    heads whose rows llama.cpp's converter permuted (0: none)."""

    source: str  # a key of Manifest.sources
    offset: int
    nbytes: int
    fmt: str
    rows: int
    in_features: int
    crc32: int
    heads: int = 0

    def __post_init__(self) -> None:
        if self.fmt not in BLOCK_FORMATS or self.nbytes != self.rows * BLOCK_FORMATS[self.fmt].row_bytes(
                self.in_features):
            raise ValueError(f"a {self.fmt} matrix [{self.rows}, {self.in_features}] is not {self.nbytes} bytes")


@dataclass(frozen=True)
class BlobRef:
    """Where one expert at one precision lives on disk: `length` bytes at `offset` in the store's `file`, or, for a
    linked blob, its `segments` in source files (`file` empty; `crc32` over the segments' bytes in blob order)."""

    layer: int
    expert: int
    precision: str
    file: str  # relative to the store ("" for a linked blob)
    offset: int
    length: int  # padded to ALIGN
    crc32: int
    segments: tuple[Segment, ...] = ()

    @property
    def linked(self) -> bool:
        return bool(self.segments)

    @property
    def phase(self) -> int:
        """Where in an ALIGN-sized page its bytes start in their files, for a linked blob whose segments all agree
        (tensors of whole pages after one header: the usual checkpoint): a slot that starts as far into a page
        takes every whole page of the file by O_DIRECT in place, and only a segment's first and last partial page
        through a bounce buffer. 0 otherwise (a store's own blobs are aligned; segments that disagree are copied
        through bounce buffers)."""
        phases = {(s.offset - s.dest) % ALIGN for s in self.segments}
        phase = phases.pop() if len(phases) == 1 else 0
        return phase if phase % PHASE_ALIGN == 0 else 0


@dataclass(frozen=True)
class Manifest:
    family: str
    config: dict
    precisions: dict[str, PrecisionLayout]
    native_precision: str
    blobs: tuple[BlobRef, ...]
    tokenizer_files: tuple[str, ...] = ()
    source: str = ""
    dense_crc32: dict[str, int] = field(default_factory=dict)  # per dense tensor, over its raw bytes
    file_crc32: dict[str, int] = field(default_factory=dict)  # per copied file (tokenizer, generation config)
    sources: dict[str, SourceFile] = field(default_factory=dict)  # what linked blobs read, by name
    complete: bool = True
    dense_blocks: dict[str, DenseBlock] = field(default_factory=dict)  # a GGUF's dense matrices in their blocks

    @property
    def version(self) -> int:
        return LINKED_VERSION if self.sources else VERSION

    def linked(self, precision: str) -> bool:
        """Whether the experts at `precision` are read from the checkpoint's files (a linked store's own)."""
        return bool(self.sources) and any(b.linked for b in self.blobs if b.precision == precision)

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
            "precisions": {k: _layout_json(v) for k, v in self.precisions.items()},
            "dense_crc32": self.dense_crc32, "file_crc32": self.file_crc32,
            **({"sources": {k: asdict(v) for k, v in self.sources.items()}} if self.sources else {}),
            **({"dense_blocks": {k: list(dataclasses.astuple(v)) for k, v in self.dense_blocks.items()}}
               if self.dense_blocks else {}),
            "experts": [[b.layer, b.expert, b.precision, b.file, b.offset, b.length, b.crc32]
                        + ([[list(dataclasses.astuple(s)) for s in b.segments]] if b.segments else [])
                        for b in self.blobs],
        }

    def save(self, store_dir: Path) -> None:
        atomic_write_json(store_dir / MANIFEST, self.to_json())

    @classmethod
    def load(cls, store_dir: Path) -> Manifest:
        path = store_dir / MANIFEST
        try:
            d = json.loads(path.read_bytes())
        except FileNotFoundError:
            raise StoreError(f"{store_dir} is not a moetier store (no {MANIFEST})",
                             hint="convert a Hugging Face checkpoint with `moetier convert HF_DIR STORE`") from None
        except (OSError, ValueError) as e:
            raise StoreError(f"cannot read {path}: {e}", hint=DAMAGED) from None
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise StoreError(f"{path} is not a moetier store manifest", hint=DAMAGED)
        if d.get("version") not in VERSIONS:
            raise StoreError(f"{path}: store format version {d.get('version')!r}; this moetier reads versions "
                             f"{', '.join(map(str, VERSIONS))}", hint=RECONVERT)
        if d.get("complete") is not True:
            raise StoreError(f"{store_dir} is incomplete (conversion did not finish)", hint=DAMAGED)
        with parsing(str(path), StoreError, hint=DAMAGED):
            return _parse_manifest(d)


def _parse_manifest(d: dict) -> Manifest:
    precisions = {str(k): _parse_layout(k, v) for k, v in d["precisions"].items()}
    native = d["native_precision"]
    if native not in precisions:
        raise ValueError(f"native precision {native!r} has no layout")
    sources = {_text(k, "source name"): _parse_source(v) for k, v in _mapping(d.get("sources", {}), "sources").items()}
    blobs = tuple(_parse_blob(row, precisions, sources) for row in d["experts"])
    return Manifest(
        family=_text(d["family"], "family"), config=_mapping(d["config"], "config"), precisions=precisions,
        native_precision=native, blobs=blobs, source=_text(d.get("source", ""), "source"),
        tokenizer_files=tuple(_relative(f) for f in d.get("tokenizer_files", ())),
        dense_crc32={_text(k, "tensor name"): integer(v, "crc32", 0) for k, v in _mapping(d["dense_crc32"],
                                                                                            "dense_crc32").items()},
        file_crc32={_relative(k): integer(v, "crc32", 0) for k, v in _mapping(d["file_crc32"], "file_crc32").items()},
        sources=sources,
        dense_blocks={_text(k, "tensor name"): _parse_dense_block(v, sources)
                      for k, v in _mapping(d.get("dense_blocks", {}), "dense_blocks").items()})


def _parse_dense_block(row: list, sources: dict[str, SourceFile]) -> DenseBlock:
    source, offset, nbytes, fmt, rows, k, crc, heads = row
    if source not in sources:
        raise ValueError(f"a dense matrix reads from {source!r}, which the manifest's sources do not name")
    block = DenseBlock(source, integer(offset, "offset", 0), integer(nbytes, "length", 1), _text(fmt, "format"),
                       integer(rows, "rows", 1), integer(k, "in_features", 1), integer(crc, "crc32", 0),
                       integer(heads, "heads", 0))
    if block.offset + block.nbytes > sources[source].size:
        raise ValueError(f"a dense matrix of {block.nbytes} bytes reaches past its source file")
    return block


def _parse_source(d: dict) -> SourceFile:
    path = _text(d["path"], "source path")
    if not PurePosixPath(path).is_absolute():
        raise ValueError(f"source file {path!r} is not an absolute path")
    return SourceFile(path, integer(d["size"], "source size", 0), integer(d["mtime_ns"], "source time", 0))


def _layout_json(layout: PrecisionLayout) -> dict:
    """A layout as the manifest keeps it (`layers` only where some layer's experts sit otherwise)."""
    d = asdict(layout)
    if not layout.layers:
        del d["layers"]
    return d


def _parse_layout(name, d: dict) -> PrecisionLayout:
    if d["name"] != name:
        raise ValueError(f"precision {name!r}: misnamed layout")
    layers = {integer(int(k), "layer", 0): _parse_tensors(name, v)
              for k, v in _mapping(d.get("layers", {}), "layers").items()}
    return PrecisionLayout(name, _parse_tensors(name, d["tensors"]), layers)


def _parse_tensors(name: str, rows: list) -> tuple[TensorLayout, ...]:
    tensors = []
    for t in rows:
        if t["dtype"] not in DTYPES:
            raise ValueError(f"precision {name}: unknown dtype {t['dtype']!r}")
        shape = tuple(integer(n, "tensor dimension", 1) for n in t["shape"])
        tensors.append(TensorLayout(_text(t["name"], "tensor name"), t["dtype"], shape, integer(t["offset"], "offset", 0)))
    if not tensors:
        raise ValueError(f"precision {name!r}: an empty layout")
    return tuple(tensors)


def _parse_blob(row: list, precisions: dict[str, PrecisionLayout], sources: dict[str, SourceFile]) -> BlobRef:
    layer, expert, precision, file, offset, length, crc, *rest = row
    if precision not in precisions:
        raise ValueError(f"expert blob of unknown precision {precision!r}")
    if integer(length, "blob length", 1) < precisions[precision].nbytes:
        raise ValueError(f"expert {expert} of layer {layer}: blob of {length} bytes is shorter than its layout")
    if integer(offset, "blob offset", 0) % ALIGN or length % ALIGN:
        raise ValueError(f"expert {expert} of layer {layer}: blob not {ALIGN}-aligned")
    segments = tuple(_parse_segment(s, sources, length) for s in rest[0]) if rest else ()
    if len(rest) > 1 or (rest and not segments):
        raise ValueError(f"expert {expert} of layer {layer}: a malformed row")
    return BlobRef(integer(layer, "layer", 0), integer(expert, "expert", 0), precision,
                   "" if segments else _relative(file), offset, length, integer(crc, "crc32", 0), segments)


def _parse_segment(row: list, sources: dict[str, SourceFile], blob_length: int) -> Segment:
    source, offset, length, dest = row
    if source not in sources:
        raise ValueError(f"a segment reads from {source!r}, which the manifest's sources do not name")
    seg = Segment(source, integer(offset, "segment offset", 0), integer(length, "segment length", 1),
                  integer(dest, "segment destination", 0))
    if seg.dest + seg.length > blob_length or seg.offset + seg.length > sources[source].size:
        raise ValueError(f"a segment of {seg.length} bytes reaches past its blob or its source file")
    return seg


def _text(value, name: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{name} must be text, got {value!r}")
    return value


def _mapping(value, name: str) -> dict:
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be an object, got {type(value).__name__}")
    return value


def _relative(name) -> str:
    """A path inside the store: relative, without `..` (a manifest never points outside its store)."""
    p = PurePosixPath(_text(name, "file name"))
    if p.is_absolute() or ".." in p.parts or not p.parts:
        raise ValueError(f"file {name!r} is not a path inside the store")
    return str(p)


def is_store(path: Path) -> bool:
    """A folder moetier made as a store: its manifest says so (or, damaged past reading, sits beside the dense
    weights of one)."""
    manifest = path / MANIFEST
    return marked_json(manifest, "format", FORMAT) or (manifest.exists() and (path / DENSE).exists()
                                                      and not _is_json(manifest))


def _is_json(path: Path) -> bool:
    try:
        json.loads(path.read_bytes())
        return True
    except (OSError, ValueError):
        return False


def check_files(store_dir: Path, manifest: Manifest) -> None:
    """A truncated store (a file shorter than its blobs reach) is refused before anything runs; so is a linked
    store whose source files changed since it indexed them (their size or modification time)."""
    for source in manifest.sources.values():
        check_source(store_dir, source)
    needed: dict[str, int] = {DENSE: 1}
    for b in manifest.blobs:
        if not b.linked:
            needed[b.file] = max(needed.get(b.file, 0), b.offset + b.length)
    for name, size in needed.items():
        path = store_dir / name
        actual = path.stat().st_size if path.exists() else -1
        if actual < size:
            what = "is missing" if actual < 0 else f"is truncated ({actual} of {size} bytes)"
            raise StoreError(f"store file {path} {what}", hint=DAMAGED)


def check_source(store_dir: Path, source: SourceFile) -> None:
    path = Path(source.path)
    try:
        st = path.stat()
    except OSError as e:
        raise StoreError(f"{store_dir} reads its experts from {path}, which cannot be opened ({e.strerror})",
                         hint=f"put the model back where it was, or {RECONVERT}") from None
    if (st.st_size, st.st_mtime_ns) != (source.size, source.mtime_ns):
        raise StoreError(f"{path} changed since {store_dir} indexed it (size {source.size} -> {st.st_size}, or its "
                         f"modification time): its experts are not read stale", hint=RECONVERT)
