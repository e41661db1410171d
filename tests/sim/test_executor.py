"""The simulated executor on a machine with round numbers: reads in series on one link, compute overlapping them,
a read that waits for the slot it takes, a prefetch that is a hit only if it landed in time — and a hand-made plan
with a substitute, a skip and prefetches timed as computed by hand."""

import dataclasses

import numpy as np
import pytest

from moetier.cache.keys import ExpertKey
from moetier.cache.policies import LRUPolicy
from moetier.cache.residency import Residency
from moetier.plan.layer_plan import FAST, HOST
from moetier.plan.on_demand import OnDemandStage
from moetier.plan.planner import Planner
from moetier.plan.route import RouteResult
from moetier.plan.step import LayerStep
from moetier.sim.cost import CostModel
from moetier.sim.executor import SimExecutor
from moetier.sim.host_cache import HostCache
from moetier.sim.profile import Device, HardwareProfile, Linear, Measured, Tier
from moetier.sim.shapes import ModelShape
from tests.handmade_plan import PrefetchAfter, Substitute

SHAPE = ModelShape("unit", hidden_size=8, num_layers=2, moe_layers=(0, 1), num_experts=4, top_k=2,
                   moe_intermediate_size=16, attention_params=256, kv_per_token=16, vocab_size=32)
CPU = Device("cpu", memory_bandwidth_bytes_per_s=1e9, flops={"bf16": 1e12}, call_overhead_s=1e-6)
# dense part of a layer 2 s, an expert 1 s whatever its tokens, reads at 100 B/s
PROFILE = HardwareProfile("unit", 10**9, (Tier("disk", bandwidth_bytes_per_s=100.0),), {"cpu": CPU}, "cpu",
                          measured=(Measured(8, 16, "bf16", expert_s=Linear(0.0, 1.0),
                                             dense_s_per_layer=Linear(0.0, 2.0), head_s=Linear(0.0, 0.0)),))


def machine(slots: int, expert_bytes: int, stages_before=(), resident=(), profile=PROFILE):
    """A simulated executor over a cache of `slots` experts of `expert_bytes`, with `resident` experts in it."""
    r = Residency(slots * expert_bytes, {"bf16": expert_bytes}, LRUPolicy())
    for key, _ in r.admit_while_room(resident, "bf16"):
        r.landed(key)
    r.unpin_all()
    step = LayerStep(r, Planner("bf16", [*stages_before, OnDemandStage(r)]))
    return SimExecutor(step, CostModel.of(profile, SHAPE, "bf16", expert_bytes)), r, step


def route(layer: int, ids, step: int = 1) -> RouteResult:
    ids = np.asarray(ids, np.int64)
    return RouteResult(layer, step, ids, np.full(ids.shape, 0.5, np.float32), np.zeros((len(ids), 4), np.float32))


def test_reads_are_serial_and_overlap_resident_compute():
    # dense 0-2 s; hits 0 and 1 compute 2-3, 3-4; two reads of 300 B at 100 B/s on one link: 2-5 and 5-8
    ex, _, _ = machine(4, 300, resident=[ExpertKey(0, 0), ExpertKey(0, 1)])
    plan, tl = ex.layer(route(0, [[0, 1], [2, 3]]), tokens=2)
    assert tl.dense_end == 2.0
    assert [(k.expert, s, e) for k, s, e in tl.reads] == [(2, 2.0, 5.0), (3, 5.0, 8.0)]
    assert [c[:3] for c in tl.computes] == [(0, 2.0, 3.0), (1, 3.0, 4.0), (2, 5.0, 6.0), (3, 8.0, 9.0)]
    assert tl.end == ex.now == 9.0 and ex.link_free == 8.0
    assert [r.expert for r in plan.hits] == [0, 1]


