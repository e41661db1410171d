"""Frozen configuration: the model's shape (parsed from a Hugging Face config.json) and the expert budget."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from moetier.errors import BudgetError, UnsupportedModelError

KERNELS = ("auto", "torch", "native")  # the arithmetic a forward step runs on (moetier/model/kernels.py)

ALIGN = 4096  # an expert blob's alignment on disk and in memory: O_DIRECT needs block-aligned offsets, lengths
# and buffers
QK_NORMS = ("none", "head", "full")  # none; per head over head_dim (Qwen3); over all heads (OLMoE)


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
    norm_topk_prob: bool
    moe_layers: tuple[int, ...]
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    intermediate_size: int = 0  # dense MLP layers (mlp_only_layers / decoder_sparse_step)
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: str = "none"
    clip_qkv: float | None = None
    sliding_windows: tuple[int | None, ...] = ()  # per layer; empty means none anywhere
    tie_word_embeddings: bool = False
    dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
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

    @property
    def is_moe_layer(self) -> tuple[bool, ...]:
        moe = set(self.moe_layers)
        return tuple(i in moe for i in range(self.num_layers))

    def sliding_window(self, layer: int) -> int | None:
        return self.sliding_windows[layer] if self.sliding_windows else None

    @property
    def expert_params(self) -> int:
        """Parameters of one routed expert: gate, up and down projections."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def num_expert_keys(self) -> int:
        return len(self.moe_layers) * self.num_experts


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12, "tb": 1e12,
          "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20, "gi": 2**30, "gib": 2**30, "ti": 2**40, "tib": 2**40}


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
            raise BudgetError(f"expert memory share must be in (0%, 100%], got {self.value:.0%}")
        if self.kind in ("bytes", "entries") and self.value <= 0:
            raise BudgetError("expert memory must be positive")

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
        raise BudgetError(f"cannot read expert memory {text!r}",
                          hint="give bytes ('512MiB', '2GB'), a share of all expert bytes ('30%'), or 'auto'")

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


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
