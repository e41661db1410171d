"""Synthetic models of real shape with random weights, written straight into a store (no checkpoint needed).

With every weight drawn N(0, 0.02) routing collapses onto a few experts and makes any cache look perfect;
drawing the token embedding with a much larger standard deviation restores near-uniform routing (DESIGN.md)."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from moetier.atomic import check_free_space, check_replaceable
from moetier.progress import tqdm
from moetier.store.format import Manifest, PrecisionLayout, is_store
from moetier.store.synth_spec import DTYPE_OF, PRESETS, SynthSpec  # noqa: F401  (PRESETS: synth's users read it here)
from moetier.store.writer import StoreWriter, store_bytes

# the shapes (SynthSpec, its presets) live apart, where torch is not: the command line's choices read them
DTYPE_NAMES = {precision: getattr(torch, name) for precision, name in DTYPE_OF.items()}


def byte_tokenizer() -> Tokenizer:
    """A byte-level tokenizer with no merges: ids below 256 are bytes, larger ids decode to nothing."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def dense_shapes(spec: SynthSpec) -> dict[str, tuple[tuple[int, ...], float | None]]:
    """Every dense tensor's shape and the std it is drawn with (None: ones, a norm's weight), in drawing order."""
    h, kv = spec.hidden_size, spec.num_kv_heads * (spec.hidden_size // spec.num_heads)
    shapes = {"embed_tokens": ((spec.vocab_size, h), spec.embed_std), "lm_head": ((spec.vocab_size, h), spec.std),
              "norm": ((h,), None)}
    for i in range(spec.num_layers):
        p = f"layers.{i}."
        shapes |= {p + "input_norm": ((h,), None), p + "post_attn_norm": ((h,), None), p + "q_proj": ((h, h), spec.std),
                   p + "k_proj": ((kv, h), spec.std), p + "v_proj": ((kv, h), spec.std),
                   p + "o_proj": ((h, h), spec.std), p + "q_norm": ((h,), None), p + "k_norm": ((kv,), None),
                   p + "router": ((spec.num_experts, h), spec.std)}
    return shapes


def synthesize(spec: SynthSpec, out: Path | str, overwrite: bool = False, progress: bool = True) -> Path:
    check_replaceable(out, "store", is_store, overwrite)  # before drawing gigabytes of weights
    dtype = DTYPE_NAMES[spec.precision]
    h = spec.hidden_size
    shapes = dense_shapes(spec)
    layout = PrecisionLayout.swiglu(spec.precision, str(dtype).removeprefix("torch."), h, spec.intermediate_size)
    out = Path(out)
    dense_bytes = sum(math.prod(shape) for shape, _ in shapes.values()) * dtype.itemsize
    needed = store_bytes(dense_bytes, spec.num_layers * spec.num_experts, layout.blob_bytes, 1 << 20)  # (tokenizer)
    check_free_space(out, needed, f"the store {out.name}")  # before drawing gigabytes of weights
    g = torch.Generator().manual_seed(spec.seed)

    def randn(*shape: int, std: float = spec.std) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * std).to(dtype)

    dense = {name: torch.ones(shape, dtype=dtype) if std is None else randn(*shape, std=std)
             for name, (shape, std) in shapes.items()}
    with StoreWriter(out, overwrite, expected_bytes=needed) as writer, \
            tqdm(total=spec.num_layers * spec.num_experts, unit="expert", desc=f"synth {out.name}",
                 disable=not progress) as bar:
        writer.write_dense(dense)
        for layer in range(spec.num_layers):
            for e in range(spec.num_experts):
                writer.add_expert(layer, e, layout, {"gate_up_proj": randn(2 * spec.intermediate_size, h),
                                                     "down_proj": randn(h, spec.intermediate_size)})
                bar.update()
        byte_tokenizer().save(str(writer.tmp / "tokenizer.json"))
        writer.add_file("tokenizer.json")
        manifest = Manifest(family="olmoe", config=spec.hf_config(), precisions={layout.name: layout},
                            native_precision=layout.name, blobs=tuple(writer.blobs), source="synthetic",
                            tokenizer_files=("tokenizer.json",))
        return writer.commit(manifest)
