"""Rotary position embedding: the frequencies of each RoPE type a supported checkpoint names (default, YaRN,
LongRoPE), written as transformers computes them, and cos/sin tables applied to whole heads or their first `dim`
dimensions, in halves (Llama) or in interleaved pairs (DeepSeek)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moetier.config import RopeSpec
from moetier.model.batch import StepBatch


def inverse_frequencies(spec: RopeSpec, dim: int) -> tuple[torch.Tensor, float]:
    """inv_freq [dim/2] fp32 and the factor cos and sin are scaled by (transformers' attention_scaling)."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    if spec.kind == "yarn":
        return _yarn(spec, dim, exponents)
    if spec.kind == "longrope":
        # transformers' Phi-MoE always takes the short factors (its rotary module asks for them without a sequence
        # length); only the cos/sin scale changes beyond the original context (`Rope.tables`)
        factors = torch.tensor(spec.short_factor, dtype=torch.float32)
        return 1.0 / (factors * spec.theta ** exponents), _longrope_attention_factor(spec)
    return 1.0 / (spec.theta ** exponents), 1.0


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(spec: RopeSpec, dim: int, exponents: torch.Tensor) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071): frequencies interpolated by `factor` below a ramp between the dimensions that turn
    beta_slow and beta_fast times over the original context, kept above it."""
    attention = spec.attention_factor
    if attention is None:
        attention = (yarn_mscale(spec.factor, spec.mscale) / yarn_mscale(spec.factor, spec.mscale_all_dim)
                     if spec.mscale and spec.mscale_all_dim else yarn_mscale(spec.factor))

    def correction_dim(rotations: float) -> float:
        return dim * math.log(spec.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(spec.theta))

    low, high = correction_dim(spec.beta_fast), correction_dim(spec.beta_slow)
    if spec.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # (transformers' guard against a zero-width ramp)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = spec.theta ** exponents
    extrapolation = 1 - ramp
    inv_freq = 1.0 / (spec.factor * pos_freqs) * (1 - extrapolation) + 1.0 / pos_freqs * extrapolation
    return inv_freq, attention


def _longrope_attention_factor(spec: RopeSpec) -> float:
    if spec.attention_factor is not None:
        return spec.attention_factor
    if spec.factor <= 1:
        return 1.0
    return math.sqrt(1 + math.log(spec.factor) / math.log(spec.original_max_position_embeddings))


@dataclass(frozen=True)
class RopeTables:
    """cos/sin [S, dim] in the model's dtype, for rotating the first `dim` dimensions of a head."""

    cos: torch.Tensor
    sin: torch.Tensor
    interleaved: bool

    @property
    def dim(self) -> int:
        return self.cos.shape[-1]

    def plain(self, head_dim: int) -> bool:
        """Whole heads in halves: what the native one-row kernel rotates."""
        return not self.interleaved and self.dim == head_dim

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [N, heads, D], positions [N]."""
        cos, sin = self.cos[positions][:, None, :], self.sin[positions][:, None, :]  # [N, 1, dim]
        dim, half = self.dim, self.dim // 2
        rot = x[..., :dim]
        if self.interleaved:  # pairs (x0, x1), (x2, x3)...; out in halves, as transformers' DeepSeek-V3 lays it
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            c, s = cos[..., :half], sin[..., :half]
            out = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
        else:
            out = rot * cos + torch.cat((-rot[..., half:], rot[..., :half]), dim=-1) * sin
        return out if dim == x.shape[-1] else torch.cat((out, x[..., dim:]), dim=-1)


class Rope:
    """The tables up to `max_len` positions; LongRoPE keeps a second pair scaled for beyond the original context."""

    def __init__(self, spec: RopeSpec, head_dim: int, max_len: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        self.spec, self.max_len = spec, max_len
        dim = spec.dim or head_dim
        inv_freq, scale = inverse_frequencies(spec, dim)
        freqs = torch.arange(max_len, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # [S, dim], computed on the CPU as the reference does
        cos, sin = emb.cos(), emb.sin()

        def tables(s: float) -> RopeTables:
            return RopeTables((cos * s).to(device, dtype), (sin * s).to(device, dtype), spec.interleaved)

        self.short = tables(scale if spec.short_mscale is None else spec.short_mscale)
        self.long = self.short if spec.long_mscale is None else tables(spec.long_mscale)

    def tables(self, batch: StepBatch) -> RopeTables:
        """The pair a forward step uses: Phi-MoE scales by long_mscale once the step reaches beyond the original
        context (transformers decides by the step's furthest position, as here)."""
        if self.long is self.short or batch.end <= self.spec.original_max_position_embeddings:
            return self.short
        return self.long
