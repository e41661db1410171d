"""CoMoE's resource perception (Eq. 10–12) and decisions (Eq. 17, 18, 34, 35) on hand-made numbers."""

import math

import pytest

from moetier.adapt.monitor import CacheSizing, Choice, Indicator, Switching, offload_priority


def test_the_indicator_is_eq_10_to_12():
    ind = Indicator(smoothing=0.5, window=3)
    assert ind.stability == 1.0  # nothing to judge yet
    assert [ind.observe(r) for r in (10, 20, 20, 40)] == [10, 15, 17.5, 28.75]  # r̂ = α r + (1 − α) r̂
    sigma = math.sqrt(((20 - 28.75) ** 2 + (20 - 28.75) ** 2 + (40 - 28.75) ** 2) / 3)  # the last w = 3 samples
    assert ind.stability == pytest.approx(1 - sigma / 28.75)
    wild = Indicator(0.1, 2)  # r̂ = 10.9, σ ≈ 63
    wild.observe(1)
    wild.observe(100)  # σ larger than the mean: 0, not negative
    assert wild.stability == 0.0
    with pytest.raises(ValueError):
        Indicator(0, 4)


def test_cache_sizing_is_eq_17():
    sizing = CacheSizing(allocation=0.8, risk=0.5)
    # ⌊0.8 · 10 GB / (1 GB · (1 + 0.5 · (1 − 0.6)))⌋ = ⌊8 / 1.2⌋ = 6
    assert sizing.experts(10e9, 10**9, 0.6, total=64) == 6
    assert sizing.experts(10e9, 10**9, 1.0, total=64) == 8  # steady memory: no reserve beyond A_m
    assert sizing.experts(100e9, 10**9, 1.0, total=64) == 64  # at most every expert
    assert sizing.experts(0, 10**9, 1.0, total=64) == 1 and sizing.experts(0, 10**9, 1.0, 64, minimum=8) == 8


def test_offload_priority_is_eq_18():
    assert offload_priority(0.2, 100, 4.0, gamma=0.25) == pytest.approx(0.25 * 0.2 + 0.75 * 25)
    with pytest.raises(ValueError):
        offload_priority(0.2, 100, 0.0)


def test_variant_choice_is_eq_34_and_switching_eq_35():
    lib = [Choice("original", 10, 0.0), Choice("light", 8, -0.01), Choice("heavy", 3, -1.0)]
    s = Switching(weight=1.0, hold=2)
    assert s.best(lib, 9).name == "light" and s.best(lib, 100).name == "original" and s.best(lib, 2) is None
    light, original = lib[1], lib[0]
    # back to the original once memory allows: a gain of 0.01 against a cost of 0.005, after holding 3 > 2 looks
    assert s.should_switch(light, original, 12, switch_cost=0.005, stable_for=3)
    assert not s.should_switch(light, original, 12, switch_cost=0.005, stable_for=2)  # not held long enough
    assert not s.should_switch(light, original, 12, switch_cost=0.02, stable_for=9)  # the gain does not pay
    # the current one no longer fits: left at once for what fits
    assert s.should_switch(light, lib[2], 5, switch_cost=100, stable_for=0)
    assert not s.should_switch(light, light, 9, 0, 9)
