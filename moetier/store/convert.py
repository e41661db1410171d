"""Hugging Face checkpoint -> moetier store: the dense weights, the manifest and the tokenizer files always; the
experts either read where they lie in the checkpoint's safetensors files (a linked store, the default: nothing
copied) or copied into the store's own blobs (`copy`, or where the checkpoint's layout is not the store's)."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from pathlib import Path

import torch

from moetier.atomic import check_replaceable
from moetier.config import ModelSpec
from moetier.errors import CheckpointError
from moetier.model.families import Family, family_for, parse_spec
from moetier.progress import tqdm
from moetier.quant.precisions import quantize_expert
from moetier.store.checkpoint import Checkpoint, read_config
from moetier.store.format import PRECISION_OF_DTYPE, Manifest, PrecisionLayout, SourceFile, is_store
from moetier.store.link import segments_crc32, segments_of
from moetier.store.sources import expert_source
from moetier.store.variants import expert_layouts, parse_precisions
from moetier.store.writer import MANIFEST_BYTES_PER_LINKED_BLOB, StoreWriter, store_bytes


def native_layout(spec: ModelSpec, dtype: torch.dtype) -> PrecisionLayout:
    """The blob of an expert at the checkpoint's own precision: SwiGLU's two matrices back to back (the layout
    every store before other activations had), any other expert's tensors packed in ModelSpec.expert_shapes order."""
    name, dtype_name = PRECISION_OF_DTYPE[dtype], str(dtype).removeprefix("torch.")
    if spec.activation == "swiglu":
        return PrecisionLayout.swiglu(name, dtype_name, spec.hidden_size, spec.moe_intermediate_size)
    return PrecisionLayout.packed(name, [(n, dtype_name, shape) for n, shape in spec.expert_shapes])


def check_expert_dtype(dtype: torch.dtype) -> None:
    if dtype not in PRECISION_OF_DTYPE:
        raise CheckpointError(f"expert weights of dtype {dtype} are not supported (fp32, bf16, fp16 are)",
                              hint="moetier reads float checkpoints (and gpt-oss's MXFP4); dequantize others first")


def dense_tensors(ckpt: Checkpoint, family: Family, spec: ModelSpec) -> dict[str, torch.Tensor]:
    out = {}
    for ours, theirs in family.dense_names(spec).items():
        out[ours] = ckpt.get(theirs)
    for i in spec.moe_layers:  # pack the shared expert's gate and up like a routed expert's
        if f"layers.{i}.shared.gate_proj" in out:
            out[f"layers.{i}.shared.gate_up_proj"] = torch.cat(
                [out.pop(f"layers.{i}.shared.gate_proj"), out.pop(f"layers.{i}.shared.up_proj")], dim=0)
    for i in set(range(spec.num_layers)) - set(spec.moe_layers):
        if f"layers.{i}.mlp.gate_proj" in out:  # a SwiGLU MLP (Switch's ReLU one has no gate)
            out[f"layers.{i}.mlp.gate_up_proj"] = torch.cat(
                [out.pop(f"layers.{i}.mlp.gate_proj"), out.pop(f"layers.{i}.mlp.up_proj")], dim=0)
    return out


def check_shapes(tensors: dict[str, torch.Tensor], spec: ModelSpec, layer: int, expert: int) -> None:
    """An expert whose tensors are not the shapes config.json implies is refused, naming the tensor."""
    for name, shape in spec.expert_shapes:
        if tuple(tensors[name].shape) != shape:
            raise CheckpointError(f"expert {expert} of layer {layer}: {name} is {tuple(tensors[name].shape)}, config.json "
                                  f"implies {shape}", hint="the checkpoint does not match its config.json")


