"""The expert budgets the parity tests hold exact mode to: every one from a layer's top-k to every expert resident
with `pytest --every-budget` (a few minutes: README's slow correctness checks), and by default the ones where the
cache's edges are — the fewest slots a layer can run with and the next two, a quarter, a half and three quarters of
the experts, all but one, all — plus two drawn from the rest, seeded by the model's shape so that each family's case
draws its own."""

from __future__ import annotations

import random


def parity_budgets(top_k: int, total: int, every: bool) -> list[int]:
    """Slot counts in [top_k, total], ascending; all of them when `every`."""
    if not 1 <= top_k <= total:
        raise ValueError(f"top_k {top_k} must be in [1, total {total}]")
    if every:
        return list(range(top_k, total + 1))
    edges = {top_k, top_k + 1, top_k + 2, total // 4, total // 2, 3 * total // 4, total - 1, total}
    chosen = {s for s in edges if top_k <= s <= total}
    rest = sorted(set(range(top_k, total + 1)) - chosen)
    chosen |= set(random.Random(f"{top_k}/{total}").sample(rest, min(2, len(rest))))
    return sorted(chosen)
