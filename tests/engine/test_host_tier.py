"""The host tier behind a GPU's cache, on the CPU (its page-locking stood in for; the copies to the device are
tests/engine/test_cuda.py's): what it holds, which slot it evicts, what it refuses, and how much it takes."""

import pytest
import torch

from moetier.cli import main
from moetier.config import HostMemory, MemoryBudget
from moetier.engine.budget import HOST_TIER_MARGIN, RUNTIME_BYTES, plan_host_tier
from moetier.engine.engine import EngineConfig
from moetier.engine.host_tier import HostTier
from moetier.errors import BudgetError, MoetierError
from moetier.memory import MemoryView
from moetier.store.reader import ExpertReader
from moetier.store.store import Store

GiB = 2**30


class FakePinning:
    """Records what would be page-locked."""

    def __init__(self) -> None:
        self.locked: dict[int, int] = {}

    def pin(self, ptr: int, nbytes: int) -> None:
        self.locked[ptr] = nbytes

    def unpin(self, ptr: int) -> None:
        del self.locked[ptr]


@pytest.fixture(scope="module")
def store(tiny_store):
    return Store(tiny_store("olmoe", num_hidden_layers=4)[1])


def test_a_whole_tier_holds_every_expert_at_its_place_locked_until_closed(store):
    keys, native = store.spec.expert_keys(), store.manifest.native_precision
    pinning = FakePinning()
    tier = HostTier(store.manifest, keys, {native: len(keys)}, pinning)
    assert sum(pinning.locked.values()) == tier.nbytes >= len(keys) * store.native_layout.blob_bytes
    with ExpertReader(store.path, 2, manifest=store.manifest) as reader:
        tier.fill(reader, progress=False)
    assert tier.holds(native)
    for i, key in enumerate(keys):
        assert tier.lookup(key, native) == i
        want = store.read_expert(*key)
        assert all(torch.equal(tier.weights(native, i)[name], t) for name, t in want.items())
    assert tier.counts.hits == len(keys) and tier.counts.reads == 0
    tier.close()
    assert not pinning.locked


def test_a_smaller_tier_evicts_the_least_recently_used_and_never_a_slot_being_read(store):
    keys, native = store.spec.expert_keys(), store.manifest.native_precision
    tier = HostTier(store.manifest, keys, {native: 3}, FakePinning())
    assert not tier.holds(native)
    a, b, c, d = keys[:4]
    slots = [tier.admit(k, native, 10) for k in (a, b, c)]
    assert sorted(slots) == [0, 1, 2]
    assert tier.lookup(a, native) is None  # a read still landing is not found
    for s in slots:
        tier.unpin(native, s)
    assert tier.lookup(a, native) == slots[0]  # a is now the most recently used: b goes first
    slot = tier.admit(d, native, 10)
    assert slot == slots[1] and tier.lookup(b, native) is None
    assert list(tier.resident(native)) == [c, a, d]
    tier.admit(b, native, 10)  # c is the least recent, d is pinned (its read in flight)
    assert tier.lookup(c, native) is None
    assert tier.counts.reads == 5 and tier.counts.bytes_read == 50


def test_every_slot_being_read_is_refused_not_overwritten(store):
    keys, native = store.spec.expert_keys(), store.manifest.native_precision
    tier = HostTier(store.manifest, keys, {native: 2}, FakePinning())
    tier.admit(keys[0], native, 1)
    tier.admit(keys[1], native, 1)
    with pytest.raises(MoetierError, match="read or a copy in flight"):
        tier.admit(keys[2], native, 1)


def test_a_slot_whose_copy_out_is_held_is_kept_until_let_go(store):
    """A prefetch's copy held on the host (copy_queue.py) keeps its expert in host memory until it is queued."""
    keys, native = store.spec.expert_keys(), store.manifest.native_precision
    tier = HostTier(store.manifest, keys, {native: 2}, FakePinning())
    a, b = (tier.admit(k, native, 1) for k in keys[:2])
    tier.unpin(native, a), tier.unpin(native, b)
    tier.hold(native, tier.lookup(keys[0], native))
    tier.lookup(keys[1], native)  # keys[1] the most recent: keys[0], held, would go first
    assert tier.admit(keys[2], native, 1) == b  # the held one is passed over
    assert tier.lookup(keys[0], native) == a and tier.lookup(keys[1], native) is None
    tier.unpin(native, b)
    tier.hold(native, b)
    with pytest.raises(MoetierError, match="read or a copy in flight"):
        tier.admit(keys[3], native, 1)
    tier.let_go(native, a)
    assert tier.admit(keys[3], native, 1) == a