def convert(model_dir: Path | str, store_dir: Path | str, overwrite: bool = False, progress: bool = True,
            precisions: str | Iterable[str] = (), copy: bool = False) -> Path:
    """Convert a Hugging Face MoE checkpoint into a store. Atomic: nothing is left at `store_dir` on failure.
    `overwrite` replaces an existing store, and nothing else: never another folder, never the checkpoint.
    `precisions`: quantized copies of every expert to write beside the checkpoint's own (e.g. "bf16,int8,int4").
    `copy`: copy the experts into the store even where they could be read in place (a linked store reads the
    checkpoint's files, which must then stay where they are, unchanged)."""
    model_dir, store_dir = Path(model_dir), Path(store_dir)
    check_replaceable(store_dir, "store", is_store, overwrite, (model_dir,))  # before any work
    config = read_config(model_dir)
    family = family_for(config)  # an unsupported family is refused before any tensor is opened
    spec = parse_spec(config)
    ckpt = Checkpoint(model_dir)
    dense = dense_tensors(ckpt, family, spec)
    first = expert_source(ckpt, family, spec, spec.moe_layers[0]).get(0)["down_proj"]
    check_expert_dtype(first.dtype)
    layout = native_layout(spec, first.dtype)
    quantized = expert_layouts(spec, parse_precisions(precisions, layout.name)) if precisions else {}
    names = {shard: shard.name for shard in sorted(model_dir.glob("*.safetensors"))}
    indexed = {name: SourceFile.of(path) for path, name in names.items()}  # before reading: a change meanwhile shows
    link = None if copy else segments_of(expert_source(ckpt, family, spec, spec.moe_layers[0]).locate(0), layout,
                                         names)
    if isinstance(link, str):
        print(f"moetier: copying the experts of {model_dir.name} into the store: {link}", file=sys.stderr)
    linked = isinstance(link, tuple)
    total = len(spec.moe_layers) * spec.num_experts
    files = ckpt.tokenizer_files()
    copied = len(quantized) + (0 if linked else 1)
    needed = store_bytes(sum(t.nbytes for t in dense.values()), total * copied,
                         (sum(q.blob_bytes for q in quantized.values()) + (0 if linked else layout.blob_bytes))
                         // max(1, copied), sum((model_dir / f).stat().st_size for f in files)) \
        + (total * MANIFEST_BYTES_PER_LINKED_BLOB if linked else 0)
    desc = f"{'index' if linked else 'convert'} {model_dir.name}"
    with StoreWriter(store_dir, overwrite, (model_dir,), needed) as writer, \
            tqdm(total=total, desc=desc, unit="expert", disable=not progress) as bar:
        writer.write_dense(dense)
        for layer in spec.moe_layers:
            source = expert_source(ckpt, family, spec, layer)
            for e in range(spec.num_experts):
                if linked:
                    _add_linked(writer, source, layout, names, layer, e)
                if not linked or quantized:
                    tensors = source.get(e)
                    if any(t.dtype != first.dtype for t in tensors.values()):
                        raise CheckpointError(f"expert {e} of layer {layer} is not {first.dtype} like the others")
                    check_shapes(tensors, spec, layer, e)
                    if not linked:
                        writer.add_expert(layer, e, layout, tensors)
                    for p, q_layout in quantized.items():
                        writer.add_expert(layer, e, q_layout, quantize_expert(tensors, p, q_layout.formats(layer)))
                bar.update()
        manifest = Manifest(
            family=family.name, config=ckpt.config, precisions={layout.name: layout, **quantized},
            native_precision=layout.name, blobs=tuple(writer.blobs), source=str(model_dir.resolve()),
            tokenizer_files=writer.copy_files(model_dir, files),
            sources=indexed if linked else {})
        return writer.commit(manifest)


def _add_linked(writer: StoreWriter, source, layout: PrecisionLayout, names: dict[Path, str], layer: int,
                expert: int) -> None:
    """One expert as the segments of the checkpoint's files it lies in, with their checksum."""
    segments = segments_of(source.locate(expert), layout, names)
    if isinstance(segments, str):
        raise CheckpointError(f"expert {expert} of layer {layer}: {segments}",
                              hint="the checkpoint does not match its config.json (or convert with --copy)")
    paths = {name: path for path, name in names.items()}
    writer.add_linked(layer, expert, layout, segments, segments_crc32(segments, paths))
