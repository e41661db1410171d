"""Synthetic models of real shape with random weights, written straight into a store (no checkpoint needed).

With every weight drawn N(0, 0.02) routing collapses onto a few experts and makes any cache look perfect;
drawing the token embedding with a much larger standard deviation restores near-uniform routing (DESIGN.md)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from tqdm import tqdm

from moetier.atomic import check_replaceable
from moetier.errors import MoetierError
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


def synthesize(spec: SynthSpec, out: Path | str, overwrite: bool = False, progress: bool = True) -> Path:
    check_replaceable(out, "store", is_store, overwrite)  # before drawing gigabytes of weights
    g = torch.Generator().manual_seed(spec.seed)
    dtype = DTYPE_NAMES[spec.precision]
    h, d = spec.hidden_size, spec.hidden_size // spec.num_heads

    def randn(*shape: int, std: float = spec.std) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * std).to(dtype)

    dense = {"embed_tokens": randn(spec.vocab_size, h, std=spec.embed_std), "lm_head": randn(spec.vocab_size, h),
             "norm": torch.ones(h, dtype=dtype)}
    for i in range(spec.num_layers):
        p = f"layers.{i}."
        dense |= {p + "input_norm": torch.ones(h, dtype=dtype), p + "post_attn_norm": torch.ones(h, dtype=dtype),
                  p + "q_proj": randn(h, h), p + "k_proj": randn(spec.num_kv_heads * d, h),
                  p + "v_proj": randn(spec.num_kv_heads * d, h), p + "o_proj": randn(h, h),
                  p + "q_norm": torch.ones(h, dtype=dtype), p + "k_norm": torch.ones(spec.num_kv_heads * d, dtype=dtype),
                  p + "router": randn(spec.num_experts, h)}
    layout = PrecisionLayout.swiglu(spec.precision, str(dtype).removeprefix("torch."), h, spec.intermediate_size)
    out = Path(out)
    needed = store_bytes(sum(t.nbytes for t in dense.values()), spec.num_layers * spec.num_experts,
                         layout.blob_bytes, 1 << 20)  # (the byte tokenizer: ~20 KiB)
    with StoreWriter(out, overwrite, expected_bytes=needed) as writer, tqdm(total=spec.num_layers * spec.num_experts, unit="expert",
                                                     desc=f"synth {out.name}", disable=not progress) as bar:
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
