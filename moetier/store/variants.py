"""Adding quantized copies of every expert to an existing store (`moetier quantize STORE --precisions int8,int4`).

Atomic and resumable: each layer's blobs are written to a temporary file renamed into place, then a sidecar
`layer_NNN.json` records their references; the manifest, rewritten last through a rename, is what makes the new
precision part of the store. Killed at any point, the store is unchanged as far as any reader can tell (the
manifest does not name the new files yet), and the next run keeps every layer whose sidecar matches its file and
writes only the rest. Readers of the store may run meanwhile."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Iterable
from pathlib import Path

from moetier.atomic import FULL, atomic_write_json, check_free_space, disk_full, target_lock
from moetier.config import ModelSpec
from moetier.errors import StoreError
from moetier.progress import tqdm
from moetier.quant.precisions import QUANTIZED, is_block, quantize_expert
from moetier.store.format import BlobRef, PrecisionLayout
from moetier.store.quantize import expert_layout
from moetier.store.store import Store
from moetier.store.writer import MANIFEST_BYTES_PER_BLOB, expert_file, write_blob

SIDECAR_FORMAT = "moetier-layer-blobs"
BLOCK_ACTIVATIONS = ("swiglu", "swiglu-clamped")  # the experts GgmlExpert and GgmlClampedExpert compute


def parse_precisions(text: str | Iterable[str], native: str) -> list[str]:
    """`bf16,int8,int4` -> the quantized precisions to add (the store's own precision may be listed; it is always
    there). Unknown or foreign float precisions are refused with what is known."""
    names = [p.strip() for p in (text.split(",") if isinstance(text, str) else text) if p.strip()]
    if not names:
        raise StoreError("no precision given", hint=f"e.g. --precisions {native},int8,int4")
    out = []
    for p in names:
        if p == native:
            continue
        if p not in QUANTIZED:
            known = ", ".join([native, *QUANTIZED])
            raise StoreError(f"unknown or unavailable precision {p!r} (this store's experts are {native})",
                             hint=f"choose from {known}")
        if p not in out:
            out.append(p)
    return out


def expert_layouts(spec: ModelSpec, precisions: Iterable[str]) -> dict[str, PrecisionLayout]:
    """The blob layout of each quantized precision for this model's experts (refused if its shape cannot be, or a
    GGML format for experts its kernels do not compute: SwiGLU's, and gpt-oss's clamped SwiGLU with its biases)."""
    precisions = list(precisions)
    blocks = [p for p in precisions if is_block(p)]
    if blocks and spec.activation not in BLOCK_ACTIVATIONS:
        raise StoreError(f"{blocks[0]} copies are for SwiGLU experts (gpt-oss's clamped ones too); this model's are "
                         f"{spec.activation}", hint="use int8, int4 or int2")
    try:
        return {p: expert_layout(p, spec.expert_shapes, spec.moe_layers) for p in precisions}
    except ValueError as e:
        raise StoreError(f"cannot quantize this model's experts: {e}") from None


def add_precisions(store_dir: Path | str, precisions: str | Iterable[str], progress: bool = True) -> list[str]:
    """Add each of `precisions` the store lacks; returns those added (none if it had them all)."""
    store_dir = Path(store_dir)
    with target_lock(store_dir):
        store = Store(store_dir)
        manifest = store.manifest
        wanted = [p for p in parse_precisions(precisions, manifest.native_precision) if p not in manifest.precisions]
        if not wanted:
            return []
        layouts = expert_layouts(store.spec, wanted)
        blobs = list(manifest.blobs)
        spec = store.spec
        total = len(wanted) * spec.num_expert_keys
        _check_room(store, layouts)
        with tqdm(total=total, desc=f"quantize {store_dir.name} to {','.join(wanted)}", unit="expert",
                  disable=not progress) as bar:
            try:
                for layer in spec.moe_layers:
                    blobs += _layer(store, layer, layouts, bar)
            except OSError as e:  # the layer's partial file is gone; the store is as it was, finished layers kept
                if e.errno in FULL:
                    raise disk_full(store_dir, e) from None
                raise
        manifest = dataclasses.replace(manifest, precisions={**manifest.precisions, **layouts}, blobs=tuple(blobs))
        manifest.save(store_dir)  # the commit point
        for p in wanted:
            for layer in spec.moe_layers:
                _sidecar(store_dir, p, layer).unlink(missing_ok=True)
        return wanted


def _sidecar(store_dir: Path, precision: str, layer: int) -> Path:
    return (store_dir / expert_file(precision, layer)).with_suffix(".json")


def _check_room(store: Store, layouts: dict[str, PrecisionLayout]) -> None:
    """The copies still to write (a resumed run keeps what an earlier one finished), refused before any is
    written if the store's disk has no room for them."""
    spec = store.spec
    done = sum((store.path / expert_file(p, layer)).stat().st_size for p, layout in layouts.items()
               for layer in spec.moe_layers if _kept(store.path / expert_file(p, layer), _sidecar(store.path, p, layer),
                                                     layout, len(spec.experts_of(layer))) is not None)
    needed = sum(spec.num_expert_keys * (layout.blob_bytes + MANIFEST_BYTES_PER_BLOB) for layout in layouts.values())
    check_free_space(store.path, needed - done, f"{', '.join(layouts)} copies of {store.path.name}'s experts")


