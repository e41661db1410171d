"""PreScope's hot-expert table (§3, §5): (layer, expert) pairs ranked by the tokens they processed while profiling
(ties to the lower key), the hottest loaded at start-up (`start_set`; the engine loads it when it is made, the
simulator before the first step) and never evicted while anything else can be. The hot set is the cache less
room for one layer's top-k experts, which rotate least recently used first: PreScope's buffer pool for what is
not hot (Fiddler and KTransformers start the same way). The profile is token counts from a trace (`moetier train
cache-policy --policy static-hot`, saved with the model by moetier/policy_files.py), handed to the policy. Its
priorities are one array made once (ArrayScoredPolicy): a victim is a sort of the residents, not a scan."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from moetier.cache.keys import ExpertKey
from moetier.cache.policies.arrayed import ArrayScoredPolicy
from moetier.cache.policies.context import PolicyContext
from moetier.errors import MoetierError


class StaticHotPolicy(ArrayScoredPolicy):
    name = "static-hot"

    def __init__(self, ctx: PolicyContext, counts: Mapping[ExpertKey, int]) -> None:
        super().__init__(ctx)
        layers = set(ctx.layers)
        foreign = sorted(k for k in counts if k.layer not in layers or not 0 <= k.expert < ctx.num_experts)
        if foreign:  # (a table of another model's routing: its hot set would be experts this one does not have)
            layer, expert = foreign[0]
            raise MoetierError(f"the static-hot table counts expert {expert} of layer {layer}, which this model "
                               f"does not have (MoE layers {list(ctx.layers)}, {ctx.num_experts} experts each): it "
                               f"was trained on another model's trace",
                               hint="train it on a trace of this model: `moetier train cache-policy --policy "
                                    "static-hot --trace DIR --model M`")
        ranked = sorted(counts, key=lambda k: (-counts[k], k))
        self.ranked = tuple(ranked[:max(0, ctx.num_slots - ctx.top_k)])  # hottest first
        self.hot = frozenset(self.ranked)
        self.counts = dict(counts)
        self.static = np.full((len(ctx.layers), ctx.num_experts), -1.0)  # [L, E] `priority`, which never moves
        for key in self.hot:
            self.static[self.row[key.layer], key.expert] = self.counts.get(key, 0)

    def start_set(self) -> tuple[ExpertKey, ...]:
        return self.ranked

    def priority(self, key: ExpertKey) -> float:
        # any cold expert before any hot one; among hot ones (all candidates hot) the least used
        return self.counts.get(key, 0) if key in self.hot else -1.0

    def priorities(self) -> np.ndarray:
        return self.static

