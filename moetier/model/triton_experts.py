"""A layer's SwiGLU experts on a GPU in two Triton launches — gate and up together with the SiLU and the product,
then down with the routing weight — for bf16 slots, for int8/int4/int2 ones computed from their codes, and for
GGML's Q8_0/Q4_K/Q5_K/Q6_K/MXFP4 blocks and the legacy Q4_0/Q4_1/Q5_0/Q5_1 (a GGUF's experts: `TritonGgmlExperts`);
and gpt-oss's clamped SwiGLU experts with their biases (`Clamp`) at each of those precisions.

Why: through torch's ops a bf16 expert is six launches (two products, the SiLU, the product of halves, the
weighting, the copy out) and a quantized one ~20 (unpack, subtract, scale, shift, cast before each product); on the
H200 a launch costs 10–24 us, one OLMoE-shaped expert 86 us in bf16 and 656 us from int4 codes (bench/gpu/micro.py),
and a decode step on OLMoE-1B-7B made ~1,700 launches (bench/gpu/results/2026-11-27-h200/profile-olmoe.json). Here
the experts of a layer are one table of their slots' addresses (the slots are wherever the cache put them) and two
launches compute them all (moetier/model/triton_kernels.py). Each program rounds to bf16 where the reference's ops
round (moetier/quant/codes.py `dequantize` for codes) and sums its products in fp32 with `tl.dot` — the same
values as torch's ops up to the order of the sums. The tokens of an expert are padded to a tile of MAX_TOKENS rows;
an expert with more (a prefill's) goes to `fallback`, torch's ops.

With every expert resident (ResidentLayers) a decode token is computed from the router's outputs on the device —
`token_routed` with the layer's table on the GPU — so nothing waits for the host: no read of the routing back to
it, and the token's outputs summed on the device in fp32 (rounded once, where ExpertGroups adds them in bf16 one by
one; on a GPU that index_add_ adds in no fixed order anyway).

Codes as the store holds them: int8 symmetric per row (w = q·s); int4 and int2 grouped, asymmetric around the
middle code (w = (q − mid)·s + z per group of 128 or 64 inputs), two or four codes a byte, the lowest bits first."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from moetier.model.expert_kernels import OneByOne, TokenTable

MAX_TOKENS = 16  # rows of the tl.dot tile: an expert's tokens in one program (more: `fallback`)


@dataclass(frozen=True)
class Tiles:
    """A program's block: `n` output rows (16: tl.dot's least; more programs for a GPU's 132 SMs), `k` inputs a step
    reads. Untuned: bench/gpu/micro.py times a few on the GPU it runs on."""

    n: int = 16
    k: int = 64

    def __post_init__(self) -> None:
        for name, v in (("n", self.n), ("k", self.k)):
            if v < 16 or v & (v - 1):
                raise ValueError(f"a tile's {name} is a power of two of at least 16, not {v}")

    def fit(self, w: dict[str, torch.Tensor]) -> bool:
        """Whether they tile the expert: hidden and intermediate sizes multiples of both."""
        h, i = w["down_proj"].shape[0], _intermediate(w)
        return all(d % t == 0 for d in (h, i) for t in (self.n, self.k))


@dataclass(frozen=True)
class Clamp:
    """gpt-oss's activation (moetier/model/expert_kernels.py ClampedSwigluExpert): gate ≤ limit, |up| ≤ limit,
    (up + 1)·gate·sigmoid(alpha·gate), each matrix with its bias."""

    alpha: float
    limit: float

    def __post_init__(self) -> None:
        if not (self.alpha > 0 and self.limit > 0):
            raise ValueError(f"a clamped SwiGLU's alpha and limit are positive, not {self.alpha}, {self.limit}")


NAMES = ("gate_up_proj", "gate_up_proj.scales", "gate_up_proj.zeros", "down_proj", "down_proj.scales",
         "down_proj.zeros", "gate_up_proj.bias", "down_proj.bias")  # a table row's eight addresses, in order (a bf16
# expert's: its two matrices'; a SwiGLU expert's biases: stand-ins)
BIASES = NAMES[6:]
BIAS_BITS = {torch.bfloat16: 16, torch.float32: 32}  # the kernels' BIAS for the biases' dtype


def _kernels():
    """The two kernels (moetier/model/triton_kernels.py, which imports triton: only where a GPU run asks for them)."""
    from moetier.model.triton_kernels import down, gate_up

    return gate_up, down


def addresses(w: dict[str, torch.Tensor]) -> list[int]:
    """A slot's eight table addresses (NAMES; a tensor it lacks — bf16's scales, int8's zeros, SwiGLU's biases —
    stands in as the matrix's own address, never read)."""
    gu, dn = w["gate_up_proj"], w["down_proj"]
    return [t.data_ptr() for t in (gu, w.get("gate_up_proj.scales", gu), w.get("gate_up_proj.zeros", gu), dn,
                                   w.get("down_proj.scales", dn), w.get("down_proj.zeros", dn),
                                   w.get("gate_up_proj.bias", gu), w.get("down_proj.bias", dn))]


