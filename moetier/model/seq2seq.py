"""Switch Transformers' encoder-decoder (T5's layout), with the same interface as the decoder-only `Transformer`:
`forward(batch, kv)` -> next-token logits [B, V], routed experts delegated to the executor.

A prefill step runs the encoder over each prompt (bidirectional attention with T5's relative-position bias; the
MoE layers route each prompt's tokens with its own expert capacity), stores every decoder layer's cross-attention
keys and values of the encoder's output in the KV cache, and runs the decoder on the start token. A decode step
runs the decoder alone on one token per sequence. The engine's generation loop feeds positions counted from the
prompt (as for a decoder-only model); the decoder's own position is that minus the prompt's length
(`KVCache.encoder_lengths`)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from moetier.config import ModelSpec
from moetier.errors import MoetierError
from moetier.model.batch import StepBatch
from moetier.model.kernels import TorchKernels
from moetier.model.kv_cache import KVCache
from moetier.model.layers import layer_weights
from moetier.model.router import add_groups, make_router
from moetier.model.transformer import Experts


def relative_position_bucket(relative: torch.Tensor, bidirectional: bool, num_buckets: int,
                             max_distance: int) -> torch.Tensor:
    """T5's buckets of key position − query position: exact below num_buckets/4 (or /2 one-sided), then
    logarithmic up to max_distance; the encoder tells the two directions apart, the decoder sees only the past."""
    buckets = torch.zeros_like(relative)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative > 0).long() * num_buckets
        relative = relative.abs()
    else:
        relative = -torch.clamp(relative, max=0)
    max_exact = num_buckets // 2
    large = max_exact + (torch.log(relative.float() / max_exact) / math.log(max_distance / max_exact)
                         * (num_buckets - max_exact)).long()  # (log 0 where relative is small: not taken)
    large = torch.clamp(large, max=num_buckets - 1)
    return buckets + torch.where(relative < max_exact, relative, large)


class EncoderDecoder:
    def __init__(self, spec: ModelSpec, dense: dict[str, torch.Tensor], experts: Experts,
                 kernels: TorchKernels | None = None) -> None:
        self.spec, self.w, self.experts = spec, dense, experts
        self.kernels = kernels or TorchKernels()
        self.dtype, self.device = dense["embed_tokens"].dtype, dense["embed_tokens"].device
        self.s2s = spec.encoder_decoder
        self.layers = layer_weights(dense, spec.num_layers)
        self.router = make_router(spec.router, spec.top_k, merged=bool(spec.expert_groups))
        add_groups(self.layers, spec, self.device)  # a merged model's (MergedTop1Router reads them)
        self.is_moe = spec.is_moe_layer
        self.lm_head = dense.get("lm_head", dense["embed_tokens"])
        self.head_scale = spec.hidden_size ** -0.5 if spec.tie_word_embeddings else None  # T5's tied head
        self.decoder_layers = range(self.s2s.encoder_layers, spec.num_layers)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self.kernels.rms_norm(x, weight, self.spec.rms_norm_eps)  # T5's: no mean, no bias

    def _heads(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """[N, H] -> [N, heads, d_kv]."""
        return self.kernels.linear(x, weight).view(x.shape[0], self.spec.num_heads, self.spec.head_dim)

    def _bias(self, table: str, relative: torch.Tensor, bidirectional: bool) -> torch.Tensor:
        """Relative positions [..., q, k] -> the attention bias [..., heads, q, k] the stack's first block learned."""
        buckets = relative_position_bucket(relative, bidirectional, self.s2s.num_buckets, self.s2s.max_distance)
        return self.w[table][buckets].movedim(-1, -3)

    def _ff(self, layer: int, x: torch.Tensor, segments: list[tuple[int, int]] | None) -> torch.Tensor:
        w = self.layers[layer]
        if self.is_moe[layer]:
            scores, topk_ids, topk_weights = self.router(x, w, segments)
            return self.experts(layer, x, scores, topk_ids, topk_weights, None)
        return self.kernels.linear(F.relu(self.kernels.linear(x, w["mlp.up_proj"])), w["mlp.down_proj"])

    @torch.inference_mode()
    def forward(self, batch: StepBatch, kv: KVCache, all_logits: bool = False) -> torch.Tensor:
        """Logits [B, V] of each sequence's next decoder token."""
        if all_logits:
            raise MoetierError("a text-to-text model gives one next-token distribution per sequence, not one per "
                               "prompt token")
        if batch.decode:
            rows = batch.rows_host
            positions = [end - kv.encoder_lengths[row] for row, end in zip(rows, batch.lengths_host)]
            h = self.w["embed_tokens"][batch.token_ids]  # [B, H]
        else:
            if any(start for _, _, start, _ in batch.segments):
                raise MoetierError("a text-to-text model encodes each prompt whole; it cannot continue one")
            self._encode(batch, kv)
            rows, positions = [row for row, *_ in batch.segments], [0] * len(batch.segments)
            start = torch.full((len(rows),), self.s2s.decoder_start_token_id, device=self.device)
            h = self.w["embed_tokens"][start]
        return self._decode(h, rows, positions, kv)

    def _encode(self, batch: StepBatch, kv: KVCache) -> None:
        segments = [(first, length) for _, first, _, length in batch.segments]
        biases = {}
        for _, length in segments:  # one bias per prompt length, shared by every encoder block
            if length not in biases:
                p = torch.arange(length, device=self.device)
                biases[length] = self._bias("encoder.relative_attention_bias", p[None, :] - p[:, None], True)[None]
        h = self.w.get("encoder.embed_tokens", self.w["embed_tokens"])[batch.token_ids]  # [N, H] (one table if tied)
        for i in range(self.s2s.encoder_layers):
            w = self.layers[i]
            x = self._norm(h, w["input_norm"])
            q, k, v = (self._heads(x, w[f"{p}_proj"]) for p in "qkv")
            out = torch.empty_like(q)
            for first, length in segments:
                s = slice(first, first + length)
                o = F.scaled_dot_product_attention(q[s].transpose(0, 1)[None], k[s].transpose(0, 1)[None],
                                                   v[s].transpose(0, 1)[None], attn_mask=biases[length], scale=1.0)
                out[s] = o[0].transpose(0, 1)
            h = h + self.kernels.linear(out.reshape(h.shape[0], -1), w["o_proj"])
            h = h + self._ff(i, self._norm(h, w["post_attn_norm"]), segments)
        encoded = self._norm(h, self.w["encoder.norm"])
        for j in self.decoder_layers:  # each decoder layer's keys and values of the encoder's output, once
            w = self.layers[j]
            k, v = self._heads(encoded, w["cross_k_proj"]), self._heads(encoded, w["cross_v_proj"])
            for (row, first, _, length) in batch.segments:
                kv.cross_k[j][row, :, :length] = k[first:first + length].transpose(0, 1)
                kv.cross_v[j][row, :, :length] = v[first:first + length].transpose(0, 1)
        for row, _, _, length in batch.segments:
            kv.encoder_lengths[row] = length

    def _decode(self, h: torch.Tensor, rows: list[int], positions: list[int], kv: KVCache) -> torch.Tensor:
        """One decoder token per sequence: h [B, H] at decoder `positions` of KV rows `rows`."""
        b, dev = h.shape[0], self.device
        rows_t, pos_t = torch.tensor(rows, device=dev), torch.tensor(positions, device=dev)
        s = max(positions) + 1
        relative = torch.arange(s, device=dev)[None, :] - pos_t[:, None]  # [B, S] key − query
        self_bias = self._bias("decoder.relative_attention_bias", relative[:, None, :], False)  # [B, heads, 1, S]
        self_bias = self_bias.masked_fill((relative > 0)[:, None, None, :], float("-inf"))
        lengths = [kv.encoder_lengths[r] for r in rows]
        e = max(lengths)
        cross_mask = torch.arange(e, device=dev)[None, :] < torch.tensor(lengths, device=dev)[:, None]  # [B, E]
        for j in self.decoder_layers:
            w = self.layers[j]
            x = self._norm(h, w["input_norm"])
            q, k, v = (self._heads(x, w[f"{p}_proj"]) for p in "qkv")
            kv.write(j, rows_t, pos_t, k, v)
            o = F.scaled_dot_product_attention(q[:, :, None], kv.k[j][rows_t, :, :s], kv.v[j][rows_t, :, :s],
                                               attn_mask=self_bias, scale=1.0)  # [B, heads, 1, D]
            h = h + self.kernels.linear(o.reshape(b, -1), w["o_proj"])
            q = self._heads(self._norm(h, w["cross_norm"]), w["cross_q_proj"])
            o = F.scaled_dot_product_attention(q[:, :, None], kv.cross_k[j][rows_t, :, :e], kv.cross_v[j][rows_t, :, :e],
                                               attn_mask=cross_mask[:, None, None, :], scale=1.0)
            h = h + self.kernels.linear(o.reshape(b, -1), w["cross_o_proj"])
            h = h + self._ff(j, self._norm(h, w["post_attn_norm"]), None)
        h = self._norm(h, self.w["norm"])
        if self.head_scale is not None:
            h = h * self.head_scale
        return self.kernels.linear(h, self.lm_head)

    def lookahead(self, layer: int, target: int) -> torch.Tensor:
        raise MoetierError("the smoe-lookahead predictor runs a decoder-only model's next layer; this is an "
                           "encoder-decoder", hint="use another predictor, e.g. stacked-gates")