def test_a_failed_read_leaves_its_slot_free(store):
    keys, native = store.spec.expert_keys(), store.manifest.native_precision
    tier = HostTier(store.manifest, keys, {native: 2}, FakePinning())
    slot = tier.admit(keys[0], native, 1)
    tier.unpin(native, slot, failed=True)
    assert tier.lookup(keys[0], native) is None and not list(tier.resident(native))
    assert tier.admit(keys[1], native, 1) == slot


def view(available):
    return MemoryView(available, "host", 2 * available, available)


def test_auto_takes_every_expert_where_the_host_has_room_and_a_share_where_it_has_less(store):
    native = store.manifest.native_precision
    total = store.total_expert_bytes()
    n = store.spec.num_expert_keys
    roomy = view(total + RUNTIME_BYTES + HOST_TIER_MARGIN + GiB)
    choice = plan_host_tier(store, HostMemory(), roomy, (native,), held=0)
    assert choice.slots == {native: n} and "every expert" in choice.note
    half = plan_host_tier(store, HostMemory.parse("50%"), roomy, (native,), held=0)
    assert half.slots == {native: n // 2} and "50% of them" in half.note
    short = view(total // 2 + RUNTIME_BYTES + HOST_TIER_MARGIN)
    assert plan_host_tier(store, HostMemory(), short, (native,), held=0).slots[native] == n // 2
    assert plan_host_tier(store, HostMemory.parse("0"), roomy, (native,), held=0) is None


def test_what_the_host_cannot_hold_is_refused_with_why(store):
    native = store.manifest.native_precision
    short = view(store.total_expert_bytes() // 2 + RUNTIME_BYTES + HOST_TIER_MARGIN)
    with pytest.raises(BudgetError, match="asked, but"):
        plan_host_tier(store, HostMemory.parse("100%"), short, (native,), held=0)
    with pytest.raises(BudgetError, match="needs every expert there"):  # placement computes from it
        plan_host_tier(store, HostMemory(), short, (native,), must_hold_all=True, held=0)
    with pytest.raises(BudgetError, match="needs every expert there"):
        plan_host_tier(store, HostMemory.parse("0"), short, (native,), must_hold_all=True, held=0)
    with pytest.raises(BudgetError, match="fewer than"):  # less than a layer's reads in flight
        plan_host_tier(store, HostMemory(MemoryBudget("bytes", store.native_layout.blob_bytes)), view(64 * GiB),
                       (native,), held=0)


def test_the_host_tier_is_refused_on_the_cpu_in_one_line(store, capsys):
    with pytest.raises(MoetierError, match="host tier behind a GPU"):
        EngineConfig(device="cpu", host_memory=HostMemory())
    assert main(["generate", "--model", str(store.path), "--prompt", "x", "--host-memory", "4GiB"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("moetier: error: --host-memory is the host tier") and err.count("\n") == 2
    assert main(["generate", "--model", str(store.path), "--prompt", "x", "--host-memory", "lots"]) == 1
    assert "cannot read host memory 'lots'" in capsys.readouterr().err


COPY_MS = 0.25  # what every stood-in copy to the device takes
copy_ms = {0: COPY_MS}  # (a test may make the link slower)


class FakeEvent:
    def __init__(self, enable_timing: bool = False) -> None:
        pass

    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end) -> float:
        return copy_ms[0]


class FakeStream:
    def __init__(self, device=None) -> None:
        pass

    def wait_event(self, event) -> None:
        pass


@pytest.fixture
def cuda_stand_ins(monkeypatch):
    """The CUDA calls of TieredDeviceSlots made no-ops (on the CPU a copy is done when queued), so its bookkeeping
    and the executor's use of it run here; on a GPU, tests/engine/test_cuda.py."""
    import contextlib

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())


@pytest.mark.parametrize("slots", [None, 12])
def test_the_executor_loads_through_the_tier_and_the_output_is_exact(store, cuda_stand_ins, slots):
    """Every device load goes through the tier: found there (one copy) or read from disk into it; a tier that holds
    every expert is filled once and never reads again; the tokens are exact mode's."""
    from moetier import Engine
    from moetier.engine.tiered_slots import TieredDeviceSlots

    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (6, 11)]

    def run(tier=None):
        config = EngineConfig(expert_memory=MemoryBudget.parse("25%"))
        with Engine(store, config, progress=False, host_tier=tier) as engine:
            if tier is not None:
                assert isinstance(engine.executor.pool, TieredDeviceSlots)
            outs = [engine.generate([p], max_new_tokens=10, ignore_eos=True) for p in prompts]
            bandwidth = engine.executor.costs.bandwidth
        if tier is not None and slots is None:  # every load a copy: the planner prices a load as one
            assert bandwidth == pytest.approx(store.native_layout.blob_bytes / (COPY_MS / 1e3))
        return [o.token_ids[0] for o in outs], [o.stats for o in outs]

    exact, plain = run()
    keys, native = store.spec.expert_keys(), store.manifest.native_precision
    tier = HostTier(store.manifest, keys, {native: slots or len(keys)}, FakePinning())
    if slots is None:
        with ExpertReader(store.path, 2, manifest=store.manifest) as reader:
            tier.fill(reader, progress=False)
    tokens, stats = run(tier)
    assert tokens == exact
    for s, p in zip(stats, plain):
        loads = s["prefill"]["loads"] + s["decode"]["loads"]
        assert loads == p["prefill"]["loads"] + p["decode"]["loads"]  # the same plans
        assert s["host_tier"]["hits"] + s["host_tier"]["reads"] == loads  # each load: from host memory or disk
        assert (s["host_tier"]["reads"] == 0) == (slots is None)
    if slots is not None:
        assert sum(s["host_tier"]["hits"] for s in stats) > 0  # a smaller tier still serves repeats


def test_a_model_with_fewer_experts_than_two_layers_reads_holds_them_all(tiny_store):
    """Moonlight's tiny shape: top-6 of 8 experts in one MoE layer (the GPU run found auto refused here)."""
    _, path = tiny_store("deepseek_v3", q_lora_rank=None, n_group=1, topk_group=1, n_shared_experts=2,
                         num_experts_per_tok=6, routed_scaling_factor=2.446, rope_scaling=None)
    s = Store(path)
    native = s.manifest.native_precision
    assert s.spec.num_expert_keys < 2 * s.spec.top_k
    choice = plan_host_tier(s, HostMemory(), view(64 * GiB), (native,), held=0)
    assert choice.slots == {native: s.spec.num_expert_keys}


@pytest.mark.parametrize("placement", ["greedy", "smoe-two-pointer"])
def test_placement_weighs_the_tiers_copies_and_computes_in_host_memory_where_they_cost_more(
        store, cuda_stand_ins, monkeypatch, placement):
    """With every expert in the host tier, a load is a copy: priced from the copies' own time, so placement is
    ready to weigh it (the GPU run found it never was: no disk read, no price). Copies made slow, it computes
    misses on the host, from the tier's memory, and the output stays exact."""
    from moetier import Engine

    monkeypatch.setitem(copy_ms, 0, 50.0)
    g = torch.Generator().manual_seed(6)
    prompt = torch.randint(3, 128, (9,), generator=g).tolist()
    keys, native = store.spec.expert_keys(), store.manifest.native_precision

    def run(place, tier):
        config = EngineConfig(expert_memory=MemoryBudget.parse("25%"), placement=place)
        with Engine(store, config, progress=False, host_tier=tier) as engine:
            out = engine.generate([prompt], max_new_tokens=12, ignore_eos=True)
            if tier is not None:
                assert engine.executor.host_pools[native] is tier.pools[native]  # computed where the tier holds it
                assert engine.executor.costs.placement_ready
        return out

    exact = run("none", None)
    tier = HostTier(store.manifest, keys, {native: len(keys)}, FakePinning())
    with ExpertReader(store.path, 2, manifest=store.manifest) as reader:
        tier.fill(reader, progress=False)
    out = run(placement, tier)
    assert out.token_ids == exact.token_ids
    assert out.stats["decode"]["host_runs"] > 0


@pytest.mark.parametrize("slots", [12, 20])
def test_the_simulator_keeps_the_host_tier_the_engine_keeps(store, cuda_stand_ins, slots):
    """Engine and simulator on one trace, a host tier of `slots` experts behind a 25% cache: the same plans, and the
    same loads found in host memory (a copy) and read from disk into it (a read, then a copy)."""
    from moetier import Engine
    from moetier.cache.policies import LRUPolicy
    from moetier.sim.cost import FreeCost
    from moetier.sim.replay import simulate
    from moetier.trace.record import TraceRecorder

    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (6, 11, 8)]
    keys, native = store.spec.expert_keys(), store.manifest.native_precision
    tier = HostTier(store.manifest, keys, {native: slots}, FakePinning())
    with Engine(store, EngineConfig(expert_memory=MemoryBudget.parse("25%"), policy="lru"), progress=False,
                host_tier=tier) as engine, TraceRecorder(engine) as recorder:
        for p in prompts:
            engine.generate([p], max_new_tokens=10, ignore_eos=True)
        cache_slots = engine.executor.slots
    trace = recorder.trace(["a", "b", "c"])
    sim = simulate(trace, LRUPolicy(), cache_slots, FreeCost(None, native), native, host_slots={native: slots})
    assert tier.counts.reads > 0 and tier.counts.hits > 0  # (both kinds of load happened)
    assert (sim.host.hits, sim.host.reads) == (tier.counts.hits, tier.counts.reads)


class SlowEvent(FakeEvent):
    """A stood-in copy done only once the host has looked at it twice (or waited for it): copies stay unfinished
    long enough for prefetches to be held (moetier/engine/copy_queue.py)."""

    def __init__(self, enable_timing: bool = False) -> None:
        self.looks = 3

    def record(self, stream=None) -> None:
        self.looks = 0

    def query(self) -> bool:
        self.looks += 1
        return self.looks > 2

    def synchronize(self) -> None:
        self.looks = 3


@pytest.mark.parametrize("order, slots", [("fifo", None), ("demand-first", None), ("demand-first", 12)])
def test_prefetch_copies_held_for_the_link_are_queued_before_their_slot_is_read(store, cuda_stand_ins, monkeypatch,
                                                                               order, slots):
    """Prefetching through the host tier, copies finishing only as the host looks: a held prefetch copy is queued
    before anything computes from its slot (here a copy is made when queued: a slot read before would hold another
    expert and the tokens would differ), and one its layer proved wrong is dropped unqueued; behind a smaller tier,
    prefetches read from disk first."""
    from moetier import Engine
    from moetier.engine.copy_queue import DemandFirstCopies

    monkeypatch.setattr(torch.cuda, "Event", SlowEvent)
    seen = {"force": 0, "drop": 0}

    def spy(name, real):
        def counted(self, pool, slot):
            done = real(self, pool, slot)
            seen[name] += done
            return done
        return counted

    for name in seen:
        monkeypatch.setattr(DemandFirstCopies, name, spy(name, getattr(DemandFirstCopies, name)))
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (7, 12)]
    keys, native = store.spec.expert_keys(), store.manifest.native_precision

    def run(tier, **config):
        config = EngineConfig(expert_memory=MemoryBudget.parse("25%"), **config)
        with Engine(store, config, progress=False, host_tier=tier, copy_order=order) as engine:
            outs = [engine.generate([p], max_new_tokens=12, ignore_eos=True) for p in prompts]
        return [o.token_ids for o in outs], [o.stats["prefetches"] for o in outs]

    exact, _ = run(None)
    tier = HostTier(store.manifest, keys, {native: slots or len(keys)}, FakePinning())
    if slots is None:
        with ExpertReader(store.path, 2, manifest=store.manifest) as reader:
            tier.fill(reader, progress=False)
    tokens, prefetches = run(tier, prefetch="hobbit", predictor="stacked-gates")
    assert tokens == exact
    assert sum(p["issued"] for p in prefetches) > 0
    if order == "demand-first":
        assert seen["force"] > 0  # held copies needed before the link had room: queued when needed
        assert seen["drop"] > 0 and sum(p["cancelled"] for p in prefetches) > 0  # wrong ones never queued
    else:
        assert seen == {"force": 0, "drop": 0}


