"""Inflated stores: a model's own experts padded to a real model's size, computing exactly what the model computes.

Each routed expert's intermediate dimension grows from I to N: the extra N - I rows of gate_proj and up_proj are
drawn at random (at the expert's own weight scale, so the bytes look like weights to the disk and the kernels),
and the matching N - I columns of down_proj are exactly zero. An extra hidden unit then contributes
silu(g) * u * 0 = 0 to the output, so routing, logits and tokens are the original model's up to the rounding of
a longer matmul reduction, while each expert weighs what a real one weighs: reading one costs what it costs on a
real model. Demo models route for real but have ~200 KB experts; inflated, they give real routing at real size.

    moetier synth --inflate demo-fine --expert-intermediate 8192 OUT     # OLMoE's 12 MiB experts at hidden 256
"""

from __future__ import annotations

from pathlib import Path

import torch

from moetier.atomic import check_replaceable
from moetier.config import ModelSpec
from moetier.errors import MoetierError
from moetier.model.families import family_for, parse_spec
from moetier.progress import tqdm
from moetier.store.format import DTYPES, Manifest, PrecisionLayout, is_store
from moetier.store.store import Store
from moetier.store.writer import StoreWriter, store_bytes

OLMOE_EXPERT_BYTES = 3 * 2048 * 1024 * 2  # OLMoE-1B-7B's routed expert in bf16: 12 MiB


def intermediate_for(store: Store, expert_bytes: int | None = None) -> int:
    """The intermediate size that makes one of `store`'s experts weigh `expert_bytes` (default OLMoE's) at its
    native precision."""
    return intermediate_for_spec(store.spec, DTYPES[store.native_layout.tensors[0].dtype].itemsize, expert_bytes)


def intermediate_for_spec(spec: ModelSpec, itemsize: int, expert_bytes: int | None = None) -> int:
    """As `intermediate_for`, from the model's spec and its experts' bytes per weight (nothing opened)."""
    expert_bytes = expert_bytes or OLMOE_EXPERT_BYTES
    return max(1, round(expert_bytes / (3 * spec.hidden_size * itemsize)))


def inflate_expert(tensors: dict[str, torch.Tensor], intermediate: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """gate_up_proj [2I, H] -> [2N, H] with random rows after each half; down_proj [H, I] -> [H, N] with zero
    columns after the original ones."""
    gate_up, down = tensors["gate_up_proj"], tensors["down_proj"]
    i, hidden = gate_up.shape[0] // 2, gate_up.shape[1]
    extra = intermediate - i
    std = gate_up.float().std().item() or 0.02
    rows = (torch.randn(2, extra, hidden, generator=g) * std).to(gate_up.dtype)  # [2, N-I, H]
    new_gate_up = torch.cat([gate_up[:i], rows[0], gate_up[i:], rows[1]])  # [2N, H]
    new_down = torch.cat([down, torch.zeros(down.shape[0], extra, dtype=down.dtype)], dim=1)  # [H, N]
    return {"gate_up_proj": new_gate_up, "down_proj": new_down}


def inflate(source: Path | str, out: Path | str, intermediate: int, overwrite: bool = False, progress: bool = True,
            seed: int = 0) -> Path:
    """Write `source` (a store) with every routed expert inflated to `intermediate` into a new store at `out`.
    Atomic like every store write: nothing is left at `out` on failure."""
    src = Store(source)
    out = Path(out)
    check_replaceable(out, "store", is_store, overwrite, (src.path,))  # before any work
    m, spec = src.manifest, src.spec
    if intermediate <= spec.moe_intermediate_size:
        raise MoetierError(f"--expert-intermediate {intermediate} does not inflate {src.path.name}: its experts "
                           f"already have intermediate size {spec.moe_intermediate_size}",
                           hint=f"give a size above {spec.moe_intermediate_size}")
    if spec.activation != "swiglu":
        raise MoetierError(f"inflate pads SwiGLU experts; {src.path.name}'s ({m.family}) are {spec.activation}",
                           hint="inflate a model of another family")
    old = src.native_layout
    layout = PrecisionLayout.swiglu(old.name, old.tensors[0].dtype, spec.hidden_size, intermediate)
    key = family_for(m.config).expert_intermediate_key
    config = dict(m.config, **{key: intermediate},
                  moetier_inflated={"from": str(src.path.resolve()), "intermediate_size": spec.moe_intermediate_size,
                                    "seed": seed})
    if parse_spec(config).shared_expert_intermediate_size != spec.shared_expert_intermediate_size:
        raise MoetierError(f"{src.path.name}'s ({m.family}) shared experts are sized by {key}: inflating the routed "
                           f"ones would misstate them", hint="inflate a model of another family")
    files = sum(len(src.read_file(name)) for name in m.tokenizer_files)
    needed = store_bytes(src.dense_bytes, len(spec.moe_layers) * spec.num_experts, layout.blob_bytes, files)
    g = torch.Generator().manual_seed(seed)
    with StoreWriter(out, overwrite, (src.path,), needed) as writer, \
            tqdm(total=len(spec.moe_layers) * spec.num_experts, unit="expert", desc=f"inflate {out.name}",
                 disable=not progress) as bar:
        writer.write_dense(src.load_dense())
        for name in m.tokenizer_files:
            (writer.tmp / name).write_bytes(src.read_file(name))  # verified against the source's checksums
            writer.add_file(name)
        for layer in spec.moe_layers:
            for e in range(spec.num_experts):
                writer.add_expert(layer, e, layout, inflate_expert(src.read_expert(layer, e), intermediate, g))
                bar.update()
        # source stays empty: the inflated store is a model of its own (traces name it by its folder, and the
        # simulator must not take the small model's shape for it); where it came from is in its config
        manifest = Manifest(family=m.family, config=config, precisions={layout.name: layout},
                            native_precision=layout.name, blobs=tuple(writer.blobs), source="",
                            tokenizer_files=m.tokenizer_files)
        return writer.commit(manifest)
