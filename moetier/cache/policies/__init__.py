"""Eviction policies by name."""

from __future__ import annotations

from collections.abc import Callable

from moetier.cache.policies.base import EvictionPolicy
from moetier.cache.policies.lfu import LFUPolicy
from moetier.cache.policies.lru import LRUPolicy
from moetier.errors import MoetierError

POLICIES: dict[str, Callable[[], EvictionPolicy]] = {"lru": LRUPolicy, "lfu": LFUPolicy}


def make_policy(name: str) -> EvictionPolicy:
    if name not in POLICIES:
        raise MoetierError(f"unknown eviction policy {name!r}", hint=f"choose one of {', '.join(POLICIES)}")
    return POLICIES[name]()


__all__ = ["POLICIES", "EvictionPolicy", "LFUPolicy", "LRUPolicy", "make_policy"]
