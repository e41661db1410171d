"""bench/bench_sim_validation.py: the simulator is held to the orders the engine resolves, by hand-made rounds."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from bench_sim_validation import ranking, resolved  # noqa: E402


def row(name: str, real_ms: list[float], sim_ms: float) -> dict:
    return {"model": "m", "budget": "50%", "prefetch": name, "real_tpot_s": sorted(real_ms)[len(real_ms) // 2] / 1e3,
            "sim_tpot_s": sim_ms / 1e3, "runs": [{"real_tpot_s": t / 1e3} for t in real_ms]}


def test_only_pairs_whose_rounds_do_not_overlap_are_resolved_and_fastest_first():
    exact, prefetch, mixed = row("none", [40, 42, 41], 40), row("hobbit", [50, 44, 47], 45), row("mixed", [41, 43, 60], 50)
    pairs = [(a["prefetch"], b["prefetch"]) for a, b in resolved([prefetch, exact, mixed])]
    assert pairs == [("none", "hobbit")]  # mixed overlaps both; exact's slowest (42) is faster than hobbit's fastest


def test_a_simulator_that_swaps_only_unresolved_pairs_keeps_every_resolved_order_but_not_the_whole_ranking():
    # the engine's medians order none < mixed < hobbit, but mixed overlaps both: the simulator's none < hobbit < mixed
    rows = [row("none", [40, 42, 41], 40), row("hobbit", [50, 44, 47], 45), row("mixed", [41, 43, 60], 50)]
    text = ranking(rows)
    assert "same ranking (sim_tpot_s): 0 of 1" in text and "kept: 1 of 1" in text
    swapped = [row("none", [40, 42, 41], 46), row("hobbit", [50, 44, 47], 45), row("mixed", [41, 43, 60], 50)]
    text = ranking(swapped)
    assert "kept: 0 of 1" in text and "not none < hobbit" in text
