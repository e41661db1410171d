"""CoMoE's merge arithmetic (Eq. 27–29, 31–33) on hand-made frequencies and similarities."""

import math

import numpy as np
import pytest

from moetier.errors import MoetierError
from moetier.merge.plan import (
    ADAPTIVE,
    FIXED,
    ActivationThreshold,
    AdaptiveRatio,
    FixedRatio,
    LayerMerge,
    activation_frequency,
    choose_principals,
    combined_similarity,
    group,
    normalised_entropy,
    plan_layer,
)


def test_frequency_and_entropy_follow_eq_28_31_32():
    f = activation_frequency(np.array([6, 2, 2, 0]))
    assert f.tolist() == [0.6, 0.2, 0.2, 0.0]
    h = -(0.6 * math.log(0.6) + 2 * 0.2 * math.log(0.2)) / math.log(4)  # the zero share adds nothing
    assert normalised_entropy(f) == pytest.approx(h)
    assert normalised_entropy(np.full(8, 1 / 8)) == pytest.approx(1.0)
    assert normalised_entropy(np.eye(8)[3]) == 0.0
    with pytest.raises(MoetierError, match="calibration text routed no token"):
        activation_frequency(np.zeros(4))


def test_fixed_and_adaptive_counts_are_eq_33_with_the_papers_presets():
    uniform, peaked = np.full(32, 1 / 32), np.eye(32)[0]
    assert [FixedRatio(FIXED[n]).kept(uniform) for n in ("light", "medium", "heavy")] == [24, 16, 8]
    # E' = max(E_min, ⌊E (r_base + Δr H̄)⌋): uniform routing (H̄ = 1) keeps r_base + Δr, one expert used (H̄ = 0) r_base
    assert [AdaptiveRatio(*ADAPTIVE[n]).kept(uniform) for n in ("light", "medium", "heavy")] == [28, 19, 9]
    assert [AdaptiveRatio(*ADAPTIVE[n]).kept(peaked) for n in ("light", "medium", "heavy")] == [19, 12, 6]
    assert AdaptiveRatio(0.2, 0.1, min_experts=10).kept(peaked) == 10
    with pytest.raises(MoetierError):
        FixedRatio(0.0)


def test_principals_are_the_most_frequent_or_those_above_the_threshold():
    f = np.array([0.1, 0.3, 0.1, 0.4, 0.1])
    assert choose_principals(f, kept=2) == [1, 3]
    assert choose_principals(f, kept=3) == [0, 1, 3]  # a tie among 0.1s goes to the lowest id
    assert choose_principals(f, threshold=0.2) == [1, 3]
    assert choose_principals(f, threshold=0.9) == [3]  # none above: the most used one


def test_each_secondary_joins_its_most_similar_principal():
    s = np.array([[1.0, 0.2, 0.9, 0.1],
                  [0.2, 1.0, 0.3, 0.8],
                  [0.9, 0.3, 1.0, 0.3],
                  [0.1, 0.8, 0.3, 1.0]])
    assert group(s, [0, 1]) == [0, 1, 0, 1]
    assert group(s, [1, 3]) == [1, 1, 1, 3]  # expert 2: 0.3 to both, the tie to the lower id
    assert combined_similarity(np.ones((2, 2)), np.zeros((2, 2)), 0.25).tolist() == [[0.25, 0.25], [0.25, 0.25]]


def test_a_layer_keeps_at_least_top_k_and_its_groups_are_consistent():
    counts, s = np.array([9, 1, 0, 0]), np.eye(4)
    m = plan_layer(counts, s, FixedRatio(0.25), top_k=2)  # ⌊0.25·4⌋ = 1 < top-2: two are kept
    assert m.principals == (0, 1) and set(m.group_of) == {0, 1}
    m = plan_layer(counts, s, FixedRatio(1.0), top_k=2)
    assert m.principals == (0, 1, 2, 3) and m.group_of == (0, 1, 2, 3)
    m = plan_layer(counts, s, ActivationThreshold(0.5), top_k=2)  # only one above θ: top-k after all
    assert m.principals == (0, 1)
    assert plan_layer(np.array([5, 3, 1, 1]), s, ActivationThreshold(0.25), top_k=1).principals == (0, 1)
    assert ActivationThreshold(0.25).name == "threshold-0.25"
    assert m.members(0) == [0, 2, 3] and m.members(1) == [1]  # 2 and 3 alike to both (0): the lower id
    with pytest.raises(ValueError):
        LayerMerge((1,), (1, 0), (0.5, 0.5))  # expert 1 maps to 0, which is not a principal
