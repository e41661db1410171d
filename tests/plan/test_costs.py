"""RunningCosts: what layer steps cost lately (smoothed) and, for calibration, every expert's compute so far."""

import pytest

from moetier.plan.costs import RunningCosts


def test_expert_cost_is_smoothed_and_every_compute_is_totalled():
    costs = RunningCosts(expert_bytes=100, smoothing=0.5)
    for seconds in (1.0, 3.0, 2.0):
        costs.observe_expert(seconds)
    assert costs.expert_s == pytest.approx(0.5 * 2.0 + 0.5 * (0.5 * 3.0 + 0.5 * 1.0))  # EMA: 1, 2, 2
    assert (costs.experts_computed, costs.expert_s_total) == (3, pytest.approx(6.0))  # the mean calibration reads
