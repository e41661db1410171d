"""The host thread that issues a GPU's work (a profile's host_issue): its figures checked and read back, a
configuration's mechanism keys, a layer timed by hand with it, and a replay that prices it only where the engine
reads a layer's routing on the host."""

import dataclasses
import json

import numpy as np
import pytest

from moetier.cache.keys import ExpertKey
from moetier.cache.policies import LRUPolicy
from moetier.plan.costs import RunningCosts
from moetier.sim.cost import CostModel
from moetier.sim.host_issue import HostIssue, HostLane, mechanism_keys
from moetier.sim.profile import HardwareProfile, ProfileError
from moetier.sim.replay import simulate
from moetier.sim.shapes import ModelShape
from moetier.trace.format import Trace
from tests.sim.test_executor import PROFILE, machine, route

ISSUE = HostIssue(plan_s=0.5, load_s=0.25, launch_s=10.0, mechanism_s={"precision:hobbit": 1.0})


def test_figures_are_checked():
    with pytest.raises(ValueError, match="must be >= 0"):
        HostIssue(0.0, -1.0, 0.0)
    with pytest.raises(ValueError, match="unknown key policy"):
        HostIssue(0.0, 0.0, 0.0, {"policy": 1.0})
    with pytest.raises(ValueError, match="each must be >= 0"):
        HostIssue(0.0, 0.0, 0.0, {"policy:lru": -1.0})


def test_planning_adds_the_mechanisms_listed_and_nothing_for_others():
    assert ISSUE.planning_s(["policy:lru", "precision:hobbit"]) == 1.5
    assert ISSUE.planning_s(["policy:comoe"]) == 0.5  # (not listed: on-demand LRU's cost)
    doubled = ISSUE.scaled(2.0)
    assert (doubled.plan_s, doubled.load_s, doubled.launch_s, dict(doubled.mechanism_s)) == \
        (1.0, 0.5, 20.0, {"precision:hobbit": 2.0})


def test_a_configurations_keys():
    assert mechanism_keys("lru") == ("policy:lru",)
    assert mechanism_keys("comoe", "hobbit", "stacked-gates", "hobbit", "smoe", "greedy") == (
        "policy:comoe", "prefetch:hobbit", "predictor:stacked-gates", "precision:hobbit", "substitution",
        "placement:greedy")
    assert mechanism_keys("lru", substitution="similar") == ("policy:lru", "substitution:similar")
    keys = mechanism_keys("lru", "presched", "oracle", "low-tier")  # (each one a profile may price)
    assert set(HostIssue(0, 0, 0, dict.fromkeys(keys, 1.0)).mechanism_s) == set(keys)


def test_a_profile_reads_back_its_host_issue_and_refuses_a_bad_one(tmp_path):
    profile = dataclasses.replace(PROFILE, host_issue=ISSUE)
    profile.save(tmp_path / "p.json")
    assert HardwareProfile.load(tmp_path / "p.json").host_issue == ISSUE
    assert "host_issue" not in PROFILE.to_json()  # (a profile without one writes none)
    d = json.loads((tmp_path / "p.json").read_text())
    d["host_issue"]["mechanism_s"] = {"prefetch": 1.0}
    (tmp_path / "bad.json").write_text(json.dumps(d))
    with pytest.raises(ProfileError, match="unknown key prefetch"):
        HardwareProfile.load(tmp_path / "bad.json")
    del d["host_issue"]["load_s"]
    (tmp_path / "bad.json").write_text(json.dumps(d))
    with pytest.raises(ProfileError, match="missing field host_issue.load_s"):
        HardwareProfile.load(tmp_path / "bad.json")


def test_a_routed_layer_queues_its_copies_after_planning_and_ends_with_the_hosts_work():
    """test_executor's first layer (dense 0-2 s, hits 0 and 1, reads of 2 and 3 at 3 s each on one link), the host
    priced: it plans 0.5 s, queues a copy each 0.25 s (2.75 and 3.0), launches for 10 s after the last."""
    ex, _, _ = machine(4, 300, resident=[ExpertKey(0, 0), ExpertKey(0, 1)])
    ex.lane = HostLane.of(ISSUE, ["policy:lru"])
    plan, tl = ex.layer(route(0, [[0, 1], [2, 3]]), tokens=2)
    assert [(k.expert, s, e) for k, s, e in tl.reads] == [(2, 2.75, 5.75), (3, 5.75, 8.75)]
    assert [c[:3] for c in tl.computes] == [(0, 2.0, 3.0), (1, 3.0, 4.0), (2, 5.75, 6.75), (3, 8.75, 9.75)]
    assert tl.end == ex.now == 3.0 + 10.0  # the host's work outlasts the device's (9.75)


