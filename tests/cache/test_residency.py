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
