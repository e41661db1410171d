"""Placement stages (SMoE Alg. 2, PreScope's PreSched Eq. 4–5, HOBBIT's cooperative mode) as pure logic on
hand-made plans and costs."""

import numpy as np
import pytest

from moetier.errors import MoetierError
from moetier.plan.costs import RunningCosts
from moetier.plan.layer_plan import FAST, HOST, IN_PLACE, RESIDENT, LayerPlan
from moetier.plan.on_demand import OnDemandStage
from moetier.plan.placement import (
    CpuOffload,
    GreedyPlacement,
    HobbitCoop,
    PreSchedPlacement,
    SMoETwoPointer,
    make_placement,
)
from moetier.plan.route import DECODE, PREFILL, RouteResult
from tests.handmade_plan import resident as cache

E = 8


def costs(read_s=1.0, expert_s=0.1, dense_s=0.2, host=((1, 0.5),)):
    """Running costs with one expert's read `read_s` (100 bytes at 100 B/s), and host computes (tokens, seconds)."""
    c = RunningCosts(100)
    c.observe_read(100, read_s)
    c.observe_dense(dense_s)
    c.observe_expert(expert_s)
    for m, s in host:
        c.observe_host(m, s)
    return c


def plan(ids, weights, phase=DECODE, predictions=None):
    ids = np.asarray(ids, np.int64)
    weights = np.asarray(weights, np.float32)
    p = LayerPlan.exact(RouteResult(0, 1, ids, weights, np.zeros((len(ids), E), np.float32), phase), "bf16")
    p.predictions = predictions or {}
    return p


def hosted(p):
    return sorted(e for e, place in p.place.items() if place == HOST)


def test_host_costs_fit_beta_m_plus_c():
    c = costs(host=((1, 0.5), (3, 0.9), (5, 1.3)))  # t_c = 0.2·m + 0.3
    assert c.host_s(10) == pytest.approx(2.3)
    assert costs(host=((2, 0.4), (2, 0.6))).host_s(7) == pytest.approx(0.5)  # one token count: flat
    assert not RunningCosts(100).placement_ready


def test_two_pointer_balances_load_and_cpu_time_loading_the_high_scores():
    # four misses, scores 0.4 > 0.3 > 0.2 > 0.1; C_load 1.0, C_cpu 0.5: load, cpu, cpu, load? — Alg. 2:
    # T_load 0 <= T_cpu 0: load 0.4 (1.0); 1.0 > 0: cpu 0.1 (0.5); 1.0 > 0.5: cpu 0.2 (1.0); 1.0 <= 1.0: load 0.3
    p = SMoETwoPointer(cache(), costs())(plan([[1, 2, 3, 4]], [[0.4, 0.3, 0.2, 0.1]]))
    assert hosted(p) == [3, 4]
    p = OnDemandStage(cache())(p)
    assert [(r.expert, r.source, r.place) for r in p.runs if r.place == HOST] == [(3, IN_PLACE, HOST),
                                                                                 (4, IN_PLACE, HOST)]
    assert [ld.expert for ld in p.loads] == [1, 2]  # no slot, no read for the host's


def test_a_resident_expert_is_never_placed_and_nothing_is_placed_before_costs_are_known():
    p = SMoETwoPointer(cache(1, 2), costs())(plan([[1, 2, 3, 4]], [[0.4, 0.3, 0.2, 0.1]]))
    assert hosted(p) == [4]  # misses 3 (load: 0 <= 0), then 4 (cpu)
    p = OnDemandStage(cache(1, 2))(p)
    assert [r.source for r in p.runs] == [RESIDENT, RESIDENT, IN_PLACE, "load"]  # host work before reads
    assert hosted(SMoETwoPointer(cache(), RunningCosts(100))(plan([[1, 2]], [[0.5, 0.5]]))) == []