def test_behind_a_host_tier_a_miss_is_a_disk_read_then_a_copy_and_a_hit_a_copy():
    # a link of 100 B/s to host memory and a disk of 50 B/s behind it; 100 B experts: a copy 1 s, a disk read 2 s;
    # two cache slots, four host slots. Layer 0 (dense 0-2): both misses everywhere — disk 2-4 then copy 4-5,
    # disk 4-6 (the disk free while the first copies) then copy 6-7. Layer 1 (dense 8-10) evicts both from the
    # cache: disk 10-12, copy 12-13; disk 12-14, copy 14-15. Layer 0 again (dense 16-18): both in host memory,
    # copies 18-19 and 19-20, no disk.
    tiers = (Tier("pcie", bandwidth_bytes_per_s=100.0), Tier("disk", bandwidth_bytes_per_s=50.0))
    ex, _, _ = machine(2, 100, profile=dataclasses.replace(PROFILE, tiers=tiers))
    ex.host = HostCache({"bf16": 4}, [ExpertKey(layer, e) for layer in (0, 1) for e in range(4)])
    _, tl = ex.layer(route(0, [[0, 1]]), tokens=1)
    assert [(k.expert, s, e) for k, s, e in tl.reads] == [(0, 2.0, 5.0), (1, 4.0, 7.0)]
    assert [c[1:3] for c in tl.computes] == [(5.0, 6.0), (7.0, 8.0)] and tl.end == 8.0
    _, tl = ex.layer(route(1, [[0, 1]]), tokens=1)
    assert [(s, e) for _, s, e in tl.reads] == [(10.0, 13.0), (12.0, 15.0)] and tl.end == 16.0
    _, tl = ex.layer(route(0, [[0, 1]]), tokens=1)
    assert [(s, e) for _, s, e in tl.reads] == [(18.0, 19.0), (19.0, 20.0)] and tl.end == 21.0
    assert (ex.host.hits, ex.host.reads, ex.disk_free) == (2, 4, 14.0)


def test_reads_beside_the_compute_take_their_cpu_from_it_where_the_cpu_reads():
    # as above, each 300 B read now taking 0.3 s of the computing CPU over its 3 s on the link (0.1 s a second):
    # read 2-5 overlaps the computes 2-3 and 3-4 (0.2 s taken), read 5-8 the compute 5-6 (0.1 s); the dense part
    # 0-2 overlaps no read. The layer ends 0.3 s later; the same plan and reads otherwise.
    reading = dataclasses.replace(PROFILE, tiers=(Tier("disk", bandwidth_bytes_per_s=100.0, cpu_s_per_byte=1e-3),))
    ex, _, _ = machine(4, 300, resident=[ExpertKey(0, 0), ExpertKey(0, 1)], profile=reading)
    plan, tl = ex.layer(route(0, [[0, 1], [2, 3]]), tokens=2)
    assert [(k.expert, s, e) for k, s, e in tl.reads] == [(2, 2.0, 5.0), (3, 5.0, 8.0)]
    assert tl.end == ex.now == pytest.approx(9.3)
    # the next layer's dense part 9.3-11.3 overlaps no read: no CPU taken
    _, tl = ex.layer(route(1, [[0, 1]]), tokens=1)
    assert tl.reads[0][1] == pytest.approx(11.3)


def test_a_read_that_takes_a_slot_waits_for_the_expert_computed_in_it():
    # one slot, a layer needing two experts: 3's read takes 2's slot, so it starts when 2 is computed
    ex, _, _ = machine(1, 100)
    plan, tl = ex.layer(route(0, [[2, 3]]), tokens=1)
    assert plan.loads[1].after == 2
    assert [(k.expert, s, e) for k, s, e in tl.reads] == [(2, 2.0, 3.0), (3, 4.0, 5.0)]
    assert [c[:3] for c in tl.computes] == [(2, 3.0, 4.0), (3, 5.0, 6.0)]


def test_a_hand_made_plan_with_a_substitute_a_skip_and_prefetches():
    """Layer 0 routes [[0, 1], [2, 3]]: token 0's expert 1 runs resident expert 3 instead, token 1's expert 2 is
    skipped; prefetches of layer 1's experts 0 and 1 queue behind the loads. Layer 1 then needs 0 and 1: the
    first landed in time (a hit); the second was still queued when layer 1's routing was known, starts then and
    is waited for (a miss)."""
    substitute = Substitute(layer=0, swap={(0, 1): 3}, skip=[(1, 0)])
    ex, r, step = machine(4, 300, stages_before=[substitute], resident=[ExpertKey(0, 3)])
    step.planner.stages.append(PrefetchAfter(r, 0, [ExpertKey(1, 0), ExpertKey(1, 1)], "bf16"))
    plan, tl = ex.layer(route(0, [[0, 1], [2, 3]]), tokens=2)
    assert plan.experts == [0, 3] and [ld.expert for ld in plan.loads] == [0]
    # dense 0-2; 3 (resident) computes 2-3; read of 0 2-5, then the first prefetch 5-8; 0 computes 5-6
    assert [(k, s, e) for k, s, e in tl.reads] == [(ExpertKey(0, 0), 2.0, 5.0), (ExpertKey(1, 0), 5.0, 8.0)]
    assert [c[:3] for c in tl.computes] == [(3, 2.0, 3.0), (0, 5.0, 6.0)]
    assert tl.end == 6.0
    # layer 1 starts at 6, routing known at 8: (1,0) landed at 8 (resident, a hit); (1,1) lands at 11 (waited)
    plan, tl = ex.layer(route(1, [[0, 1]]), tokens=1)
    assert [(run.expert, run.source) for run in plan.runs] == [(0, "resident"), (1, "in-flight")]
    assert [c[:3] for c in tl.computes] == [(0, 8.0, 9.0), (1, 11.0, 12.0)]
    assert tl.reads == [(ExpertKey(1, 1), 8.0, 11.0)] and ExpertKey(1, 1) in r  # computed, so resident


