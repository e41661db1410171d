"""Eviction policies as pure logic on hand-made sequences with known answers."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from moetier.cache.keys import ExpertKey
from moetier.cache.policies import LFUPolicy, LRUPolicy, make_policy
from moetier.errors import MoetierError

A, B, C, D = (ExpertKey(0, i) for i in range(4))


def drive(policy, events):
    for kind, key in events:
        if kind == "insert":
            policy.on_insert(key)
        elif kind == "access":
            policy.on_access(key, "bf16", 0)
        elif kind == "evict":
            policy.on_evict(key)
    return policy


def test_lru_evicts_least_recently_used():
    p = drive(LRUPolicy(), [("insert", A), ("insert", B), ("insert", C), ("access", A), ("access", B)])
    assert p.victim({A, B, C}) == C
    assert p.victim({A, B}) == A  # C pinned: next oldest


def test_lru_textbook_sequence():
    """Capacity 3, references A B C A D: D evicts B (A was used again)."""
    p = drive(LRUPolicy(), [("insert", A), ("access", A), ("insert", B), ("access", B), ("insert", C),
                            ("access", C), ("access", A)])
    assert p.victim({A, B, C}) == B
    p.on_evict(B)
    p.on_insert(D)
    p.on_access(D, "bf16", 1)
    assert p.victim({A, C, D}) == C


@given(st.lists(st.tuples(st.sampled_from(["insert", "access", "evict"]), st.integers(0, 9)), max_size=60),
       st.sets(st.integers(0, 9), min_size=1))
def test_lru_victim_among_a_few_listed_keys_is_the_walks_victim(events, allowed):
    """A prefetch sparing most of the cache lists the keys it may evict: LRU picks from them by stamp, and must pick
    what walking its whole order would."""
    p, present = LRUPolicy(), set()
    for kind, i in events:
        key = ExpertKey(0, i)
        if kind == "insert" and key not in present:
            p.on_insert(key)
            present.add(key)
        elif kind == "access" and key in present:
            p.on_access(key, "bf16", 0)
        elif kind == "evict" and key in present:
            p.on_evict(key)
            present.discard(key)
    keys = [ExpertKey(0, i) for i in allowed if ExpertKey(0, i) in present]
    if not keys:
        with pytest.raises(LookupError):
            p.victim_among(keys)
        return
    assert p.victim_among(keys) == p.victim_among(set(keys)) == p.victim(set(keys))  # (by stamp, or the walk)


def test_lfu_evicts_least_frequent_with_lru_tie_break():
    p = drive(LFUPolicy(), [("insert", A), ("insert", B), ("insert", C),
                            ("access", A), ("access", A), ("access", B), ("access", C)])
    assert p.victim({A, B, C}) == B  # B and C used once; B longer ago
    assert p.victim({A, C}) == C


def test_lfu_counts_survive_eviction():
    """Whole-run LFU: an expert evicted and re-inserted keeps its count."""
    p = drive(LFUPolicy(), [("insert", A), ("access", A), ("access", A), ("access", A), ("evict", A),
                            ("insert", B), ("access", B), ("insert", A)])
    assert p.counts[A] == 3
    assert p.victim({A, B}) == B


def test_lfu_skips_pinned_and_keeps_them():
    p = drive(LFUPolicy(), [("insert", A), ("insert", B), ("access", B)])
    assert p.victim({B}) == B  # A (count 0) is pinned
    assert p.victim({A, B}) == A  # still there after being skipped


def test_victim_with_no_candidate_raises():
    for policy in (LRUPolicy(), LFUPolicy()):
        policy.on_insert(A)
        with pytest.raises(LookupError):
            policy.victim(set())


def test_unknown_policy_is_a_clear_error():
    with pytest.raises(MoetierError, match=r"(?s)unknown eviction policy .mru.*lru"):
        make_policy("mru")
