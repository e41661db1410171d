"""The parity tests' budgets: the cache's edges always, every budget when asked."""

import pytest

from tests.model.budgets import parity_budgets


@pytest.mark.parametrize("top_k,total", [(1, 1), (2, 3), (2, 8), (2, 24), (4, 48), (8, 1024)])
def test_the_edges_are_always_held_and_every_budget_when_asked(top_k, total):
    chosen = parity_budgets(top_k, total, every=False)
    assert chosen == sorted(set(chosen)) and all(top_k <= s <= total for s in chosen)
    assert {top_k, total} <= set(chosen) and (total - top_k < 2 or {top_k + 1, total - 1} <= set(chosen))
    assert len(chosen) <= 10 and chosen == parity_budgets(top_k, total, every=False)  # (seeded: the same each run)
    assert parity_budgets(top_k, total, every=True) == list(range(top_k, total + 1))


def test_a_top_k_beyond_the_experts_is_refused():
    with pytest.raises(ValueError):
        parity_budgets(5, 4, every=False)
