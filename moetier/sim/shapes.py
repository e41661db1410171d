"""Model shapes for the simulator: the sizes that set bytes and FLOPs, for models we cannot run here.

Each shape is read off the model's published Hugging Face `config.json` (the `source` of each entry). Only
what the cost model needs is kept: the experts, the dense part of a layer as a parameter count, the head.
`ModelShape.from_spec` gives the same for any model moetier can load (the demo models, a converted store)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from moetier.config import ALIGN, ModelSpec
from moetier.errors import MoetierError
from moetier.quant.precisions import QUANTIZED, bits_per_weight

# Bytes per weight by precision. int4 carries one fp16 scale per group of 128 weights (our quantized layout);
# int8 one fp16 scale per output channel, which is negligible at these sizes.
# quantized: codes, plus moetier's bf16 scale and zero per group (quant/codes.py: int4 groups of 128, int2 of 64;
# int8's one scale per row is under 0.1%)
BYTES_PER_PARAM = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, **{p: bits_per_weight(p) / 8 for p in QUANTIZED}}


class ShapeError(MoetierError):
    pass


def gqa_params(hidden: int, heads: int, kv_heads: int, head_dim: int) -> int:
    """q, k, v and o projections of grouped-query attention."""
    return hidden * head_dim * (2 * heads + 2 * kv_heads)


def mla_params(hidden: int, heads: int, kv_lora_rank: int, nope: int, rope: int, v_dim: int,
               q_lora_rank: int | None = None) -> int:
    """DeepSeek-V2/V3 multi-head latent attention: q (direct or through a low-rank), the shared kv down-projection,
    its up-projection to per-head keys and values, o."""
    q_out = heads * (nope + rope)
    q = hidden * q_out if q_lora_rank is None else hidden * q_lora_rank + q_lora_rank * q_out
    return q + hidden * (kv_lora_rank + rope) + kv_lora_rank * heads * (nope + v_dim) + heads * v_dim * hidden


@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden_size: int
    num_layers: int
    moe_layers: tuple[int, ...]
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    attention_params: int  # per layer (an encoder-decoder's: a decoder layer's, self- and cross-attention)
    kv_per_token: int  # key and value elements cached per token per layer (what attention reads back)
    vocab_size: int
    expert_matrices: int = 3  # per MLP, experts and dense alike: 3 gated SwiGLU; 2 plain (Switch's ReLU)
    expert_bias_params: int = 0  # an expert's biases (gpt-oss: gate, up and down)
    encoder_layers: int = 0  # an encoder-decoder's first layers, the encoder's: they run over the prompt's tokens
    # once, not per decoded token, and have self-attention only (half a decoder layer's attention_params)
    shared_expert_intermediate_size: int = 0
    dense_intermediate_size: int = 0  # the MLP of the layers without experts
    precision: str = "bf16"  # the published checkpoint's
    source: str = ""

    def __post_init__(self) -> None:
        for f in ("hidden_size", "num_layers", "num_experts", "top_k", "moe_intermediate_size", "vocab_size"):
            if getattr(self, f) <= 0:
                raise ShapeError(f"model shape {self.name}: {f} must be positive")
        if not self.moe_layers or any(not 0 <= i < self.num_layers for i in self.moe_layers):
            raise ShapeError(f"model shape {self.name}: MoE layers {self.moe_layers} outside 0..{self.num_layers - 1}")
        if self.top_k > self.num_experts:
            raise ShapeError(f"model shape {self.name}: top-{self.top_k} of {self.num_experts} experts")
        if len(self.moe_layers) < self.num_layers and self.dense_intermediate_size <= 0:
            raise ShapeError(f"model shape {self.name}: layers without experts need dense_intermediate_size")
        if self.precision not in BYTES_PER_PARAM:
            raise ShapeError(f"model shape {self.name}: unknown precision {self.precision!r}")
        if not 0 <= self.encoder_layers < self.num_layers:
            raise ShapeError(f"model shape {self.name}: {self.encoder_layers} encoder layers of {self.num_layers}")

    @property
    def expert_params(self) -> int:
        return self.expert_matrices * self.hidden_size * self.moe_intermediate_size + self.expert_bias_params

    def expert_bytes(self, precision: str | None = None) -> int:
        """One expert's blob as the store lays it out: packed, rounded up to the 4096-byte alignment."""
        raw = int(self.expert_params * bytes_per_param(precision or self.precision))
        return -(-raw // ALIGN) * ALIGN

    def dense_params(self, layer: int) -> int:
        """Weights a layer reads besides its routed experts: attention, router, shared expert or dense MLP."""
        mlp = self.expert_matrices * self.hidden_size * (self.shared_expert_intermediate_size
                                                         if layer in self.moe_layers else self.dense_intermediate_size)
        router = self.hidden_size * self.num_experts if layer in self.moe_layers else 0
        attention = self.attention_params // 2 if layer < self.encoder_layers else self.attention_params
        return attention + mlp + router

    def dense_bytes(self, precision: str | None = None) -> int:
        """Every weight but the routed experts (each layer's dense part, the head), at `precision` (default the
        checkpoint's)."""
        params = sum(self.dense_params(layer) for layer in range(self.num_layers)) + self.head_params
        return int(params * bytes_per_param(precision or self.precision))

    @property
    def head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def total_expert_params(self) -> int:
        return len(self.moe_layers) * self.num_experts * self.expert_params

    @classmethod
    def from_spec(cls, spec: ModelSpec, name: str, precision: str | None = None) -> ModelShape:
        """Any model moetier can load. Latent attention counts its projections and caches its latent; an
        encoder-decoder is shaped as its decoder runs (self- and cross-attention in every layer), as `_switch`."""
        mla, h = spec.latent_attention, spec.hidden_size
        if mla is not None:
            attention = mla_params(h, spec.num_heads, mla.kv_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim,
                                   mla.v_head_dim, mla.q_lora_rank)
            kv = mla.cache_dim
        else:
            attention = gqa_params(h, spec.num_heads, spec.num_kv_heads, spec.head_dim)
            kv = 2 * spec.num_kv_heads * spec.head_dim
        encoder = 0
        if spec.encoder_decoder is not None:  # (the decoder's layers: self- and cross-attention)
            attention, kv, encoder = 2 * attention, 2 * kv, spec.encoder_decoder.encoder_layers
        return cls(name=name, hidden_size=h, num_layers=spec.num_layers, moe_layers=spec.moe_layers,
                   num_experts=spec.num_experts, top_k=spec.top_k, moe_intermediate_size=spec.moe_intermediate_size,
                   attention_params=attention, kv_per_token=kv, vocab_size=spec.vocab_size,
                   expert_matrices=2 if spec.activation == "relu" else 3,
                   expert_bias_params=2 * spec.moe_intermediate_size + h if spec.activation == "swiglu-clamped" else 0,
                   encoder_layers=encoder,
                   shared_expert_intermediate_size=spec.shared_expert_intermediate_size,
                   dense_intermediate_size=spec.intermediate_size,
                   precision=precision or _DTYPE_PRECISION.get(spec.dtype, "bf16"), source="the model's config.json")


_DTYPE_PRECISION = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def bytes_per_param(precision: str) -> float:
    if precision not in BYTES_PER_PARAM:
        raise ShapeError(f"unknown precision {precision!r}", hint=f"one of {', '.join(BYTES_PER_PARAM)}")
    return BYTES_PER_PARAM[precision]


def _hf(repo: str) -> str:
    return f"https://huggingface.co/{repo}/blob/main/config.json"


def _deepseek(name: str, repo: str, layers: int, vocab: int, dense_intermediate: int) -> ModelShape:
    """DeepSeek-MoE-style: the first layer dense, 64 routed experts of 1408 (top-6) and 2 shared per layer."""
    return ModelShape(name, 2048, layers, tuple(range(1, layers)), 64, 6, 1408,
                      attention_params=mla_params(2048, 16, 512, 128, 64, 128), kv_per_token=512 + 64,
                      vocab_size=vocab, shared_expert_intermediate_size=2 * 1408,
                      dense_intermediate_size=dense_intermediate, source=_hf(repo))


def _switch(experts: int) -> ModelShape:
    """Switch-Base-N: T5's 12 encoder and 12 decoder layers (numbered on, as a store numbers them), every other one
    sparse in each stack (top-1 of N plain ReLU MLPs of 3072); a decoder layer has self- and cross-attention, an
    encoder layer self-attention; one embedding table, tied to the head; fp32 checkpoints."""
    return ModelShape(f"switch-base-{experts}", 768, 24, (*range(1, 12, 2), *range(13, 24, 2)), experts, 1, 3072,
                      attention_params=2 * gqa_params(768, 12, 12, 64), kv_per_token=2 * 2 * 768,
                      vocab_size=32128, expert_matrices=2, encoder_layers=12, dense_intermediate_size=3072,
                      precision="fp32", source=_hf(f"google/switch-base-{experts}"))


SHAPES: dict[str, ModelShape] = {s.name: s for s in [
    ModelShape("mixtral-8x7b", 4096, 32, tuple(range(32)), 8, 2, 14336, gqa_params(4096, 32, 8, 128),
               2 * 8 * 128, 32000, source=_hf("mistralai/Mixtral-8x7B-v0.1")),
    ModelShape("phi-3.5-moe", 4096, 32, tuple(range(32)), 16, 2, 6400, gqa_params(4096, 32, 8, 128),
               2 * 8 * 128, 32064, source=_hf("microsoft/Phi-3.5-MoE-instruct")),
    ModelShape("qwen2-57b-a14b", 3584, 28, tuple(range(28)), 64, 8, 2560, gqa_params(3584, 28, 4, 128),
               2 * 4 * 128, 151936, shared_expert_intermediate_size=20480, source=_hf("Qwen/Qwen2-57B-A14B")),
    ModelShape("deepseek-moe-16b", 2048, 28, tuple(range(1, 28)), 64, 6, 1408, gqa_params(2048, 16, 16, 128),
               2 * 16 * 128, 102400, shared_expert_intermediate_size=2 * 1408, dense_intermediate_size=10944,
               source=_hf("deepseek-ai/deepseek-moe-16b-base")),
    _deepseek("deepseek-v2-lite", "deepseek-ai/DeepSeek-V2-Lite", 27, 102400, 10944),
    ModelShape("qwen3-30b-a3b", 2048, 48, tuple(range(48)), 128, 8, 768, gqa_params(2048, 32, 4, 128),
               2 * 4 * 128, 151936, source=_hf("Qwen/Qwen3-30B-A3B")),
    _deepseek("moonlight-16b-a3b", "moonshotai/Moonlight-16B-A3B", 27, 163840, 11264),
    ModelShape("qwen1.5-moe-a2.7b", 2048, 24, tuple(range(24)), 60, 4, 1408, gqa_params(2048, 16, 16, 128),
               2 * 16 * 128, 151936, shared_expert_intermediate_size=5632, source=_hf("Qwen/Qwen1.5-MoE-A2.7B")),
    ModelShape("olmoe-1b-7b", 2048, 16, tuple(range(16)), 64, 8, 1024, gqa_params(2048, 16, 16, 128),
               2 * 16 * 128, 50304, source=_hf("allenai/OLMoE-1B-7B-0924")),
    *[_switch(n) for n in (8, 16, 32, 64, 128, 256)],
    # today's: gpt-oss (released in MXFP4; a store holds its experts dequantized to bf16), DeepSeek-V3 (released in
    # FP8, refused: a bf16 conversion is what a store would hold), GLM-4.5-Air
    *[ModelShape(f"gpt-oss-{size}b", 2880, layers, tuple(range(layers)), experts, 4, 2880, gqa_params(2880, 64, 8, 64),
                 2 * 8 * 64, 201088, expert_bias_params=3 * 2880, source=_hf(f"openai/gpt-oss-{size}b"))
      for size, layers, experts in ((20, 24, 32), (120, 36, 128))],
    ModelShape("deepseek-v3", 7168, 61, tuple(range(3, 61)), 256, 8, 2048,
               attention_params=mla_params(7168, 128, 512, 128, 64, 128, q_lora_rank=1536), kv_per_token=512 + 64,
               vocab_size=129280, shared_expert_intermediate_size=2048, dense_intermediate_size=18432,
               source=_hf("deepseek-ai/DeepSeek-V3")),
    ModelShape("glm-4.5-air", 4096, 46, tuple(range(1, 46)), 128, 8, 1408, gqa_params(4096, 96, 8, 128), 2 * 8 * 128,
               151552, shared_expert_intermediate_size=1408, dense_intermediate_size=10944,
               source=_hf("zai-org/GLM-4.5-Air")),
]}


def shape_named(name: str) -> ModelShape | None:
    """The shape a name gives: a shape's own name, or a Hugging Face id that contains one (as an imported trace
    records it: allenai/OLMoE-1B-7B-0924). None if it names none (a model directory's shape is read from its
    config by whoever opens it)."""
    if name in SHAPES:
        return SHAPES[name]
    named = [s for s in SHAPES if s in name.lower() and not Path(name).is_dir()]
    return SHAPES[max(named, key=len)] if named else None
