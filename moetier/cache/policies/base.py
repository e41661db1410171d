"""The eviction-policy contract: plain Python that hears events and names a victim. It never touches a
tensor, a file or a thread, so the real engine and the simulator drive the very same object."""

from __future__ import annotations

from collections.abc import Collection, Container, Hashable

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

    def on_part(self, key: ExpertKey, part: Hashable) -> None:
        """A split cache's `key` is about to be inserted into its `part` (HOBBIT's sub-cache of a precision, or a
        layer's share): told before `on_insert`, once an insert, so a policy may keep each part's order apart."""

    def on_evict(self, key: ExpertKey) -> None:
        pass

    def victim(self, candidates: Container[ExpertKey]) -> ExpertKey:
        """The resident key to evict. `candidates` answers `in` for every evictable key (resident, not pinned)."""
        raise NotImplementedError

    def victim_among(self, keys: Collection[ExpertKey]) -> ExpertKey:
        """`victim` when the candidates are a few keys listed (a prefetch sparing most of the cache): the same
        choice; a policy whose order it can index overrides this to skip walking the rest."""
        return self.victim(frozenset(keys))

    def victim_in(self, part: Hashable, keys: Collection[ExpertKey]) -> ExpertKey:
        """`victim_among(keys)` where every one of `keys` is of one part of a split cache (`on_part`'s): the same
        choice; a policy that keeps each part's order apart overrides this to walk that part's alone."""
        return self.victim_among(keys)