class TritonExperts(OneByOne):
    """`kernel(out, x, w, weights)`, `layer`, `token_table`/`token_routed` for SwiGLU experts on a GPU
    (moetier.model.expert_kernels' interface), `bits` 16 for bf16 slots, else the codes' bits; `clamp`: gpt-oss's
    clamped SwiGLU with biases (None: SwiGLU). `fallback` (torch's ops) takes what these kernels do not: more than
    MAX_TOKENS tokens an expert, shapes the blocks do not tile, activations not in bf16, biases not in bf16 or fp32.
    A pool's slots share one layout, so the first expert's shape stands for a call's."""

    routed_tokens = 8  # a decode step's tokens `token_routed` takes (a server's batch; more: grouped on the host)

    def __init__(self, bits: int, fallback, tiles: Tiles = Tiles(), clamp: Clamp | None = None) -> None:
        self.bits, self.fallback, self.tiles, self.clamp = bits, fallback, tiles, clamp
        self._made = None
        self._h = torch.empty(0)  # [P, I] bf16 between the two kernels, grown to the largest seen
        self._ys = torch.empty(0)  # [T·k, H] routed tokens' expert outputs, before they are summed
        # the buffers these replaced, never freed: a CUDA graph captured on one (moetier/model/decode_graphs.py)
        # writes it at every replay, and memory handed back would be handed out again to another tensor
        self._superseded: list[torch.Tensor] = []
        self._routed: dict[tuple[int, int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}  # (tokens, k,
        # device) -> rows, spans of routed tokens' pairs

    def with_tiles(self, tiles: Tiles) -> TritonExperts:
        """The same kernels at another tile (bench/gpu/micro.py times a few)."""
        return TritonExperts(self.bits, self.fallback, tiles, self.clamp)

    def _fits(self, x: torch.Tensor, w: dict[str, torch.Tensor]) -> bool:
        return x.dtype == torch.bfloat16 and x.device == w["down_proj"].device and self._takes(w)

    def _takes(self, w: dict[str, torch.Tensor]) -> bool:
        """Whether the kernels compute an expert of this layout: the blocks tile it, its format is theirs, and a
        clamped one's biases are there, contiguous, in bf16 or fp32 alike."""
        return self.tiles.fit(w) and self._formats(w) is not None and (self.clamp is None or _bias_bits(w) > 0)

    def _formats(self, w: dict[str, torch.Tensor]) -> tuple[int, int] | None:
        """The kernels' FMT for gate_up_proj and down_proj: 0, codes of `bits` (None: one these kernels lack)."""
        return 0, 0

    def __call__(self, out: torch.Tensor, x: torch.Tensor, w: dict[str, torch.Tensor], weights: torch.Tensor) -> None:
        if x.shape[0] > MAX_TOKENS or not self._fits(x, w):
            return self.fallback(out, x, w, weights)
        self._launch(out, x, weights, [w], [(0, x.shape[0])])

    def layer(self, ys: torch.Tensor, xs: torch.Tensor, weights: torch.Tensor, items) -> None:
        """Rows a:b of ys [P, H] for each (w, a, b): the experts of at most MAX_TOKENS rows in one launch pair, the
        others through `fallback` one by one."""
        if not items or not self._fits(xs, items[0][0]):
            return self.fallback.layer(ys, xs, weights, items)
        fused = [(w, a, b) for w, a, b in items if b - a <= MAX_TOKENS]
        for w, a, b in items:
            if b - a > MAX_TOKENS:
                self.fallback(ys[a:b], xs[a:b], w, weights[a:b])
        if fused:
            self._launch(ys, xs, weights, [w for w, _, _ in fused], [(a, b) for _, a, b in fused])

    def _launch(self, ys: torch.Tensor, xs: torch.Tensor, weights: torch.Tensor, ws: list[dict[str, torch.Tensor]],
                spans: list[tuple[int, int]]) -> None:
        """ys rows of each span = its expert (ws) on the same rows of xs, weighted: one host-to-device copy of the
        addresses, the spans and the rows (pinned, so it is queued, not waited for), then the two kernels."""
        g, p, t = len(ws), xs.shape[0], len(ws) * len(NAMES)
        host = np.empty(t + g * 2 + p + g, dtype=np.int64)  # table [G, 8], spans [G, 2], x rows [P], experts [G]
        host[:t] = [a for w in ws for a in addresses(w)]
        host[t:t + g * 2] = np.asarray(spans, dtype=np.int64).ravel()
        host[t + g * 2:t + g * 2 + p] = np.arange(p)
        host[t + g * 2 + p:] = np.arange(g)
        dev = torch.from_numpy(host)
        if xs.is_cuda:
            dev = dev.pin_memory().to(xs.device, non_blocking=True)
        table, spans_d, rows, experts = dev[:t], dev[t:t + g * 2], dev[t + g * 2:t + g * 2 + p], dev[t + g * 2 + p:]
        self._run(ys, xs, weights, ws[0], table, experts, spans_d, rows, g)

    def _run(self, ys: torch.Tensor, x: torch.Tensor, weights: torch.Tensor, w0: dict[str, torch.Tensor],
             table: torch.Tensor, experts: torch.Tensor, spans: torch.Tensor, rows: torch.Tensor, g: int) -> None:
        """The two kernels over `g` groups: pair row r reads x row rows[r], writes ys row r; `w0` any of the
        experts (their shared layout's strides and groups)."""
        if self._made is None:
            self._made = _kernels()
        gate_up, down = self._made
        gu, dn = w0["gate_up_proj"], w0["down_proj"]
        hidden, i = x.shape[1], _intermediate(w0)
        p = ys.shape[0]
        if self._h.numel() < p * i or self._h.device != x.device:
            self._superseded.append(self._h)
            self._h = torch.empty(max(p, MAX_TOKENS) * i, dtype=torch.bfloat16, device=x.device)
        h = self._h[:p * i].view(p, i)
        gu_s, dn_s = w0.get("gate_up_proj.scales", gu), w0.get("down_proj.scales", dn)
        bn, bk = self.tiles.n, self.tiles.k
        fmt_gu, fmt_d = self._formats(w0)
        alpha, limit = (1.0, 1.0) if self.clamp is None else (self.clamp.alpha, self.clamp.limit)  # (SwiGLU: unread)
        act, bias = (0, 0) if self.clamp is None else (1, _bias_bits(w0))
        gate_up[(g, i // bn)](x, rows, table, experts, spans, h, hidden, i, x.stride(0), gu.stride(0), _stride(gu_s),
                              h.stride(0), alpha, limit, BITS=self.bits,
                              GROUP=_group(hidden, gu_s, self.bits), BT=MAX_TOKENS, BN=bn, BK=bk, FMT=fmt_gu, ACT=act,
                              BIAS=bias)
        down[(g, hidden // bn)](h, table, experts, spans, weights, ys, i, h.stride(0), dn.stride(0), _stride(dn_s),
                                ys.stride(0), BITS=self.bits, GROUP=_group(i, dn_s, self.bits), BT=MAX_TOKENS, BN=bn,
                                BK=bk, FMT=fmt_d, BIAS=bias)

    def token_table(self, ws: list[dict[str, torch.Tensor]]) -> TokenTable | None:
        """A layer's experts (by id) as a table of their addresses on their device, for `token_routed` (None where
        the blocks do not tile them)."""
        w = ws[0]
        if not self._takes(w):
            return None
        ptrs = np.array([addresses(e) for e in ws], dtype=np.int64)  # [E, 8]
        return TokenTable(ptrs, tuple(w["down_proj"].shape), self.bits, torch.from_numpy(ptrs).to(
            w["down_proj"].device), w)

    def token_routed(self, out: torch.Tensor, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                     table: TokenTable) -> None:
        """Tokens x [T, H] (T <= routed_tokens) through their experts straight from the router's topk_ids/
        topk_weights [T, k] on the device (no read back to the host): each (token, expert) pair one group of one
        row, the T·k outputs [T·k, H], then each token's k summed in fp32, rounded once, into out [T, H] — a
        token's result whatever else is in its batch. A batch's tokens sharing an expert read its weights once each
        (grouping them needs the routing on the host): at batch 8 of OLMoE's top-8 of 64, ~1.5x the bytes of the
        grouped layer, against a host sync and the grouping's Python a layer."""
        t, k = topk_ids.shape
        n = t * k
        key = (t, k, x.device)
        if key not in self._routed:  # pair j: x row j // k, span [j, j + 1)
            spans = torch.stack([torch.arange(n), torch.arange(1, n + 1)], 1).reshape(-1)
            rows = torch.arange(t).repeat_interleave(k)
            self._routed[key] = (rows.to(x.device), spans.to(x.device))
        rows, spans = self._routed[key]
        if self._ys.shape[0] < n or self._ys.shape[1] != x.shape[1] or self._ys.device != x.device:
            self._superseded.append(self._ys)
            self._ys = torch.empty(max(n, self.routed_tokens * k), x.shape[1], dtype=torch.bfloat16,
                                   device=x.device)
        ys = self._ys[:n]
        self._run(ys, x, topk_weights.reshape(-1), table.like, table.device, topk_ids.reshape(-1), spans, rows, n)
        torch.sum(ys.view(t, k, -1), 1, out=out)


# GGML's block formats the kernels compute (triton_kernels.py ggml_block's FMT): the k-quants and q8_0, the legacy
# ones a k-quant file falls back to where a row is not whole 256-blocks (DeepSeek-V2-Lite's and Qwen-MoE's 1,408-wide
# down_proj), and mxfp4 (gpt-oss's GGUFs, with Clamp; a SwiGLU model's mxfp4 copies)
GGML_FORMATS = {"q8_0": 1, "q4_k": 2, "q5_k": 3, "q6_k": 4, "q4_0": 5, "q4_1": 6, "q5_0": 7, "q5_1": 8, "mxfp4": 9}


class TritonGgmlExperts(TritonExperts):
    """TritonExperts for experts in GGML's block formats (a GGUF's read in place, or a store's q4_k/q6_k/q5_k/q8_0
    copies: ggml_experts.py), each matrix's format from its shape as GgmlExpert finds it — gate_up_proj and
    down_proj may differ, and down_proj by layer (a Q4_K_M file). The weights are ggml_blocks.py's `dequantize`'s,
    exactly, multiplied by the activations in fp32 (IEEE, not tf32), as `fallback` (GgmlExpert on torch's ops)
    computes them: the same values up to the order of the sums."""

    def __init__(self, fallback, tiles: Tiles = Tiles(), clamp: Clamp | None = None) -> None:
        super().__init__(0, fallback, tiles, clamp)  # (BITS 0: the slots' bytes read as uint8)
        self._formats_of: dict[tuple, tuple[int, int] | None] = {}  # (the matrices' shapes) -> FMTs

    def with_tiles(self, tiles: Tiles) -> TritonGgmlExperts:
        return TritonGgmlExperts(self.fallback, tiles, self.clamp)

    def _formats(self, w: dict[str, torch.Tensor]) -> tuple[int, int] | None:
        from moetier.quant.precisions import format_of

        gu, dn = w["gate_up_proj"], w["down_proj"]
        key = (tuple(gu.shape), tuple(dn.shape))
        if key not in self._formats_of:  # (once per layout: not a lookup an expert)
            try:
                names = format_of(dn.shape[0], tuple(gu.shape[1:])), format_of(gu.shape[0] // 2, tuple(dn.shape[1:]))
            except ValueError:
                names = ()
            ids = tuple(GGML_FORMATS.get(name) for name in names)
            self._formats_of[key] = ids if len(ids) == 2 and None not in ids else None
        return self._formats_of[key]


def _bias_bits(w: dict[str, torch.Tensor]) -> int:
    """The kernels' BIAS for an expert's two biases: 16 or 32 where both are there, contiguous, in bf16 or fp32
    alike; else 0."""
    biases = [w.get(name) for name in BIASES]
    if any(b is None or not b.is_contiguous() for b in biases) or biases[0].dtype != biases[1].dtype:
        return 0
    return BIAS_BITS.get(biases[0].dtype, 0)


def _intermediate(w: dict[str, torch.Tensor]) -> int:
    """An expert's intermediate size, from its gate_up_proj's rows (packed codes keep rows whole)."""
    return w["gate_up_proj"].shape[0] // 2


def _stride(scales: torch.Tensor) -> int:
    """A scales tensor's row stride (int8's one scale a row: 1; a bf16 expert's stand-in: unread)."""
    return scales.stride(0)


def _group(k: int, scales: torch.Tensor, bits: int) -> int:
    """Inputs per scale (a whole row for int8's one scale a row; bf16: unused)."""
    return k if bits in (8, 16) or scales.dim() == 1 else k // scales.shape[1]
