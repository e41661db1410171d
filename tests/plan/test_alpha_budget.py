"""α under a TPOT budget (SMoE §V-C, Eq. 5) as pure logic on made-up measurements."""

import pytest

from moetier.plan.alpha_budget import choose_alpha, fit_tpot


def linear(alpha):  # T(α) = 100 ms − 50 ms·α: the paper's Fig. 10 shape
    return 0.100 - 0.050 * alpha


def test_the_smallest_alpha_that_meets_the_budget_is_chosen():
    seen = []
    choice = choose_alpha(lambda a: seen.append(a) or linear(a), 0.085)
    assert seen == [0.0, 0.15, 0.3, 0.45, 0.6]  # measured once at each calibration point
    assert choice.met and choice.alpha == pytest.approx(0.3)  # 100 − 50·0.3 = 85
    assert choice.predicted_s <= 0.085 and "alpha 0.30" in choice.describe()


def test_a_loose_budget_needs_no_substitution():
    assert choose_alpha(linear, 0.2).alpha == 0.0


def test_a_budget_out_of_reach_says_by_how_much():
    choice = choose_alpha(linear, 0.05)
    assert not choice.met and choice.alpha == pytest.approx(0.6)
    assert choice.predicted_s == pytest.approx(0.070)
    assert "cannot be met" in choice.describe() and "20.0 ms (40%) over" in choice.describe()


def test_the_fit_follows_the_points_and_its_degree_is_what_they_carry():
    assert fit_tpot([0, 1], [2, 4]).tolist() == pytest.approx([2, 2])  # two points: a line
    quad = fit_tpot([0, 1, 2, 3], [1, 2, 5, 10])  # 1 + α²
    assert quad.tolist() == pytest.approx([1, 0, 1], abs=1e-9)
    with pytest.raises(ValueError, match="positive"):
        choose_alpha(linear, 0)