def _layer(store: Store, layer: int, layouts: dict[str, PrecisionLayout], bar) -> list[BlobRef]:
    """One layer's blobs at each precision: kept from an earlier run where complete, the rest written now (each
    native expert read once for all of them). The experts the layer holds: all, or a merged model's principals."""
    experts = store.spec.experts_of(layer)
    n = len(experts)
    refs: dict[str, list[BlobRef]] = {}
    todo = {}
    for p, layout in layouts.items():
        kept = _kept(store.path / expert_file(p, layer), _sidecar(store.path, p, layer), layout, n)
        if kept is not None:
            refs[p] = kept
            bar.update(n)
        else:
            todo[p] = layout
    paths = {p: store.path / expert_file(p, layer) for p in todo}
    tmps = {p: path.with_name(f".{path.name}.tmp-{os.getpid()}") for p, path in paths.items()}
    files = {}
    try:
        for p, tmp in tmps.items():
            tmp.parent.mkdir(parents=True, exist_ok=True)
            files[p], refs[p] = open(tmp, "wb"), []
        for e in experts if todo else ():
            native = store.read_expert_values(layer, e)  # (a GGUF's blocks dequantized)
            for p, layout in todo.items():
                f = files[p]
                offset = f.tell()
                crc = write_blob(f, layout.for_layer(layer), quantize_expert(native, p, layout.formats(layer)),
                                 f"expert {e} of layer {layer}", layout.blob_bytes)
                refs[p].append(BlobRef(layer, e, p, expert_file(p, layer), offset, layout.blob_bytes, crc))
                bar.update()
        for p, f in files.items():
            f.flush()
            os.fsync(f.fileno())
            f.close()
            os.replace(tmps[p], paths[p])
            _write_sidecar(paths[p], _sidecar(store.path, p, layer), todo[p], refs[p])
    finally:
        for p, f in files.items():
            with contextlib.suppress(OSError):  # closing flushes: on a full disk that fails too; remove it anyway
                f.close()
            tmps[p].unlink(missing_ok=True)
    return [r for p in layouts for r in refs[p]]


def _write_sidecar(path: Path, sidecar: Path, layout: PrecisionLayout, refs: list[BlobRef]) -> None:
    atomic_write_json(sidecar, {"format": SIDECAR_FORMAT, "precision": layout.name, "blob_bytes": layout.blob_bytes,
                                "file_bytes": path.stat().st_size, "blobs": [dataclasses.astuple(r) for r in refs]})


def _kept(path: Path, sidecar: Path, layout: PrecisionLayout, n: int) -> list[BlobRef] | None:
    """The references an earlier run recorded for this layer, if they describe the file there now."""
    try:
        d = json.loads(sidecar.read_text())
        if (d.get("format") != SIDECAR_FORMAT or d["precision"] != layout.name or d["blob_bytes"] != layout.blob_bytes
                or d["file_bytes"] != path.stat().st_size or len(d["blobs"]) != n):
            return None
        return [BlobRef(*row) for row in d["blobs"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def require_precisions(store: Store, precisions: Iterable[str]) -> None:
    """Refuse to run a configuration that wants precisions the store lacks, saying how to add them."""
    missing = [p for p in precisions if p not in store.manifest.precisions]
    if missing:
        raise StoreError(f"{store.path} holds its experts at {', '.join(store.manifest.precisions)}, not "
                         f"{', '.join(missing)}",
                         hint=f"add them with `moetier quantize {store.path} --precisions {','.join(missing)}`")

