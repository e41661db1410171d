"""Sampling, one for `generate`, `chat`, the server and the Python API: what each request asks, applied to a
batch's logits at once (tensor ops over the batch; no per-sequence loop over the vocabulary), each row drawn with
its own request's generator, so a request samples the same tokens in any batch as alone.

Per row, in this order (transformers' and vLLM's; llama.cpp applies its temperature last, which changes what top-p
and min-p keep):
1. `logit_bias` (OpenAI): bias[token] added to its logit.
2. `repetition_penalty` p (transformers' and llama.cpp's multiplicative one): every token seen in the last
   `repetition_window` tokens of prompt and output (llama.cpp's `repeat_last_n`; -1: all of them) has its logit
   divided by p if positive, multiplied by p if not.
3. `presence_penalty` and `frequency_penalty` (OpenAI's): logit[j] -= c[j]·frequency + (c[j] > 0)·presence, c[j]
   the times token j occurs in the output so far.
4. temperature 0: the largest logit (greedy; with none of the above, exactly the model's argmax). Otherwise the
   logits over the temperature, softmax, then `top_k` (the k most likely), `top_p` (the smallest set, most likely
   first, whose mass reaches p), `min_p` (tokens at least min_p times as likely as the most likely one), the rest
   renormalised, and one draw u ~ U[0, 1) from the request's generator picks the token by inverse CDF.
A request with no seed draws from fresh randomness (OpenAI: unseeded means different answers each time)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moetier.errors import MoetierError

MAX_SEED = 2**63 - 1  # what torch's and numpy's generators take


def _finite(name: str, value: float, low: float, high: float, low_open: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and (
        low < value if low_open else low <= value) and value <= high
    if not ok:
        span = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise MoetierError(f"{name} must be a finite number in {span}, got {value!r}")


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0 is greedy
    top_p: float = 1.0
    seed: int | None = 0  # None: fresh randomness
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # 0: off
    repetition_penalty: float = 1.0  # 1: off
    repetition_window: int = 64  # tokens of prompt and output the repetition penalty looks at (-1: all)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias)

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool) \
                or self.max_new_tokens < 1:
            raise MoetierError(f"max new tokens (--max-tokens) must be a whole number at least 1, got "
                               f"{self.max_new_tokens!r}")
        _finite("temperature (--temperature)", self.temperature, 0.0, 100.0)
        _finite("top-p (--top-p)", self.top_p, 0.0, 1.0, low_open=True)
        _finite("min-p (--min-p)", self.min_p, 0.0, 1.0)
        _finite("repetition penalty (--repeat-penalty)", self.repetition_penalty, 0.0, 100.0, low_open=True)
        _finite("presence penalty (--presence-penalty)", self.presence_penalty, -2.0, 2.0)
        _finite("frequency penalty (--frequency-penalty)", self.frequency_penalty, -2.0, 2.0)
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise MoetierError(f"top-k (--top-k) must be a whole number >= 0 (0: off), got {self.top_k!r}")
        if not isinstance(self.repetition_window, int) or self.repetition_window < -1:
            raise MoetierError(f"the repetition window (--repeat-last-n) must be -1 (all), 0 (off) or more tokens, "
                               f"got {self.repetition_window!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not 0 <= self.seed <= MAX_SEED):
            raise MoetierError(f"seed must be a whole number in [0, 2^63 - 1], got {self.seed!r}")
        for token, bias in self.logit_bias:
            if not isinstance(token, int) or token < 0:
                raise MoetierError(f"logit_bias: token ids must be whole numbers >= 0, got {token!r}")
            _finite(f"logit_bias[{token}]", bias, -100.0, 100.0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def shaped(self) -> bool:
        """Whether anything changes the logits before the choice (bias or penalties)."""
        return bool(self.logit_bias) or self.presence_penalty != 0 or self.frequency_penalty != 0 or (
            self.repetition_penalty != 1 and self.repetition_window != 0)

    def generator(self, offset: int = 0) -> torch.Generator:
        """A generator for a request: seeded with seed + offset (a batch's i-th prompt, the i-th of n choices), or
        from fresh randomness when there is no seed."""
        g = torch.Generator()
        if self.seed is None:
            g.seed()
        else:
            g.manual_seed((self.seed + offset) % (MAX_SEED + 1))
        return g


def check_vocab(params: SamplingParams, vocab_size: int) -> None:
    """logit_bias names tokens of the model's vocabulary."""
    for token, _ in params.logit_bias:
        if token >= vocab_size:
            raise MoetierError(f"logit_bias names token {token}; the model's vocabulary has {vocab_size} tokens")


def _padded(rows: list[list[int]], device: torch.device) -> torch.Tensor:
    """[B, L] of the rows' ids, -1 past each row's end (L at least 1)."""
    width = max(1, max(len(r) for r in rows))
    return torch.tensor([r + [-1] * (width - len(r)) for r in rows], dtype=torch.long, device=device)


def _occurs(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """ids [B, L] (-1: none) -> counts [B, V] of each token."""
    counts = torch.zeros(ids.shape[0], vocab + 1, dtype=torch.float32, device=ids.device)  # (column V: padding)
    counts.scatter_add_(1, torch.where(ids < 0, vocab, ids), torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab]


def shape_logits(logits: torch.Tensor, params: list[SamplingParams], contexts: list[list[int]],
                 outputs: list[list[int]]) -> torch.Tensor:
    """Steps 1-3 on logits [B, V] (float32, a copy where anything changes): each row's bias and penalties, from its
    context (prompt and output) and its output so far."""
    x = logits.float()
    if not any(p.shaped for p in params):
        return x
    x = x.clone()
    b, v = x.shape
    dev = x.device
    biased = [(i, t, w) for i, p in enumerate(params) for t, w in p.logit_bias]
    if biased:
        rows, cols, vals = zip(*biased)
        x.index_put_((torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)),
                     torch.tensor(vals, dtype=torch.float32, device=dev), accumulate=True)
    rep = [i for i, p in enumerate(params) if p.repetition_penalty != 1 and p.repetition_window != 0]
    if rep:
        windows = [contexts[i] if params[i].repetition_window < 0 else contexts[i][-params[i].repetition_window:]
                   for i in rep]
        seen = _occurs(_padded(windows, dev), v) > 0  # [R, V]
        penalty = torch.tensor([params[i].repetition_penalty for i in rep], device=dev)[:, None]  # [R, 1]
        sub = x[rep]
        x[rep] = torch.where(seen, torch.where(sub > 0, sub / penalty, sub * penalty), sub)
    pf = [i for i, p in enumerate(params) if p.presence_penalty != 0 or p.frequency_penalty != 0]
    if pf:
        counts = _occurs(_padded([outputs[i] for i in pf], dev), v)  # [R, V]
        freq = torch.tensor([params[i].frequency_penalty for i in pf], device=dev)[:, None]
        pres = torch.tensor([params[i].presence_penalty for i in pf], device=dev)[:, None]
        x[pf] = x[pf] - counts * freq - (counts > 0).float() * pres
    return x


def filtered(x: torch.Tensor, params: list[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 4 for rows that sample: shaped logits [B, V] -> (probabilities [B, K], token ids [B, K]), most likely
    first, each row's kept tokens with their renormalised probability and the rest 0. K is the largest top-k where
    every row has one (torch's top-k, not a sort of the vocabulary), else V."""
    b, v = x.shape
    dev = x.device
    temperature = torch.tensor([p.temperature for p in params], device=dev)[:, None]
    probs = torch.softmax(x / temperature, dim=-1)  # [B, V]
    ks = [p.top_k if 0 < p.top_k < v else v for p in params]
    k = max(ks)
    probs, ids = torch.topk(probs, k, dim=-1) if k < v else torch.sort(probs, dim=-1, descending=True)
    rank = torch.arange(probs.shape[1], device=dev)[None, :]
    keep = rank < torch.tensor(ks, device=dev)[:, None]  # top-k
    top_p = torch.tensor([p.top_p for p in params], device=dev)[:, None]
    mass_before = torch.cumsum(probs, dim=-1) - probs  # what the more likely tokens hold
    keep &= (mass_before < top_p) | (top_p >= 1)  # top-p: the smallest set reaching p (the first token always)
    min_p = torch.tensor([p.min_p for p in params], device=dev)[:, None]
    keep &= probs >= min_p * probs[:, :1]  # min-p, against the most likely (kept: it is the first)
    probs = torch.where(keep, probs, torch.zeros_like(probs))
    return probs / probs.sum(dim=-1, keepdim=True), ids


def draw(probs: torch.Tensor, ids: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse CDF: for each row the first kept token whose cumulative probability passes u [B] in [0, 1)."""
    cdf = torch.cumsum(probs, dim=-1)
    at = torch.searchsorted(cdf, (u * cdf[:, -1]).to(cdf.dtype)[:, None], right=True)  # [B, 1]
    at = torch.minimum(at, (probs > 0).sum(dim=-1, keepdim=True) - 1)  # (rounding at the top: the last kept)
    return ids.gather(1, at)[:, 0]


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator],
           contexts: list[list[int]] | None = None, outputs: list[list[int]] | None = None) -> list[int]:
    """logits [B, V] -> one token id per row (a host sync: the ids go back to the host). `contexts`, `outputs`:
    each row's prompt and output so far, and its output (what the penalties look at)."""
    if all(p.greedy and not p.shaped for p in params):  # (fp32 argmax: exactly the model's choice; bf16's was ~3x
        return logits.float().argmax(dim=-1).tolist()  # slower for a 50k-word row; both take the first maximum)
    empty = [[] for _ in params]
    x = shape_logits(logits, params, contexts or empty, outputs or empty)
    tokens = x.argmax(dim=-1)  # [B]: the greedy rows' choice
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        u = torch.tensor([torch.rand(1, generator=generators[i]).item() for i in rows], device=x.device)
        probs, ids = filtered(x[rows], [params[i] for i in rows])
        tokens[rows] = draw(probs, ids, u)
    return tokens.tolist()
