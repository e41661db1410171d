"""Switch Transformers: T5's encoder-decoder with every `*_sparse_step`-th block's MLP (block i with
i % step == 1) replaced by top-1 routed ReLU experts (wi, wo), each taking at most `expert_capacity` tokens of a
sequence per forward. moetier numbers the encoder's blocks 0..L_enc-1 and the decoder's after them, so every
expert of either stack is one (layer, expert) key of the cache: offloading covers both (CoMoE's merging targets
the encoder's).

Each block: RMS-style layer norm (T5's, no mean, no bias) before self-attention, cross-attention (decoder) and the
MLP; attention without scaling and with a relative-position bias; the head tied to the embedding (and scaled by
d_model^-0.5) unless tie_word_embeddings is false."""

from __future__ import annotations

from moetier.config import EncoderDecoderSpec, ModelSpec, RouterSpec
from moetier.errors import UnsupportedModelError
from moetier.model.families.base import Family, expert_groups, number, optional_int, require, token_ids

CONTEXT = 512  # T5's and Switch's training length: relative positions run longer, but moetier bounds the window


def sparse_blocks(num_layers: int, num_sparse: int) -> list[int]:
    """The reference's placement: step = layers // sparse; block i sparse if i % step == 1 (all if step is 1)."""
    if num_sparse <= 0:
        return []
    step = num_layers // num_sparse
    if step <= 0:
        raise UnsupportedModelError(f"config.json: {num_sparse} sparse layers in a stack of {num_layers}")
    return [i for i in range(num_layers) if step == 1 or i % step == 1]


class SwitchFamily(Family):
    """Switch Transformers: T5 encoder-decoder, top-1 ReLU experts with capacity in both stacks."""

    def parse(self, cfg: dict) -> ModelSpec:
        if cfg.get("dense_act_fn", "relu") != "relu":
            raise UnsupportedModelError(f"config.json: dense_act_fn {cfg['dense_act_fn']!r} is not supported (relu)")
        if cfg.get("router_dtype", "float32") != "float32":
            raise UnsupportedModelError(f"config.json: router_dtype {cfg['router_dtype']!r} is not supported "
                                        f"(float32, the released models')")
        enc = require(cfg, "num_layers")
        dec = optional_int(cfg, "num_decoder_layers") or enc
        moe = sparse_blocks(enc, optional_int(cfg, "num_sparse_encoder_layers", 3)) + [
            enc + i for i in sparse_blocks(dec, optional_int(cfg, "num_sparse_decoder_layers", 3))]
        if not moe:
            raise UnsupportedModelError("config.json: no sparse layer in either stack; this is a dense T5")
        d_ff, heads, tied = require(cfg, "d_ff"), require(cfg, "num_heads"), bool(cfg.get("tie_word_embeddings", True))
        return ModelSpec(
            family=self.name,
            vocab_size=require(cfg, "vocab_size"),
            hidden_size=require(cfg, "d_model"),
            num_layers=enc + dec,
            num_heads=heads,
            num_kv_heads=heads,
            head_dim=require(cfg, "d_kv"),
            num_experts=require(cfg, "num_experts"),
            top_k=1,
            moe_intermediate_size=d_ff,
            intermediate_size=d_ff,
            moe_layers=tuple(moe),
            rms_norm_eps=number(cfg, "layer_norm_epsilon", 1e-6),
            max_position_embeddings=optional_int(cfg, "n_positions") or CONTEXT,
            router=RouterSpec("top1", fp32=True, bias=bool(cfg.get("router_bias", False)),
                              capacity=require(cfg, "expert_capacity")),
            activation="relu",
            encoder_decoder=EncoderDecoderSpec(
                encoder_layers=enc, num_buckets=optional_int(cfg, "relative_attention_num_buckets", 32),
                max_distance=optional_int(cfg, "relative_attention_max_distance", 128),
                decoder_start_token_id=optional_int(cfg, "decoder_start_token_id",
                                                    optional_int(cfg, "pad_token_id", 0))),  # T5's: the pad token
            tie_word_embeddings=tied,
            dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32").removeprefix("torch."),
            eos_token_ids=token_ids(cfg.get("eos_token_id"), "eos_token_id"),
            expert_groups=expert_groups(cfg),
            hf_config=cfg,
        )

    def block(self, spec: ModelSpec, layer: int) -> tuple[str, bool]:
        """The checkpoint's prefix of one of our layers, and whether it is the decoder's."""
        enc = spec.encoder_decoder.encoder_layers
        return (f"encoder.block.{layer}.", False) if layer < enc else (f"decoder.block.{layer - enc}.", True)

    def dense_names(self, spec: ModelSpec) -> dict[str, str]:
        names = {"embed_tokens": "shared.weight", "encoder.norm": "encoder.final_layer_norm.weight",
                 "norm": "decoder.final_layer_norm.weight",
                 "encoder.relative_attention_bias": "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
                 "decoder.relative_attention_bias": "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"}
        if not spec.tie_word_embeddings:  # the head and each stack's embedding are their own
            names.update(lm_head="lm_head.weight", embed_tokens="decoder.embed_tokens.weight")
            names["encoder.embed_tokens"] = "encoder.embed_tokens.weight"
        for i in range(spec.num_layers):
            ours, (hf, decoder) = f"layers.{i}.", self.block(spec, i)
            names[ours + "input_norm"] = hf + "layer.0.layer_norm.weight"
            names.update({ours + f"{p}_proj": hf + f"layer.0.SelfAttention.{p}.weight" for p in "qkvo"})
            if decoder:
                names[ours + "cross_norm"] = hf + "layer.1.layer_norm.weight"
                names.update({ours + f"cross_{p}_proj": hf + f"layer.1.EncDecAttention.{p}.weight" for p in "qkvo"})
            ff = hf + f"layer.{2 if decoder else 1}."
            names[ours + "post_attn_norm"] = ff + "layer_norm.weight"
            if i in spec.moe_layers:
                names.update(self.router_names(spec, ours, ff + "mlp.router.classifier."))
            else:
                names[ours + "mlp.up_proj"], names[ours + "mlp.down_proj"] = ff + "mlp.wi.weight", ff + "mlp.wo.weight"
        return names

    def expert_names(self, layer: int, expert: int, spec: ModelSpec | None = None) -> tuple[str, ...]:
        hf, decoder = self.block(spec, layer)
        base = hf + f"layer.{2 if decoder else 1}.mlp.experts.expert_{expert}."
        return base + "wi.weight", base + "wo.weight"


SWITCH = SwitchFamily("switch_transformers", ("switch_transformers",), "mlp", "router", ("wi", "wi", "wo"),
                      "d_ff", expert_format="switch")
