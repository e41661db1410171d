"""Synthetic models of real shape with random weights, written straight into a store (no checkpoint needed).

With every weight drawn N(0, 0.02) routing collapses onto a few experts and makes any cache look perfect;
drawing the token embedding with a much larger standard deviation restores near-uniform routing (DESIGN.md)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from moetier.atomic import check_free_space, check_replaceable
from moetier.errors import MoetierError
from moetier.progress import tqdm
from moetier.store.format import Manifest, PrecisionLayout, is_store
from moetier.store.writer import StoreWriter, store_bytes

DTYPE_NAMES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


@dataclass(frozen=True)
class SynthSpec:
    """An OLMoE-family model; the defaults are OLMoE-1B-7B's shape."""

    hidden_size: int = 2048
    num_layers: int = 16
    num_experts: int = 64
    intermediate_size: int = 1024
    top_k: int = 8
    num_heads: int = 16
    num_kv_heads: int = 16
    vocab_size: int = 50304
    max_position_embeddings: int = 4096
    precision: str = "bf16"
    embed_std: float = 4.0
    std: float = 0.02
    seed: int = 0

    def __post_init__(self) -> None:
        sizes = ("hidden_size", "num_layers", "num_experts", "intermediate_size", "top_k", "num_heads",
                 "num_kv_heads", "vocab_size", "max_position_embeddings")
        bad = [f"{name}={getattr(self, name)}" for name in sizes if getattr(self, name) < 1]
        if bad or self.embed_std <= 0 or self.std <= 0:
            raise MoetierError(f"synthetic model sizes must be positive: {', '.join(bad) or 'std'}")
        if self.num_layers > 4096 or self.num_experts > 32768:  # past any real model; traces hold int16 ids
            raise MoetierError(f"a synthetic model has at most 4096 layers of 32768 experts, got {self.num_layers} "
                               f"of {self.num_experts}")
        if self.num_heads % self.num_kv_heads:
            raise MoetierError(f"{self.num_heads} heads are not a multiple of {self.num_kv_heads} kv heads")
        if self.precision not in DTYPE_NAMES:
            raise MoetierError(f"precision {self.precision!r} is not one of {', '.join(DTYPE_NAMES)}")
        if self.top_k > self.num_experts or self.hidden_size % self.num_heads:
            raise MoetierError("top_k must not exceed num_experts, and hidden_size must divide into num_heads")

    def hf_config(self) -> dict:
        return {
            "model_type": "olmoe", "architectures": ["OlmoeForCausalLM"], "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers, "num_experts": self.num_experts,
            "intermediate_size": self.intermediate_size, "num_experts_per_tok": self.top_k,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "vocab_size": self.vocab_size, "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "norm_topk_prob": False, "hidden_act": "silu",
            "tie_word_embeddings": False, "dtype": str(DTYPE_NAMES[self.precision]).removeprefix("torch."),
            "eos_token_id": None, "bos_token_id": None, "moetier_synthetic": asdict(self),
        }


PRESETS = {
    "olmoe-1b-7b": SynthSpec(),
    "small": SynthSpec(hidden_size=512, num_layers=4, num_experts=16, intermediate_size=256, top_k=2, num_heads=8,
                       num_kv_heads=8, vocab_size=256),
    "tiny": SynthSpec(hidden_size=64, num_layers=2, num_experts=8, intermediate_size=32, top_k=2, num_heads=4,
                      num_kv_heads=4, vocab_size=256, precision="fp32"),
}


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
