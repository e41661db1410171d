"""Hugging Face checkpoint -> moetier store (format version 1)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from tqdm import tqdm

from moetier.atomic import check_replaceable
from moetier.config import ModelSpec
from moetier.errors import CheckpointError
from moetier.model.families import Family, family_for, parse_spec
from moetier.store.checkpoint import Checkpoint, read_config
from moetier.store.format import PRECISION_OF_DTYPE, Manifest, PrecisionLayout, is_store
from moetier.quant.codes import quantize_expert
from moetier.store.sources import expert_source
from moetier.store.variants import expert_layouts, parse_precisions
from moetier.store.writer import StoreWriter, store_bytes


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
            precisions: str | Iterable[str] = ()) -> Path:
    """Convert a Hugging Face MoE checkpoint into a store. Atomic: nothing is left at `store_dir` on failure.
    `overwrite` replaces an existing store, and nothing else: never another folder, never the checkpoint.
    `precisions`: quantized copies of every expert to write beside the checkpoint's own (e.g. "bf16,int8,int4")."""
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
    total = len(spec.moe_layers) * spec.num_experts
    files = ckpt.tokenizer_files()
    needed = store_bytes(sum(t.nbytes for t in dense.values()), total * (1 + len(quantized)),
                         (layout.blob_bytes + sum(q.blob_bytes for q in quantized.values())) // (1 + len(quantized)),
                         sum((model_dir / f).stat().st_size for f in files))
    with StoreWriter(store_dir, overwrite, (model_dir,), needed) as writer, \
            tqdm(total=total, desc=f"convert {model_dir.name}", unit="expert", disable=not progress) as bar:
        writer.write_dense(dense)
        for layer in spec.moe_layers:
            source = expert_source(ckpt, family, spec, layer)
            for e in range(spec.num_experts):
                tensors = source.get(e)
                if any(t.dtype != first.dtype for t in tensors.values()):
                    raise CheckpointError(f"expert {e} of layer {layer} is not {first.dtype} like the others")
                check_shapes(tensors, spec, layer, e)
                writer.add_expert(layer, e, layout, tensors)
                for p, q_layout in quantized.items():
                    writer.add_expert(layer, e, q_layout, quantize_expert(tensors, p))
                bar.update()
        manifest = Manifest(
            family=family.name, config=ckpt.config, precisions={layout.name: layout, **quantized},
            native_precision=layout.name, blobs=tuple(writer.blobs), source=str(model_dir.resolve()),
            tokenizer_files=writer.copy_files(model_dir, files))
        return writer.commit(manifest)
