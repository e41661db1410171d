"""The residency's running counts against what its entries say, through any sequence of what the planner does."""

from hypothesis import given, settings
from hypothesis import strategies as st

from moetier.cache.keys import ExpertKey
from moetier.cache.policies import LRUPolicy
from moetier.cache.residency import IN_USE, PREFETCHED, Residency

KEYS = [ExpertKey(layer, e) for layer in range(3) for e in range(4)]
ops = st.lists(st.tuples(st.sampled_from(["admit", "prefetch", "landed", "pin", "unpin", "unpin_all", "drop",
                                          "keep"]), st.sampled_from(KEYS)), max_size=60)


def apply(r: Residency, op: str, key: ExpertKey, precision: str = "bf16") -> None:
    """One of the planner's calls, where it applies (`ops`' names)."""
    if op in ("admit", "prefetch") and key not in r.entries:
        r.admit(key, precision, IN_USE if op == "admit" else PREFETCHED)
    elif op == "landed" and key in r.entries:
        r.landed(key)
    elif op == "pin" and key in r.entries:
        r.pin(key, PREFETCHED)
    elif op == "unpin":
        r.unpin(key, PREFETCHED)
    elif op == "unpin_all":
        r.unpin_all(IN_USE)
    elif op == "drop":
        r.drop(key)
    elif op == "keep" and key in r.entries and not r.entries[key].loading:
        r.keep([key])


@settings(max_examples=200, deadline=None)
@given(ops)
def test_the_evictable_count_is_the_entries_neither_read_pinned_nor_kept(sequence):
    r = Residency(5 * 100, {"bf16": 100}, LRUPolicy())
    for op, key in sequence:
        apply(r, op, key)
        assert r.evictable == sum(not e.held for e in r.entries.values())


def test_a_per_layer_split_deals_out_every_whole_entry():
    """Ten entries over four layers are 3, 3, 2, 2 — the first layers in execution order taking the one more (a
    share of the bytes floored to whole entries gave 2 each, leaving 2 of the 10 unused); each layer fills its own
    part, evicting only its own; a resize deals them out again."""
    layers = (2, 0, 1, 3)  # execution order
    r = Residency(10 * 100, {"bf16": 100}, LRUPolicy(), layers=layers)
    assert [r.part_capacity(layer) for layer in layers] == [300, 300, 200, 200]
    for layer in layers:
        for e in range(4):
            r.admit(ExpertKey(layer, e), "bf16")
            r.landed(ExpertKey(layer, e))
            r.unpin(ExpertKey(layer, e), IN_USE)
    assert r.used_bytes == 1000
    assert [sum(k.layer == layer for k in r.entries) for layer in layers] == [3, 3, 2, 2]
    evicted = r.resize(7 * 100)
    assert [r.part_capacity(layer) for layer in layers] == [200, 200, 200, 100]
    assert sorted(k.layer for k in evicted) == [0, 2, 3]


def test_a_per_layer_split_leaves_less_than_an_entry_to_the_smaller_precisions():
    """With two precisions the largest entry is the unit dealt out; the bytes below one split evenly."""
    r = Residency(5 * 100 + 80, {"bf16": 100, "int4": 25}, LRUPolicy(), layers=(0, 1))
    assert [r.part_capacity(layer) for layer in (0, 1)] == [340, 240]
    assert sum(r.part_capacity(layer) for layer in (0, 1)) == r.capacity_bytes


class WalkChecked(LRUPolicy):
    """LRU whose `victim_in` (a walk of one part's own order) is held to the walk over the whole order it replaces in
    a split cache."""

    def __init__(self) -> None:
        super().__init__()
        self.residency, self.checked = None, 0

    def victim_in(self, part, keys):
        got = super().victim_in(part, keys)
        r = self.residency
        assert part == r.part_of(got, r.entries[got].precision)
        assert got == self.victim(r._part_evictable[part])  # (the walk, by the view's `in`)
        self.checked += 1
        return got


@settings(max_examples=150, deadline=None)
@given(ops, st.sampled_from(["layers", "shares"]), st.lists(st.sampled_from(["bf16", "int4"]), min_size=60,
                                                            max_size=60))
def test_a_split_cache_keeps_each_parts_evictable_keys_and_evicts_as_the_walk_does(sequence, split, precisions):
    """A part's victim is chosen among its evictable keys, kept as entries are held and let go (a walk over every
    part's entries took a third of a HOBBIT layer's host time): at every step those sets are what the parts' views
    answer, and each victim is the one the walk finds."""
    policy = WalkChecked()
    kwargs = {"layers": (0, 1, 2)} if split == "layers" else {"shares": {"bf16": 0.6, "int4": 0.4}}
    r = Residency(6 * 100, {"bf16": 100, "int4": 25}, policy, **kwargs)
    policy.residency = r
    for (op, key), precision in zip(sequence, precisions):
        apply(r, op, key, precision)
        if op == "unpin":  # (a landed entry let go of its layer's pin too: evictable, so victims have candidates)
            r.unpin(key, IN_USE)
        for part in r.parts:
            assert r._part_evictable_keys[part] == {k for k in r.entries if k in r._part_evictable[part]}


def test_a_split_cache_picks_a_parts_victim_among_its_own_keys():
    """HOBBIT's sub-caches: the high part's victim is found without walking the low part's older entries."""
    policy = WalkChecked()
    r = Residency(2 * 100 + 8 * 25, {"bf16": 100, "int4": 25}, policy, shares={"bf16": 0.5, "int4": 0.5})
    policy.residency = r
    for key, precision in [*((ExpertKey(0, e), "int4") for e in range(8)), *((ExpertKey(1, e), "bf16") for e in
                                                                          range(2))]:  # the low entries oldest
        r.admit(key, precision)
        r.landed(key)
        r.unpin_all(IN_USE)
    slot, evicted = r.admit(ExpertKey(1, 2), "bf16")  # a third high entry evicts the first high one
    assert evicted == (ExpertKey(1, 0),) and policy.checked == 1
