"""A fixed set of the most used experts from profiling — where Fiddler, KTransformers and PreScope start — is
never evicted while anything else can be: the cache holds the hot set plus room for one layer's experts that
rotate (least recently used first). The profile is use counts from a trace (`moetier train cache-policy
--policy static-hot`, saved with the model), or given."""

from __future__ import annotations

import json
from collections.abc import Mapping

from moetier.cache.keys import ExpertKey
from moetier.cache.policies.context import PolicyContext
from moetier.cache.policies.scored import ScoredPolicy
from moetier.errors import MoetierError


class StaticHotPolicy(ScoredPolicy):
    name = "static-hot"

    def __init__(self, ctx: PolicyContext, counts: Mapping[ExpertKey, int] | None = None) -> None:
        super().__init__(ctx)
        if counts is None:
            counts = load_counts(ctx)
        ranked = sorted(counts, key=lambda k: (-counts[k], k))
        self.hot = frozenset(ranked[:max(0, ctx.num_slots - ctx.top_k)])
        self.counts = dict(counts)

    def priority(self, key: ExpertKey) -> float:
        # any cold expert before any hot one; among hot ones (all candidates hot) the least used
        return self.counts.get(key, 0) if key in self.hot else -1.0


def load_counts(ctx: PolicyContext) -> dict[ExpertKey, int]:
    path = ctx.model_dir / "policies" / "static-hot.json" if ctx.model_dir else None
    if path is None or not path.exists():
        raise MoetierError("static-hot needs a profile of expert use",
                           hint="`moetier train cache-policy --policy static-hot --trace DIR --model M` makes one")
    return {ExpertKey(layer, e): n for layer, e, n in json.loads(path.read_text())["counts"]}
