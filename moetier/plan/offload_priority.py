"""Which experts leave first when the cache shrinks under memory pressure: CoMoE's offload priority (Eq. 18),
P(e, t) = γ·f_act(e) + (1 − γ)·s_e/L_comm(e), lowest first — the experts least used and cheapest to bring back.

A layer hook (plan/step.py) counts each expert's activations as the run goes: f_act(e) is its share of its layer's
activations over the run (the paper's "activation frequency"; a layer's shares sum to 1, so an expert of a
popular layer and one of a quiet layer weigh alike). L_comm(e) is the time to read it again at the link's measured
rate (plan/costs.py) plus a read's fixed latency, so s_e/L_comm(e) is the rate its read runs at: larger copies
(a high-precision one beside a low) amortise the latency better and stay longer. As printed the two terms are in
different units (a share and bytes per second); each is taken here as a share of its largest value among the
candidates, which keeps γ the weight the paper means it to be (a departure in scale, not in order within a term).

Used only when the cache is resized (Residency.resize's `order`: `--adapt`'s shrinking, simulated pressure); an
eviction on a miss stays the run's policy's. γ = 0.7: the paper gives no value; activation frequency is what the
paper's own prose ranks by ("experts with low usage frequency ... are prioritized for replacement and offloading")."""

from __future__ import annotations

from collections.abc import Callable, Collection

import numpy as np

from moetier.cache.keys import ExpertKey
from moetier.plan.step import LayerHook

GAMMA = 0.7
READ_LATENCY_S = 1e-4  # a read's fixed cost beside its bytes (an NVMe read's ~0.1 ms)


class OffloadPriority(LayerHook):
    def __init__(self, moe_layers: Collection[int], num_experts: int, entry_bytes: Callable[[ExpertKey], int],
                 bandwidth: Callable[[], float | None], gamma: float = GAMMA) -> None:
        """`entry_bytes(key)`: the bytes its cache entry holds; `bandwidth()`: the link's measured bytes/s (None
        before any read was timed: the second term is then the same for every expert)."""
        if not 0.0 <= gamma <= 1.0:
            raise ValueError(f"need 0 <= gamma <= 1, got {gamma}")
        self.gamma, self.entry_bytes, self.bandwidth = gamma, entry_bytes, bandwidth
        self._row = {layer: i for i, layer in enumerate(moe_layers)}
        self.counts = np.zeros((len(self._row), num_experts), dtype=np.int64)  # [L, E] activations

    needs_plans = False  # (the routes are all it counts)

    def on_route(self, route, gate_input) -> None:
        np.add.at(self.counts[self._row[route.layer]], route.topk_ids.ravel(), 1)  # [T, k] (a route has no SKIP)

    def frequency(self, key: ExpertKey) -> float:
        """f_act: the expert's share of its layer's activations so far (0 before any)."""
        row = self.counts[self._row[key.layer]]
        return float(row[key.expert]) / max(1, int(row.sum()))

    def priorities(self, keys: Collection[ExpertKey]) -> dict[ExpertKey, float]:
        """Eq. 18 for each of `keys`, each term scaled to a share of its largest (above)."""
        rate = self.bandwidth() or 1.0
        totals = np.maximum(self.counts.sum(axis=1), 1)  # [L] (once, not once a key)
        f = {k: float(self.counts[self._row[k.layer], k.expert]) / float(totals[self._row[k.layer]]) for k in keys}
        r = {k: self.entry_bytes(k) / (READ_LATENCY_S + self.entry_bytes(k) / rate) for k in keys}  # s/L_comm
        f_top, r_top = max(f.values(), default=0) or 1.0, max(r.values(), default=0) or 1.0
        return {k: self.gamma * f[k] / f_top + (1 - self.gamma) * r[k] / r_top for k in keys}

    def ranked(self, keys: Collection[ExpertKey]) -> list[ExpertKey]:
        """`keys` in the order they leave: lowest priority first (ties: the lower key, so runs agree). A shrink
        ranks its candidates once (Residency.resize), as the priorities stand when it happens."""
        p = self.priorities(keys)
        return sorted(keys, key=lambda k: (p[k], k))

    def victim_among(self, keys: Collection[ExpertKey]) -> ExpertKey:
        """The first of `keys` to leave."""
        return self.ranked(keys)[0]