def test_an_expert_placed_on_the_host_computes_beside_the_compute_device():
    """A stage places expert 1 on the host: it runs on the host lane at the same time as expert 0 runs on the
    compute device, priced by the host device's roofline (here ~1 µs) rather than the measured 1 s."""

    def on_host(plan):
        plan.place[1] = HOST
        return plan

    ex, _, _ = machine(4, 300, stages_before=[on_host], resident=[ExpertKey(0, 0), ExpertKey(0, 1)])
    plan, tl = ex.layer(route(0, [[0, 1]]), tokens=1)
    assert [(run.expert, run.place) for run in plan.runs] == [(0, FAST), (1, HOST)]
    (e0, s0, end0, lane0), (e1, s1, end1, lane1) = tl.computes
    assert (e0, s0, end0, lane0) == (0, 2.0, 3.0, FAST)
    assert (e1, s1, lane1) == (1, 2.0, HOST) and 0 < end1 - s1 < 1e-3
    assert tl.end == 3.0 and ex.host_free == end1


def test_an_on_demand_read_overtakes_queued_prefetches_but_not_a_running_one():
    """Layer 0 queues three prefetches of layer 1 (3 s each): the first runs 2-5. Layer 1's routing is known at 5
    and its miss reads 5-8, ahead of the two still queued (8-11, 11-14)."""
    far = [ExpertKey(1, e) for e in (1, 2, 3)]
    ex, r, step = machine(6, 300, resident=[ExpertKey(0, 0)])
    step.planner.stages.append(PrefetchAfter(r, 0, far, "bf16"))
    ex.layer(route(0, [[0]]), tokens=1)  # dense 0-2, compute 2-3
    plan, tl = ex.layer(route(1, [[0]]), tokens=1)  # dense 3-5
    assert [(k, s, e) for k, s, e in tl.reads] == [(ExpertKey(1, 0), 5.0, 8.0), (ExpertKey(1, 2), 8.0, 11.0)]
    assert [c[:3] for c in tl.computes] == [(0, 8.0, 9.0)]
    assert list(ex.queued) == [ExpertKey(1, 3)]


def test_a_queued_prefetch_proven_wrong_is_cancelled_unread():
    class Cancel:  # at layer 1, the prefetch of (1, 1) is proven wrong
        def __call__(self, plan):
            if plan.layer == 1:
                plan.cancels.append(ExpertKey(1, 1))
            return plan

    ex, r, step = machine(6, 300, resident=[ExpertKey(0, 0)])
    step.planner.stages += [PrefetchAfter(r, 0, [ExpertKey(1, 0), ExpertKey(1, 1)], "bf16"), Cancel()]
    ex.layer(route(0, [[0]]), tokens=1)  # prefetch (1,0) runs 2-5, (1,1) queued behind it
    plan, tl = ex.layer(route(1, [[0]]), tokens=1)  # routing at 5: (1,1) has not started
    assert plan.cancelled == [(ExpertKey(1, 1), "bf16")] and ExpertKey(1, 1) not in r.entries
    assert ex.queued == {} and all(k != ExpertKey(1, 1) for k, _, _ in tl.reads)


def test_a_predictor_delays_its_layers_plan_by_what_scoring_costs():
    # the profile says scoring the coming layers costs 0.5 s a layer: a layer with a predictor routes at 2.5 s, so
    # its read goes out then (2.5-5.5) and its compute ends at 6.5; without one, as before (routed at 2)
    from moetier.predict.base import Predictor

    class Silent(Predictor):
        def predict(self, layer, gate_input):
            return {}

    slow = dataclasses.replace(PROFILE, predict_s_per_layer=Linear(0.0, 0.5))
    ex, _, _ = machine(4, 300, profile=slow)
    _, tl = ex.layer(route(0, [[0]]), tokens=1)
    assert tl.dense_end == 2.0 and tl.end == 2.0 + 3.0 + 1.0
    ex, _, step = machine(4, 300, profile=slow)
    step.predictor = Silent(SHAPE.moe_layers, SHAPE.num_experts, SHAPE.top_k)
    _, tl = ex.layer(route(0, [[0]]), tokens=1)
    assert tl.dense_end == 2.5 and [(s, e) for _, s, e in tl.reads] == [(2.5, 5.5)] and tl.end == 6.5