def test_an_unknown_copy_order_is_refused_in_one_line(store):
    from moetier import Engine

    with pytest.raises(MoetierError, match="unknown copy order 'lifo'") as e:
        Engine(store, EngineConfig(expert_memory=MemoryBudget.parse("25%")), progress=False, copy_order="lifo")
    assert "demand-first" in e.value.hint


def test_with_no_prefetcher_copies_go_in_the_order_asked_without_the_queues_count(store, cuda_stand_ins):
    """Demand-first holds back prefetch copies only: with no prefetcher the engine queues copies as asked (FifoCopies,
    no event a copy to count the stream's); with one, the demand-first queue it was asked for. The same tokens."""
    from moetier import Engine
    from moetier.engine.copy_queue import DemandFirstCopies, FifoCopies

    keys, native = store.spec.expert_keys(), store.manifest.native_precision
    tier = HostTier(store.manifest, keys, {native: len(keys)}, FakePinning())
    with ExpertReader(store.path, 2, manifest=store.manifest) as reader:
        tier.fill(reader, progress=False)
    made = {}
    for prefetch in ("none", "hobbit"):
        config = EngineConfig(expert_memory=MemoryBudget.parse("25%"), prefetch=prefetch,
                              predictor="stacked-gates" if prefetch != "none" else "none")
        with Engine(store, config, progress=False, host_tier=tier, copy_order="demand-first") as engine:
            made[prefetch] = (type(engine.executor.copies),
                              engine.generate([[5, 9, 17, 33]], max_new_tokens=8, ignore_eos=True).token_ids)
    assert made["none"][0] is FifoCopies and made["hobbit"][0] is DemandFirstCopies
    assert made["none"][1] == made["hobbit"][1]


