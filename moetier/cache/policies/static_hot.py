"""A fixed set of the most used experts from profiling — where Fiddler, KTransformers and PreScope start — is
never evicted while anything else can be: the cache holds the hot set plus room for one layer's experts that
rotate (least recently used first). The profile is use counts from a trace (`moetier train cache-policy
--policy static-hot`, saved with the model by moetier/policy_files.py), handed to the policy."""

from __future__ import annotations

from collections.abc import Mapping

from moetier.cache.keys import ExpertKey
from moetier.cache.policies.context import PolicyContext
from moetier.cache.policies.scored import ScoredPolicy


class StaticHotPolicy(ScoredPolicy):
    name = "static-hot"

    def __init__(self, ctx: PolicyContext, counts: Mapping[ExpertKey, int]) -> None:
        super().__init__(ctx)
        ranked = sorted(counts, key=lambda k: (-counts[k], k))
        self.hot = frozenset(ranked[:max(0, ctx.num_slots - ctx.top_k)])
        self.counts = dict(counts)

    def priority(self, key: ExpertKey) -> float:
        # any cold expert before any hot one; among hot ones (all candidates hot) the least used
        return self.counts.get(key, 0) if key in self.hot else -1.0