def test_a_layer_whose_routing_stays_on_the_device_costs_the_host_nothing():
    ex, _, _ = machine(4, 300, resident=[ExpertKey(0, 0), ExpertKey(0, 1)])
    ex.lane, ex.routed = HostLane.of(ISSUE, ["policy:lru"]), False
    _, tl = ex.layer(route(0, [[0, 1], [2, 3]]), tokens=2)
    assert [(k.expert, s, e) for k, s, e in tl.reads] == [(2, 2.0, 5.0), (3, 5.0, 8.0)] and tl.end == 9.0


E, LAYERS = 8, (0, 1, 2, 3)
SHAPE = ModelShape("unit4", hidden_size=8, num_layers=4, moe_layers=LAYERS, num_experts=E, top_k=2,
                   moe_intermediate_size=16, attention_params=256, kv_per_token=16, vocab_size=32)


def trace(tokens: int = 12) -> Trace:
    rng = np.random.default_rng(3)
    ids = np.stack([[rng.choice(E, 2, replace=False) for _ in LAYERS] for _ in range(tokens)]).astype(np.int16)
    pos = np.arange(tokens, dtype=np.int32)
    return Trace("m", len(LAYERS), E, 2, list(LAYERS), np.zeros(tokens, np.int32), pos,
                 (pos >= 4).astype(np.uint8), ids, np.full(ids.shape, 0.5, np.float16))


def steps(slots: int, issue: HostIssue | None, preload: bool = False) -> list[float]:
    cost = CostModel.of(dataclasses.replace(PROFILE, host_issue=issue), SHAPE, "bf16", 300)
    return simulate(trace(), LRUPolicy(), slots, cost, "bf16", preload=preload).step_time_s


def test_a_replay_prices_the_host_only_where_the_engine_reads_routing():
    """Every expert resident with nothing but the on-demand plan (engine/resident_layers.py): no layer waits on the
    host. A cache short of the model: every layer does, loads or not (a mechanism's cost named for the policy)."""
    whole = len(LAYERS) * E
    assert steps(whole, ISSUE, preload=True) == steps(whole, None, preload=True)
    slow = HostIssue(0.0, 0.0, 0.0, {"policy:lru": 5.0})
    short, plain = steps(4, slow), steps(4, None)
    assert all(a >= b + 5.0 * len(LAYERS) - 1e-9 for a, b in zip(short, plain))


def test_the_stages_hear_a_dense_part_as_the_engines_clock_reads_it():
    """ExpertExecutor times a layer's dense part from the host's end of the layer before to this one's routing on the
    host, so what the device still had queued is in it (PreSched weighs its prefetches by it): the host done with
    layer 0 at 3.0 s (copies queued 2.75, 3.0; no launches), the device at 9.75; layer 1's routing at 9.75 + 2 s."""
    light = HostIssue(plan_s=0.5, load_s=0.25, launch_s=0.0)
    heard = []
    for lane in (HostLane.of(light, ["policy:lru"]), None):
        ex, _, _ = machine(4, 300, resident=[ExpertKey(0, 0), ExpertKey(0, 1)])
        ex.lane, ex.costs = lane, RunningCosts(300, smoothing=1.0)
        _, first = ex.layer(route(0, [[0, 1], [2, 3]]), tokens=2)
        _, second = ex.layer(route(1, [[0, 1]]), tokens=1)
        heard.append((first.end, second.dense_end, ex.costs.dense_s))
        ex.layer(route(0, [[0, 1]], step=2), tokens=1)  # (a step's first layer: the head and more in its gap)
        heard.append(ex.costs.dense_s)
    assert heard[:2] == [(9.75, 11.75, 11.75 - 3.0), 2.0]
    assert heard[2:] == [(9.0, 11.0, 2.0), 2.0]  # (no host priced: the device's dense part, as before)
