"""Eviction policies by name: `make_policy(name, ctx, **params)` makes one for one cache. `ctx` (a
PolicyContext) tells it the cache's slots and layers; the classic policies need none of it."""

from __future__ import annotations

from collections.abc import Callable

from moetier.cache.policies.arc import ARCPolicy
from moetier.cache.policies.base import EvictionPolicy
from moetier.cache.policies.belady import BeladyPolicy
from moetier.cache.policies.comoe import CoMoEPolicy
from moetier.cache.policies.context import PolicyContext
from moetier.cache.policies.flashmoe_ml import FlashMoEMLPolicy
from moetier.cache.policies.fld import FLDPolicy
from moetier.cache.policies.hobbit import HobbitPolicy
from moetier.cache.policies.lecar import LeCaRPolicy
from moetier.cache.policies.lfu import LFUPolicy
from moetier.cache.policies.lfu_seq import LFUSeqPolicy
from moetier.cache.policies.lhu import LHUPolicy
from moetier.cache.policies.lru import LRUPolicy
from moetier.cache.policies.predicted import SUFFIX, PredictedPolicy
from moetier.cache.policies.smoe_score import SMoEScorePolicy
from moetier.cache.policies.static_hot import StaticHotPolicy
from moetier.errors import MoetierError

CONTEXT_FREE = {"lru": LRUPolicy, "lfu": LFUPolicy, "lfu-seq": LFUSeqPolicy}
POLICIES: dict[str, Callable[..., EvictionPolicy]] = {
    **CONTEXT_FREE, "fld": FLDPolicy, "lhu": LHUPolicy, "hobbit": HobbitPolicy, "smoe-score": SMoEScorePolicy,
    "comoe": CoMoEPolicy, "arc": ARCPolicy, "lecar": LeCaRPolicy, "flashmoe-ml": FlashMoEMLPolicy,
    "belady": BeladyPolicy, "static-hot": StaticHotPolicy}

# What a run evicts by unless told, in the engine, the server, `eval` and the simulator alike: CoMoE's Eq. 38. LRU
# keeps nothing once the cache holds fewer experts than a token routes to over its layers, where CoMoE keeps 16-46%
# of them on the traces, and above that cliff CoMoE's hits are LRU's or more in all but one cell (Mixtral at 30%:
# 42.4% against 43.2%); in the engine it decoded faster than LRU at every budget measured, level with every expert
# resident, since its bookkeeping is absorbed only when a victim is chosen (docs/cache-policies.md, "The default").
DEFAULT_POLICY = "comoe"
OFFLINE = ("belady",)  # need the future: the simulator and cache-bench only
LIVE_POLICIES = tuple(name for name in POLICIES if name not in OFFLINE)  # what a live run can use
LEARNED = ("flashmoe-ml", "hobbit", "static-hot")  # read policies/<name>.json, written by `train cache-policy`


def base_name(name: str) -> str:
    """The policy a `NAME+predicted` name wraps (the name itself otherwise)."""
    return name.removesuffix(SUFFIX)


def check_policy(name: str, live: bool = False) -> None:
    """Refuse an unknown policy name (or, `live`, one that needs the future), saying which there are."""
    known = LIVE_POLICIES if live else tuple(POLICIES)
    if base_name(name) not in known:
        raise MoetierError(f"unknown eviction policy {name!r}" if base_name(name) not in POLICIES else
                           f"{name} is the offline optimum and needs the future: the simulator and cache-bench only",
                           hint=f"one of {', '.join(known)}, each also as NAME{SUFFIX} (needs --predictor)")


def make_policy(name: str, ctx: PolicyContext | None = None, **params) -> EvictionPolicy:
    """Policy `name` for the cache `ctx` describes; a learned policy needs its trained parameters in `params`
    (moetier/policy_files.py reads them from beside a model), the offline optimum its `future`. `NAME+predicted`
    wraps policy NAME to spare the experts the predictor names (moetier/cache/policies/predicted.py)."""
    if name.endswith(SUFFIX):
        if ctx is None:
            raise ValueError(f"policy {name} needs a PolicyContext")
        return PredictedPolicy(make_policy(base_name(name), ctx, **params), ctx.top_k)
    if name not in POLICIES:
        raise MoetierError(f"unknown eviction policy {name!r}", hint=f"choose one of {', '.join(POLICIES)}")
    if name in CONTEXT_FREE:
        return POLICIES[name](**params)
    if ctx is None:
        raise ValueError(f"policy {name} needs a PolicyContext")
    if name in LEARNED and not params:
        raise MoetierError(f"{name} is a learned policy and was given no trained parameters",
                           hint=f"`moetier train cache-policy --policy {name}` fits them")
    return POLICIES[name](ctx, **params)


__all__ = ["SUFFIX", "base_name", "check_policy", "LEARNED", "LIVE_POLICIES", "OFFLINE", "POLICIES", "EvictionPolicy", "LFUPolicy", "LRUPolicy", "PolicyContext", "make_policy"]
