"""Frozen configuration: the model's shape (parsed from a Hugging Face config.json) and the expert budget."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from moetier.errors import BudgetError, UnsupportedModelError

# the arithmetic a forward step runs on (moetier/model/kernels.py): auto (the best this CPU runs), torch, native
# (the best of moetier's own, insisting), or one path by name: avx2, avx2-vnni, avx512 (moetier's library built for
# it, every product in it), amx (the AVX-512 library for decode, torch's bf16 GEMM on AMX for prefills)
KERNELS = ("auto", "torch", "native", "avx2", "avx2-vnni", "avx512", "amx")

ALIGN = 4096  # an expert blob's alignment on disk and in memory: O_DIRECT needs block-aligned offsets, lengths
# and buffers
QK_NORMS = ("none", "head", "full")  # none; per head over head_dim (Qwen3); over all heads (OLMoE)
NORMS = ("rms", "rms-fp32-weight", "layernorm")  # RMSNorm cast before the weight (Llama), after it (gpt-oss);
# LayerNorm with a bias (Phi-MoE)
ACTIVATIONS = ("swiglu", "swiglu-clamped", "relu")  # silu(gate)·up; gpt-oss's clamped one with biases; Switch's
ROPE_KINDS = ("default", "yarn", "longrope")
ROUTERS = ("softmax", "group-limited", "noaux-tc", "sparsemixer", "topk-softmax", "top1")


@dataclass(frozen=True)
class RopeSpec:
    """Rotary position embedding as config.json's rope parameters name it (moetier/model/rope.py computes it)."""

    theta: float = 10000.0
    dim: int = 0  # rotated dimensions of a head, the rest pass unrotated (GLM's partial rotary); 0: all of it
    interleaved: bool = False  # rotate pairs (x0, x1), (x2, x3)... (DeepSeek) instead of the two halves
    kind: str = "default"  # default | yarn (DeepSeek-V3, gpt-oss) | longrope (Phi-3.5)
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0  # yarn's ramp
    beta_slow: float = 1.0
    mscale: float = 0.0  # yarn's attention factor from mscale / mscale_all_dim (DeepSeek)
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None  # cos and sin are scaled by it; None: derived from the factor
    truncate: bool = True
    short_factor: tuple[float, ...] = ()  # longrope's per-frequency factors
    long_factor: tuple[float, ...] = ()
    short_mscale: float | None = None  # Phi-MoE's cos/sin scale below / beyond original_max_position_embeddings
    long_mscale: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in ROPE_KINDS:
            raise UnsupportedModelError(f"RoPE type {self.kind!r} is not supported",
                                        hint=f"moetier runs {', '.join(ROPE_KINDS)}")
        if self.theta <= 0 or self.dim < 0 or self.dim % 2:
            raise UnsupportedModelError(f"RoPE: theta must be positive and the rotated dimensions even, got theta "
                                        f"{self.theta}, {self.dim} dimensions")
        if self.kind != "default" and (self.factor <= 0 or self.original_max_position_embeddings <= 0):
            raise UnsupportedModelError(f"RoPE {self.kind}: factor and original_max_position_embeddings must be "
                                        f"positive")
        if self.kind == "longrope" and (len(self.short_factor) != self.dim // 2
                                        or len(self.long_factor) != self.dim // 2):
            raise UnsupportedModelError(f"RoPE longrope: short_factor and long_factor need {self.dim // 2} entries "
                                        f"(one per rotated pair), got {len(self.short_factor)} and "
                                        f"{len(self.long_factor)}")


@dataclass(frozen=True)
class RouterSpec:
    """How a token chooses its experts and weighs them (moetier/model/router.py)."""

    kind: str = "softmax"  # softmax over all experts, top-k (Mixtral, Qwen, OLMoE, DeepSeek-V2 greedy);
    # group-limited (DeepSeek-V2: top-k within the best groups); noaux-tc (DeepSeek-V3, GLM-4.5: sigmoid with a
    # correction bias, groups by their two best); sparsemixer (Phi-MoE's top-2 at evaluation); topk-softmax
    # (gpt-oss: softmax over the top-k logits); top1 (Switch: argmax with an expert capacity per sequence)
    norm_topk_prob: bool = False
    scaling_factor: float = 1.0  # routed_scaling_factor
    num_groups: int = 1
    topk_groups: int = 1
    fp32: bool = False  # logits from fp32 copies of input and weight (DeepSeek, GLM, Switch)
    fp32_weights: bool = False  # the top-k weights stay fp32 (Mixtral, DeepSeek, GLM)
    bias: bool = False  # the router has a bias (gpt-oss)
    jitter_eps: float = 0.0  # sparsemixer's threshold
    capacity: int = 0  # top1: tokens an expert takes per sequence in one forward (0: unlimited)

    def __post_init__(self) -> None:
        if self.kind not in ROUTERS:
            raise UnsupportedModelError(f"router {self.kind!r} is not supported", hint=f"one of {ROUTERS}")
        if self.num_groups < 1 or not 1 <= self.topk_groups <= self.num_groups:
            raise UnsupportedModelError(f"config.json: topk_group {self.topk_groups} must be between 1 and n_group "
                                        f"{self.num_groups}")
        if self.capacity < 0:
            raise UnsupportedModelError(f"config.json: expert_capacity must not be negative, got {self.capacity}")


@dataclass(frozen=True)
class EncoderDecoderSpec:
    """A text-to-text model (Switch Transformers, T5's layout): the first `encoder_layers` of ModelSpec's layers
    are the encoder's blocks, the rest the decoder's; attention is T5's, unscaled, with a learned bias per head for
    each bucket of relative position (computed in each stack's first block, shared by the others); a head tied to
    the embedding sees the decoder's output times d_model^-0.5."""

    encoder_layers: int
    num_buckets: int = 32
    max_distance: int = 128
    decoder_start_token_id: int = 0

    def __post_init__(self) -> None:
        if self.encoder_layers <= 0 or self.num_buckets < 2 or self.max_distance <= self.num_buckets // 2:
            raise UnsupportedModelError(f"config.json: an encoder-decoder needs encoder layers, at least 2 relative "
                                        f"attention buckets and a max distance beyond half of them, got "
                                        f"{self.encoder_layers}, {self.num_buckets}, {self.max_distance}")


@dataclass(frozen=True)
class LatentAttentionSpec:
    """DeepSeek's multi-head latent attention: keys and values come from one compressed latent per token (what the
    KV cache holds) plus a small rotary key shared by all heads."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None  # None: q projected directly

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) <= 0:
                raise UnsupportedModelError(f"config.json: {name} must be positive, got {getattr(self, name)}")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise UnsupportedModelError(f"config.json: q_lora_rank must be positive or null, got {self.q_lora_rank}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_dim(self) -> int:
        """What one token's cache entry holds per layer: the latent and the rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class ModelSpec:
    """Everything the lean transformer needs to know about a checkpoint. Built by a family's parser."""

    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    moe_layers: tuple[int, ...]
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeSpec = RopeSpec()
    router: RouterSpec = RouterSpec()
    intermediate_size: int = 0  # dense MLP layers (mlp_only_layers / decoder_sparse_step / first_k_dense_replace)
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    shared_expert_gated: bool = False  # Qwen2-MoE scales it by sigmoid(shared_expert_gate(x)); DeepSeek does not
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: str = "none"
    latent_attention: LatentAttentionSpec | None = None  # MLA (DeepSeek-V2/V3) instead of grouped-query attention
    encoder_decoder: EncoderDecoderSpec | None = None  # a text-to-text model (Switch) instead of a decoder alone
    attention_sinks: bool = False  # a learned logit per head in every softmax (gpt-oss)
    norm: str = "rms"
    activation: str = "swiglu"  # of the experts and the dense MLPs
    swiglu_alpha: float = 1.702  # swiglu-clamped: gate·sigmoid(alpha·gate)·(up + 1), both clamped to limit
    swiglu_limit: float = 7.0
    lm_head_bias: bool = False
    clip_qkv: float | None = None
    sliding_windows: tuple[int | None, ...] = ()  # per layer; empty means none anywhere
    tie_word_embeddings: bool = False
    dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # a merged model's (moetier/merge: CoMoE): per MoE layer, each expert's principal — the expert its group was
    # merged into and keeps its id; the others are absent from the store. Empty: nothing merged.
    expert_groups: tuple[tuple[int, ...], ...] = ()
    hf_config: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        positive = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                    "num_experts", "top_k", "moe_intermediate_size", "max_position_embeddings")
        for name in positive:
            if getattr(self, name) <= 0:
                raise UnsupportedModelError(f"config.json: {name} must be positive, got {getattr(self, name)}")
        if self.top_k > self.num_experts:
            raise UnsupportedModelError(
                f"config.json: num_experts_per_tok={self.top_k} exceeds the number of experts {self.num_experts}")
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"config.json: {self.num_heads} attention heads are not a multiple of {self.num_kv_heads} kv heads")
        if self.qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm must be one of {QK_NORMS}, got {self.qk_norm!r}")
        if any(not 0 <= i < self.num_layers for i in self.moe_layers):
            raise UnsupportedModelError(f"config.json: MoE layer index out of range in {self.moe_layers}")
        if self.sliding_windows and len(self.sliding_windows) != self.num_layers:
            raise ValueError("sliding_windows must list one entry per layer")
        if len(self.moe_layers) < self.num_layers and self.intermediate_size <= 0:
            raise UnsupportedModelError("config.json: dense MLP layers need intermediate_size > 0")
        if self.encoder_decoder and not 0 < self.encoder_decoder.encoder_layers < self.num_layers:
            raise UnsupportedModelError("config.json: an encoder-decoder needs layers in both stacks")
        if self.norm not in NORMS or self.activation not in ACTIVATIONS:
            raise ValueError(f"norm must be one of {NORMS} and activation one of {ACTIVATIONS}")
        rotated = self.latent_attention.qk_rope_head_dim if self.latent_attention else self.head_dim
        if self.rope.dim > rotated:
            raise UnsupportedModelError(f"config.json: {self.rope.dim} rotary dimensions exceed the {rotated} of a head")
        if self.router.kind in ("group-limited", "noaux-tc") and self.num_experts % self.router.num_groups:
            raise UnsupportedModelError(f"config.json: {self.num_experts} experts do not split into n_group "
                                        f"{self.router.num_groups} groups")
        if self.router.kind == "noaux-tc" and self.num_experts // self.router.num_groups < 2:
            raise UnsupportedModelError("config.json: noaux_tc ranks groups by their two best experts; a group "
                                        "holds fewer")
        if self.router.kind in ("group-limited", "noaux-tc") and (
                self.top_k > self.router.topk_groups * (self.num_experts // self.router.num_groups)):
            raise UnsupportedModelError(f"config.json: top-{self.top_k} cannot be chosen from {self.router.topk_groups}"
                                        f" groups of {self.num_experts // self.router.num_groups}")
        if self.router.kind == "sparsemixer" and self.top_k != 2:
            raise UnsupportedModelError(f"config.json: Phi-MoE's sparsemixer chooses exactly 2 experts, not "
                                        f"num_experts_per_tok={self.top_k}")
        if self.router.kind == "top1" and self.top_k != 1:
            raise UnsupportedModelError(f"config.json: a top-1 router chooses 1 expert, not {self.top_k}")
        if self.expert_groups:
            self._check_groups()

    def _check_groups(self) -> None:
        if len(self.expert_groups) != len(self.moe_layers) or self.router.kind not in ("softmax", "top1"):
            raise UnsupportedModelError("config.json: moetier_merged needs one group list per MoE layer, and a "
                                        "softmax or top-1 router")
        for layer, groups in zip(self.moe_layers, self.expert_groups):
            principals = set(groups)
            if len(groups) != self.num_experts or any(not 0 <= g < self.num_experts or groups[g] != g
                                                      for g in principals) or len(principals) < self.top_k:
                raise UnsupportedModelError(f"config.json: moetier_merged's groups of layer {layer} must map each "
                                            f"of the {self.num_experts} experts to a principal that maps to itself, "
                                            f"at least top-{self.top_k} of them")

    @property
    def is_moe_layer(self) -> tuple[bool, ...]:
        moe = set(self.moe_layers)
        return tuple(i in moe for i in range(self.num_layers))

    def sliding_window(self, layer: int) -> int | None:
        return self.sliding_windows[layer] if self.sliding_windows else None

    @property
    def expert_shapes(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """One routed expert's tensors as a store holds them: its matrices [out, in] (gate and up packed as
        gate_up_proj [2I, H], gate rows first), then its biases."""
        h, i = self.hidden_size, self.moe_intermediate_size
        if self.activation == "relu":  # Switch: up (wi) and down (wo)
            return (("up_proj", (i, h)), ("down_proj", (h, i)))
        shapes = (("gate_up_proj", (2 * i, h)), ("down_proj", (h, i)))
        if self.activation == "swiglu-clamped":  # gpt-oss
            shapes += (("gate_up_proj.bias", (2 * i,)), ("down_proj.bias", (h,)))
        return shapes

    @property
    def expert_params(self) -> int:
        """Parameters of one routed expert: its matrices and biases."""
        return sum(math.prod(shape) for _, shape in self.expert_shapes)

    def experts_of(self, layer: int) -> tuple[int, ...]:
        """The experts a MoE layer holds, ascending: all of them, or a merged model's principals."""
        if not self.expert_groups:
            return tuple(range(self.num_experts))
        return tuple(sorted(set(self.expert_groups[self.moe_layers.index(layer)])))

    def expert_keys(self) -> list[tuple[int, int]]:
        """(layer, expert) of every expert the model holds, layer by layer, ascending."""
        return [(layer, e) for layer in self.moe_layers for e in self.experts_of(layer)]

    @property
    def num_expert_keys(self) -> int:
        if not self.expert_groups:
            return len(self.moe_layers) * self.num_experts
        return sum(len(set(g)) for g in self.expert_groups)


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12, "tb": 1e12,
          "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20, "gi": 2**30, "gib": 2**30, "ti": 2**40, "tib": 2**40}


_BUDGET_HINT = "--expert-memory takes bytes ('512MiB', '2GB'), a share of all expert bytes ('30%'), or 'auto'"


@dataclass(frozen=True)
class MemoryBudget:
    """The fast tier's expert budget as the user gave it: bytes, a share of all expert bytes, a number of experts
    (cache-bench's slot counts), or auto."""

    kind: str  # "bytes" | "share" | "entries" | "auto"
    value: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in ("bytes", "share", "entries", "auto"):
            raise ValueError(f"unknown budget kind {self.kind!r}")
        if self.kind == "share" and not 0 < self.value <= 1:
            raise BudgetError(f"expert memory share must be in (0%, 100%], got {self.value:.0%}", hint=_BUDGET_HINT)
        if self.kind in ("bytes", "entries") and self.value <= 0:
            raise BudgetError("expert memory must be positive", hint=_BUDGET_HINT)

    def label(self) -> str:
        """As a user would write it."""
        if self.kind == "share":
            return f"{self.value:.0%}"
        if self.kind == "entries":
            return f"{int(self.value)} experts"
        return "auto" if self.kind == "auto" else format_bytes(self.value)

    @classmethod
    def parse(cls, text: str | int | float | MemoryBudget) -> MemoryBudget:
        """'30%', '512MiB', '2GB', '1073741824', 'auto'; a float in (0, 1] is a share."""
        if isinstance(text, MemoryBudget):
            return text
        if isinstance(text, bool) or not isinstance(text, (str, int, float)):
            raise BudgetError(f"expert memory must be bytes, a share or 'auto', not {text!r}", hint=_BUDGET_HINT)
        if isinstance(text, float) and not math.isfinite(text):
            raise BudgetError(f"expert memory must be a finite number, not {text!r}", hint=_BUDGET_HINT)
        if isinstance(text, float) and 0 < text <= 1:
            return cls("share", text)
        if isinstance(text, (int, float)):
            return cls("bytes", float(text))
        s = text.strip().lower()
        if s == "auto":
            return cls("auto")
        if s.endswith("%"):
            try:
                return cls("share", float(s[:-1]) / 100)
            except ValueError:
                pass
        m = _SIZE.match(s)
        if m and m.group(2).lower() in _UNITS:
            return cls("bytes", float(m.group(1)) * _UNITS[m.group(2).lower()])
        raise BudgetError(f"cannot read expert memory {text!r}", hint=_BUDGET_HINT)

    def resolve(self, total_expert_bytes: int, available_bytes: int | None = None, entry_bytes: int = 1) -> int:
        """Bytes for the expert cache. `available_bytes` is what auto may use (free memory less what else is
        needed); `entry_bytes` is one expert's (for a number of experts)."""
        if self.kind == "share":
            return int(self.value * total_expert_bytes)
        if self.kind == "bytes":
            return int(self.value)
        if self.kind == "entries":
            return int(self.value) * entry_bytes
        if available_bytes is None:
            raise ValueError("auto budget needs the available memory")
        return max(0, min(total_expert_bytes, available_bytes))


_HOST_HINT = "--host-memory takes bytes ('8GiB'), a share of the experts ('50%'), auto (the default), or 0 (none)"


@dataclass(frozen=True)
class HostMemory:
    """The host tier behind a GPU's expert cache as the user gave it: a budget (bytes, a share of the experts at
    the precisions the run reads, or auto), or none (`0`: every miss is read from disk)."""

    budget: MemoryBudget | None = MemoryBudget("auto")  # None: no host tier

    def __post_init__(self) -> None:
        if self.budget is not None and self.budget.kind == "entries":
            raise BudgetError("the host tier's budget is bytes, a share or auto", hint=_HOST_HINT)

    def label(self) -> str:
        return "0" if self.budget is None else self.budget.label()

    @classmethod
    def parse(cls, text: str | HostMemory) -> HostMemory:
        if isinstance(text, HostMemory):
            return text
        if str(text).strip().lower() in ("0", "none", "0b", "0gib", "0gb"):
            return cls(None)
        try:
            return cls(MemoryBudget.parse(text))
        except BudgetError as e:
            raise BudgetError(str(e).split("\n")[0].replace("expert memory", "host memory"), hint=_HOST_HINT) from None


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
