"""A moetier store written back out as a Hugging Face OLMoE checkpoint, so a peer converts the very weights moetier
runs (the synthetic OLMoE-1B-7B, or demo-deep-xl: both OLMoE stores that exist only as stores)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moetier.progress import tqdm
from moetier.store.store import Store

HF_NAMES = {"input_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm", "router": "mlp.gate",
            **{n: f"self_attn.{n}" for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")}}
TOP = {"embed_tokens": "model.embed_tokens.weight", "norm": "model.norm.weight", "lm_head": "lm_head.weight"}


def export_hf(store_dir: Path, out: Path) -> Path:
    """The store as a Hugging Face OLMoE checkpoint in `out` (one safetensors file per layer, experts split back
    into gate_proj, up_proj and down_proj); written under a temporary name and renamed when whole."""
    if (out / "config.json").exists():
        return out
    store = Store(store_dir)
    manifest, spec = store.manifest, store.spec
    if spec.family != "olmoe":
        raise SystemExit(f"{store_dir} is a {spec.family} store; this export writes OLMoE checkpoints only")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config = {k: v for k, v in manifest.config.items() if k != "moetier_synthetic"}
    layout, inter = store.native_layout, spec.moe_intermediate_size
    weight_map = {}

    def save(name: str, tensors: dict) -> None:
        save_file(tensors, tmp / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))

    with safe_open(store_dir / "dense.safetensors", "pt") as dense:
        save("top.safetensors", {hf: dense.get_tensor(ours) for ours, hf in TOP.items() if ours in dense.keys()})
        for layer in tqdm(range(spec.num_layers), desc=f"export {store_dir.name} to HF", unit="layer"):
            prefix = f"layers.{layer}."
            tensors = {f"model.layers.{layer}.{HF_NAMES[k.removeprefix(prefix)]}.weight": dense.get_tensor(k)
                       for k in dense.keys() if k.startswith(prefix)}
            for e in range(spec.num_experts):
                blob = manifest.blob(layer, e)
                raw = np.fromfile(store_dir / blob.file, dtype=np.uint8, count=blob.length, offset=blob.offset)
                w = layout.views(torch.from_numpy(raw))
                name = f"model.layers.{layer}.mlp.experts.{e}."
                tensors[name + "gate_proj.weight"] = w["gate_up_proj"][:inter].clone()
                tensors[name + "up_proj.weight"] = w["gate_up_proj"][inter:].clone()
                tensors[name + "down_proj.weight"] = w["down_proj"].clone()
            save(f"layer{layer:03d}.safetensors", tensors)
    (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (tmp / "config.json").write_text(json.dumps(config))
    for name in manifest.tokenizer_files:
        shutil.copy(store_dir / name, tmp / name)
    tmp.rename(out)
    return out
