"""A planned decode step's dense parts replayed as CUDA graphs, the engine's experts run between them
(`--cuda-graphs` below a 100% expert budget).

Why: where the GPU holds only a share of the experts, each MoE layer's routing is read back to the host to plan the
layer's loads (misses copied, prefetches, precisions, a CPU lane), so the step cannot be one graph
(moetier/model/decode_graphs.py); but what lies between two layers' experts — the residual add and norm, attention
with its rotations and KV writes, the next norm, the router — is the same kernels every step, ~15 launches a layer
on Triton's kernels, each from Python (the H200 run's step was bound by its host: docs/gpu.md). Here each part is
one graph: part 0 from the token's embedding to MoE layer m0's routing, part k from MoE layer m(k-1)'s experts'
output to MoE layer mk's routing (a dense layer between is in it whole), the last from the last MoE layer's output
to the logits. A step replays part k, hands its outputs (the residual, the experts' input, the route) to the
engine's experts as the layer-by-layer step does, copies their output into the buffer part k+1 reads, and so on.

Each part's inputs are the previous part's captured outputs and that one buffer, so a part reads the same memory at
every replay; its attention runs over a bucket of keys as the whole-step graphs' does (their `bucket`), the keys
past each token masked on the device. A number of sequences and a bucket make a chain of parts, captured together
(each warmed up on a side stream, then captured into one memory pool: replayed always in the order captured) the
first time a step needs it, before any is replayed: a capture that fails leaves the step to run layer by layer,
nothing of it done twice. The logits are the layer-by-layer step's up to the order of attention's sums over the
masked keys (exact zeros)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from moetier.model.batch import StepBatch
from moetier.model.kv_cache import KVCache
from moetier.model.rope import RopeTables

Part = tuple[torch.Tensor, ...]  # a part's outputs: (h, x, scores, topk_ids, topk_weights), the last's (logits,)


def failure(e: Exception) -> str:
    """Why a capture failed, in one line (what `off` keeps)."""
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


class PartGraphs:
    def __init__(self, model, capture: Callable, inputs: tuple[torch.Tensor, ...], shortest: int) -> None:
        """`model`: a Transformer; `capture(step, pool)` -> (graph, step's outputs) (CudaGraphCapture; a test's
        stand-in replays eagerly); `inputs`: the whole-step graphs' buffers (token ids, positions, KV rows, each
        sequence's one token) [ROWS] each, filled by the caller each step; `shortest`: the shortest bucket."""
        self.model, self.capture, self.inputs, self.shortest = model, capture, inputs, shortest
        self.moe_layers = [i for i, moe in enumerate(model.is_moe) if moe]
        rows, width = inputs[0].shape[0], model.w["embed_tokens"].shape[1]
        self.delta = torch.zeros(rows, width, dtype=model.dtype, device=model.device)  # [ROWS, H] the experts'
        # output of the MoE layer before, which the next part reads
        self.chains: dict[tuple[int, int, bool], list[tuple[object, Part]]] = {}  # (sequences, keys, all rows) ->
        # each part's graph and outputs, in order
        self.captured = self.replayed = 0  # chains captured, steps replayed
        self.off: str | None = None  # why these graphs were turned off (a capture failed), or None

    def clear(self) -> None:
        self.chains.clear()

    @property
    def status(self) -> dict:
        return {"captured": self.captured, "replayed": self.replayed, "off": self.off}

    def __call__(self, key: tuple[int, int, bool], rows_host: list[int], kv: KVCache,
                 rope: RopeTables) -> torch.Tensor | None:
        """The step's logits [B, V], its dense parts replayed and the engine's experts run between them; None where
        its chain could not be captured (the caller runs the step layer by layer)."""
        if self.off is not None:
            return None
        chain = self.chains.get(key) or self._capture(key, rows_host, kv, rope)
        if chain is None:
            return None
        model, b = self.model, key[0]
        for layer, (graph, (h, x, *route)) in zip(self.moe_layers, chain):
            graph.replay()
            model._h = h  # (what `lookahead` starts from, as in the layer-by-layer step)
            self.delta[:b].copy_(model.experts(layer, x, *route, model.shared_expert(layer, x)))
        graph, (logits,) = chain[-1]
        graph.replay()
        self.replayed += 1
        return logits.clone()  # (the captured one is written again by the next replay)

    def _capture(self, key: tuple[int, int, bool], rows_host: list[int], kv: KVCache,
                 rope: RopeTables) -> list[tuple[object, Part]] | None:
        chain: list[tuple[object, Part]] = []
        pool = self._pool()
        try:
            for part in range(len(self.moe_layers) + 1):
                chain.append(self.capture(self._step(key, rows_host, kv, rope, part, chain), pool))
        except Exception as e:  # noqa: BLE001 - any op that cannot be captured: the step runs layer by layer
            self.off = failure(e)
            self.chains.clear()
            return None
        self.chains[key] = chain
        self.captured += 1
        return chain

    def _pool(self):
        """One memory pool for a chain's graphs (replayed in the order captured, never two at once), so a part's
        scratch is the next one's too; None where there is no CUDA (a stand-in's capture)."""
        return torch.cuda.graph_pool_handle() if torch.cuda.is_available() else None

    def _step(self, key: tuple[int, int, bool], rows_host: list[int], kv: KVCache, rope: RopeTables, part: int,
              chain: list[tuple[object, Part]]) -> Callable[[], Part]:
        """Part `part` of the chain as a function of the buffers and the parts before it (their captured outputs)."""
        model, (b, keys, all_rows) = self.model, key
        token_ids, positions, rows, last = (t[:b] for t in self.inputs)
        first = 0 if part == 0 else self.moe_layers[part - 1] + 1
        end = self.moe_layers[part] if part < len(self.moe_layers) else len(model.layers)  # (MoE layer, or none)

        def step() -> Part:
            # a fresh batch each call: the masks it makes from the positions are made inside the capture, not kept
            # from the warm-up before it (a constant in the graph); its host fields say the attention's fixed length
            batch = StepBatch(token_ids, positions, rows, last, True, rows_host=list(rows_host),
                              lengths_host=[keys] * b, all_rows=all_rows)
            if part == 0:
                h, delta = model.w["embed_tokens"][token_ids], None  # [B, H]
            else:
                h, delta = chain[part - 1][1][0], self.delta[:b]
            for i in range(first, end):  # dense layers whole
                h, x = model.attend(i, h, delta, batch, kv, rope)
                delta = model._mlp(i, x)
            if part == len(self.moe_layers):
                return (model.head(h, delta, batch),)
            h, x = model.attend(end, h, delta, batch, kv, rope)
            return (h, x, *model.route(end, x))

        return step
