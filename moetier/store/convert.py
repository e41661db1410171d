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
from moetier.store.quantize import quantize_expert
from moetier.store.variants import expert_layouts, parse_precisions
from moetier.store.writer import StoreWriter


class ExpertSource:
    """One layer's expert weights, whether the checkpoint stores them per expert or fused [E, ...]."""

    def __init__(self, ckpt: Checkpoint, family: Family, layer: int) -> None:
        self.ckpt, self.family, self.layer = ckpt, family, layer
        gate_up, down = family.fused_expert_names(layer)
        self.fused = (ckpt.get(gate_up), ckpt.get(down)) if gate_up in ckpt and down in ckpt else None

    def get(self, expert: int) -> dict[str, torch.Tensor]:
        if self.fused is not None:
            return {"gate_up_proj": self.fused[0][expert], "down_proj": self.fused[1][expert]}
        gate, up, down = (self.ckpt.get(n) for n in self.family.expert_names(self.layer, expert))
        return {"gate_up_proj": torch.cat([gate, up], dim=0), "down_proj": down}


def dense_tensors(ckpt: Checkpoint, family: Family, spec: ModelSpec) -> dict[str, torch.Tensor]:
    out = {}
    for ours, theirs in family.dense_names(spec).items():
        out[ours] = ckpt.get(theirs)
    for i in spec.moe_layers:  # pack the shared expert's gate and up like a routed expert's
        if f"layers.{i}.shared.gate_proj" in out:
            out[f"layers.{i}.shared.gate_up_proj"] = torch.cat(
                [out.pop(f"layers.{i}.shared.gate_proj"), out.pop(f"layers.{i}.shared.up_proj")], dim=0)
    for i in set(range(spec.num_layers)) - set(spec.moe_layers):
        out[f"layers.{i}.mlp.gate_up_proj"] = torch.cat(
            [out.pop(f"layers.{i}.mlp.gate_proj"), out.pop(f"layers.{i}.mlp.up_proj")], dim=0)
    return out


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
    first = ExpertSource(ckpt, family, spec.moe_layers[0]).get(0)["gate_up_proj"]
    if first.dtype not in PRECISION_OF_DTYPE:
        raise CheckpointError(f"expert weights of dtype {first.dtype} are not supported (fp32, bf16, fp16 are)")
    layout = PrecisionLayout.swiglu(PRECISION_OF_DTYPE[first.dtype], str(first.dtype).removeprefix("torch."),
                                    spec.hidden_size, spec.moe_intermediate_size)
    quantized = expert_layouts(spec, parse_precisions(precisions, layout.name)) if precisions else {}
    total = len(spec.moe_layers) * spec.num_experts
    with StoreWriter(store_dir, overwrite, (model_dir,)) as writer, \
            tqdm(total=total, desc=f"convert {model_dir.name}", unit="expert", disable=not progress) as bar:
        writer.write_dense(dense)
        for layer in spec.moe_layers:
            source = ExpertSource(ckpt, family, layer)
            for e in range(spec.num_experts):
                tensors = source.get(e)
                if any(t.dtype != first.dtype for t in tensors.values()):
                    raise CheckpointError(f"expert {e} of layer {layer} is not {first.dtype} like the others")
                writer.add_expert(layer, e, layout, tensors)
                for p, q_layout in quantized.items():
                    writer.add_expert(layer, e, q_layout, quantize_expert(tensors, p))
                bar.update()
        manifest = Manifest(
            family=family.name, config=ckpt.config, precisions={layout.name: layout, **quantized},
            native_precision=layout.name, blobs=tuple(writer.blobs), source=str(model_dir.resolve()),
            tokenizer_files=writer.copy_files(model_dir, ckpt.tokenizer_files()))
        return writer.commit(manifest)