def test_greedy_is_equation_5_on_the_layer_alone():
    # misses 5 (1 token), 6 (2), 7 (2), ascending; t_io 1.0, t_g 0.1, t_c(m) = 0.6·m: the CPU cost of each prefix
    # 0, 0.6, 1.8; T_G(i) = (3 − i)·1.0 + 0.1 = 3.1, 2.1, 1.1 — first T_G < T_C at i = 2: 5 and 6 on the CPU
    ids = [[5, 6], [6, 7], [7, 0]]
    c = costs(host=((1, 0.6), (2, 1.2)))
    assert hosted(GreedyPlacement(cache(0), c)(plan(ids, np.full((3, 2), 0.5)))) == [5, 6]
    # a cheap link loads all but the smallest, which the CPU computes while the reads run (T_C(0) = 0: Eq. 5 never
    # loads the whole layer)
    cheap = costs(read_s=0.01, host=((1, 0.6), (2, 1.2)))
    assert hosted(GreedyPlacement(cache(0), cheap)(plan(ids, np.full((3, 2), 0.5)))) == [5]


def test_presched_leaves_the_link_to_the_next_layer_where_that_pays():
    # t_io 1.0, t_g 0.1, t_attn 0.2, t_c flat 1.0. One current miss, 3 (2 tokens). Alone, Eq. 4 at k = 0:
    # T_G = 1.1 < T_C = 1.0 + 0.2: queued; Eq. 5 finds no i' (T_C(0) = 0), so Alg. 1's i = n loads it
    c = costs(host=((1, 1.0),))
    assert hosted(PreSchedPlacement(cache(), c)(plan([[3], [3]], [[1.0], [1.0]]))) == []
    # a predicted next-layer expert of 2 tokens joins the queue: k = 0: 2.1 vs 1.2, no; k = 1: 1.1 vs 2.2, yes —
    # only the next layer's expert is queued, and the current one is computed on the CPU, leaving the link free
    scores = np.zeros((2, E), np.float32)
    scores[:, 0] = 0.9
    ahead = PreSchedPlacement(cache(), c)(plan([[3], [3]], [[1.0], [1.0]], predictions={1: scores}))
    assert hosted(ahead) == [3]
    # an expensive CPU: the current miss loads either way
    slow = costs(host=((1, 5.0),))
    assert hosted(PreSchedPlacement(cache(), slow)(plan([[3], [3]], [[1.0], [1.0]], predictions={1: scores}))) == []


def test_presched_and_greedy_differ_where_equation_4_queues_but_equation_5_never_holds():
    # current miss 7 (3 tokens); predicted next-layer 1 (1 token) and 2 (2 tokens); t_c flat 0.9. E_all ascending:
    # 1, 2, 7; Eq. 4: k = 0: 3.1 vs 1.1; k = 1: 2.1 vs 2.0; k = 2: 1.1 vs 2.9 — 7 is queued; Eq. 5 has no i', so
    # PreSched loads it (Alg. 1: i = n); greedy, Eq. 5 alone, computes it on the CPU
    c = costs(host=((1, 0.9),))
    scores = np.zeros((3, E), np.float32)
    scores[0, 1] = scores[1, 2] = scores[2, 2] = 0.9
    p = plan([[7], [7], [7]], [[1.0]] * 3, predictions={1: scores})
    assert hosted(PreSchedPlacement(cache(), c)(p)) == []
    assert hosted(GreedyPlacement(cache(), c)(plan([[7], [7], [7]], [[1.0]] * 3))) == [7]


def test_hobbit_coop_computes_every_decode_miss_on_the_host_and_the_prompt_on_the_device():
    decode = HobbitCoop(cache(1), RunningCosts(100))(plan([[1, 2, 3]], [[0.5, 0.3, 0.2]]))
    assert hosted(decode) == [2, 3] and decode.place[1] == FAST
    prefill = HobbitCoop(cache(1), RunningCosts(100))(plan([[1, 2, 3]], [[0.5, 0.3, 0.2]], phase=PREFILL))
    assert hosted(prefill) == []


def test_cpu_offload_computes_every_miss_on_the_host_in_every_phase():
    """SMoE Fig. 14's baseline (llama.cpp's offloading): what the cache holds runs there, the rest on the CPU."""
    for phase in (DECODE, PREFILL):
        p = CpuOffload(cache(1), RunningCosts(100))(plan([[1, 2, 3]], [[0.5, 0.3, 0.2]], phase=phase))
        assert hosted(p) == [2, 3] and p.place[1] == FAST


def test_unknown_placement_is_refused():
    with pytest.raises(MoetierError, match="unknown placement"):
        make_placement("fiddler", cache(), RunningCosts(100))
