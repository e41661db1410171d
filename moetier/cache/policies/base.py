"""The eviction-policy contract: plain Python that hears events and names a victim. It never touches a
tensor, a file or a thread, so the real engine and the simulator drive the very same object."""

from __future__ import annotations

from collections.abc import Collection, Container

from moetier.cache.keys import ExpertKey, Precision


class EvictionPolicy:
    """Subclasses override `victim` and whichever events they need; the defaults ignore the event."""

    name = "base"

    def start_set(self) -> tuple[ExpertKey, ...]:
        """Experts to load before the first step, most wanted first (a profiled hot set); none by default."""
        return ()

    def on_sequence_start(self) -> None:
        pass

    def on_route(self, route) -> None:
        """A layer's RouteResult: full scores [T, E], topk_ids [T, k], topk_weights [T, k] (NumPy)."""

    def on_predict(self, predictions) -> None:
        pass

    def on_access(self, key: ExpertKey, precision: Precision, step: int) -> None:
        pass

    def on_admit(self, key: ExpertKey) -> None:
        """`key` is about to enter the cache: the victims named next make room for it."""

    def on_insert(self, key: ExpertKey) -> None:
        pass

    def on_evict(self, key: ExpertKey) -> None:
        pass

    def victim(self, candidates: Container[ExpertKey]) -> ExpertKey:
        """The resident key to evict. `candidates` answers `in` for every evictable key (resident, not pinned)."""
        raise NotImplementedError

    def victim_among(self, keys: Collection[ExpertKey]) -> ExpertKey:
        """`victim` when the candidates are a few keys listed (a prefetch sparing most of the cache): the same
        choice; a policy whose order it can index overrides this to skip walking the rest."""
        return self.victim(frozenset(keys))
