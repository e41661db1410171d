"""The demo models: architecture (transformers config kwargs) and training recipe."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Recipe:
    name: str
    model_type: str
    config: dict
    steps: int = 1400
    batch_size: int = 16  # sequences per step, half prose, half code
    seq_len: int = 256
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.1
    router_aux_loss_coef: float = 0.01  # the load-balancing loss, on
    checkpoint_every: int = 100
    seed: int = 0
    tags: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if self.batch_size % 2:
            raise ValueError("batch_size must be even (half prose, half code)")


COMMON = dict(vocab_size=8192, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
              max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=None,
              eos_token_id=0, pad_token_id=0)

RECIPES = {
    # Qwen2-MoE with fine-grained experts in the DeepSeekMoE style: 32 routed experts, top-4, plus the shared one.
    "demo-fine": Recipe("demo-fine", "qwen2_moe", dict(
        COMMON, num_experts=32, num_experts_per_tok=4, moe_intermediate_size=128, shared_expert_intermediate_size=512,
        intermediate_size=512, norm_topk_prob=False, qkv_bias=True)),
    # Mixtral's setting as in HOBBIT: 8 experts, top-2.
    "demo-coarse": Recipe("demo-coarse", "mixtral", dict(
        COMMON, num_local_experts=8, num_experts_per_tok=2, intermediate_size=512, sliding_window=None,
        rope_theta=10000.0)),
    # OLMoE's setting (FlashMoE, PreScope): 12 layers of 64 fine-grained experts, top-8, no shared expert; deep
    # enough for look-ahead of 1-3 layers and for input/middle/output layer groups. Expert intermediate 64 keeps
    # it ~86 MB in bf16; the inflated demo-deep-xl brings each expert to OLMoE's 12.6 MB.
    "demo-deep": Recipe("demo-deep", "olmoe", dict(
        COMMON, num_hidden_layers=12, num_experts=64, num_experts_per_tok=8, intermediate_size=64,
        norm_topk_prob=False, rope_theta=10000.0), steps=2000),
}
