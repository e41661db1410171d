"""The residency's running counts against what its entries say, through any sequence of what the planner does."""

from hypothesis import given, settings
from hypothesis import strategies as st

from moetier.cache.keys import ExpertKey
from moetier.cache.policies import LRUPolicy
from moetier.cache.residency import IN_USE, PREFETCHED, Residency

KEYS = [ExpertKey(layer, e) for layer in range(3) for e in range(4)]
ops = st.lists(st.tuples(st.sampled_from(["admit", "prefetch", "landed", "pin", "unpin", "unpin_all", "drop",
                                          "keep"]), st.sampled_from(KEYS)), max_size=60)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_the_evictable_count_is_the_entries_neither_read_pinned_nor_kept(sequence):
    r = Residency(5 * 100, {"bf16": 100}, LRUPolicy())
    for op, key in sequence:
        if op in ("admit", "prefetch") and key not in r.entries:
            r.admit(key, "bf16", IN_USE if op == "admit" else PREFETCHED)
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
