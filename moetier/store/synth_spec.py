"""The shapes a synthetic model takes (synth.py writes one): OLMoE-family sizes, checked, and the named presets —
apart from the writing, with no tensor library, so the command line offers and checks them without loading torch."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from moetier.errors import MoetierError

DTYPE_OF = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}  # a precision's torch dtype, by name


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
        if self.precision not in DTYPE_OF:
            raise MoetierError(f"precision {self.precision!r} is not one of {', '.join(DTYPE_OF)}")
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
            "tie_word_embeddings": False, "dtype": DTYPE_OF[self.precision],
            "eos_token_id": None, "bos_token_id": None, "moetier_synthetic": asdict(self),
        }


PRESETS = {
    "olmoe-1b-7b": SynthSpec(),
    "small": SynthSpec(hidden_size=512, num_layers=4, num_experts=16, intermediate_size=256, top_k=2, num_heads=8,
                       num_kv_heads=8, vocab_size=256),
    "tiny": SynthSpec(hidden_size=64, num_layers=2, num_experts=8, intermediate_size=32, top_k=2, num_heads=4,
                      num_kv_heads=4, vocab_size=256, precision="fp32"),
}