def test_the_links_time_counts_each_copy_once_asking_the_newest_first(store, cuda_stand_ins, monkeypatch):
    """link_activity (the planner's copy times) counts the timed copies (one in TIME_EVERY), each slot's latest
    once; where the newest copy is done, its one query covers every copy before it (one stream), not a query a
    copy."""
    from moetier import Engine
    from moetier.engine.tiered_slots import TIME_EVERY

    keys, native = store.spec.expert_keys(), store.manifest.native_precision
    tier = HostTier(store.manifest, keys, {native: len(keys)}, FakePinning())
    with ExpertReader(store.path, 2, manifest=store.manifest) as reader:
        tier.fill(reader, progress=False)
    with Engine(store, EngineConfig(expert_memory=MemoryBudget.parse("25%")), progress=False,
                host_tier=tier) as engine:
        pool = engine.executor.pool
        monkeypatch.setattr(engine.executor, "_observe_link", lambda: None)  # (the copies pile up untimed)
        engine.generate([[5, 9, 17, 33, 2]], max_new_tokens=10, ignore_eos=True)
        timed = len(pool._timed)
        assert timed == -(-pool._issued // TIME_EVERY) > 1  # (one copy in TIME_EVERY timed)
        latest = {slot for slot, n in pool._timed if n == pool._copies[slot]}
        queries = []
        query = type(pool._done[0]).query
        monkeypatch.setattr(type(pool._done[0]), "query", lambda self: queries.append(self) or query(self))
        nbytes, _ = pool.link_activity()
    assert sum(pool._copies) > timed > len(latest) >= 1 and len(queries) == 1  # (slots copied into again)
    assert nbytes == len(latest) * pool.slot_bytes and not pool._timed


def test_a_compute_call_waits_once_for_the_latest_copy_into_its_slots(store, cuda_stand_ins, monkeypatch):
    """A layer's loaded experts go in one compute call, which waits on the device for the latest copy into their
    slots alone (one copy stream: the earlier ones are done by then) — one CUDA call, not one a slot."""
    from moetier import Engine

    keys, native = store.spec.expert_keys(), store.manifest.native_precision
    tier = HostTier(store.manifest, keys, {native: len(keys)}, FakePinning())
    with ExpertReader(store.path, 2, manifest=store.manifest) as reader:
        tier.fill(reader, progress=False)
    waits, calls = [], []
    monkeypatch.setattr(FakeStream, "wait_event", lambda self, event: waits.append((self, event)))
    with Engine(store, EngineConfig(expert_memory=MemoryBudget.parse("25%")), progress=False,
                host_tier=tier) as engine:
        pool = engine.executor.pool
        real = type(pool).weights_for

        def spy(self, slots):
            copied = [s for s in slots if self._copied[s]]
            latest = max(copied, key=self._seq.__getitem__) if copied else None
            before = len(waits)
            out = real(self, slots)
            calls.append((len(copied), latest, [e for s, e in waits[before:] if s is not self.copies.stream]))
            return out

        monkeypatch.setattr(type(pool), "weights_for", spy)
        engine.generate([[5, 9, 17, 33, 2]], max_new_tokens=6, ignore_eos=True)
    assert any(n >= 2 for n, _, _ in calls)  # (calls over several copied slots)
    for _, latest, compute in calls:
        assert compute == ([] if latest is None else [pool._done[latest]])
