"""What a copy into a GPU slot waits for (moetier/engine/slot_reads.py), on a stood-in device whose compute stream is
a count of compute calls: an event recorded on it marks the calls queued so far, one the host waited for marks
them done. By hand, then through the executor prefetching behind a host tier: every copy starts after the compute
that read its slot's previous expert, and prefetch copies no longer wait for the layer they overlap."""

import contextlib

import pytest
import torch

from moetier.config import MemoryBudget
from moetier.engine.engine import EngineConfig
from moetier.engine.host_tier import HostTier
from moetier.engine.slot_reads import SlotReads
from moetier.store.reader import ExpertReader
from moetier.store.store import Store
from tests.engine.test_host_tier import FakePinning


class Device:
    def __init__(self) -> None:
        self.queued = 0  # compute calls queued on the compute stream
        self.done = 0  # of which the host knows these are done
        self.syncs = 0


class ComputeStream:
    def wait_event(self, event) -> None:
        pass


@pytest.fixture
def device(monkeypatch):
    dev = Device()

    class Event:
        def __init__(self, enable_timing: bool = False) -> None:
            self.at = None  # the compute calls queued when recorded (None: never recorded, or on the copy stream)

        def record(self, stream=None) -> None:
            self.at = dev.queued if isinstance(stream, ComputeStream) else None

        def query(self) -> bool:
            return self.at is None or self.at <= dev.done

        def synchronize(self) -> None:
            dev.syncs += 1
            if self.at is not None:
                dev.done = max(dev.done, self.at)

        def elapsed_time(self, end) -> float:
            return 0.25

    class CopyStream:  # (its copies done when queued)
        def __init__(self, device=None) -> None:
            pass

        def wait_event(self, event) -> None:
            pass

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "Stream", CopyStream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: ComputeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    return dev


def compute(dev: Device, reads: SlotReads, *slots: int) -> None:
    """One compute call reading `slots`, as the executor makes it: weights taken, the call queued, then marked."""
    for slot in slots:
        reads.read(slot)
    dev.queued += 1
    reads.queued()


def test_a_copy_waits_for_the_compute_that_last_read_its_slot_not_for_the_tail(device):
    reads = SlotReads(torch.device("cuda"))
    reads.ensure(4)
    assert reads.before_copy(3) is None  # never read: nothing to wait for
    compute(device, reads, 0, 1)  # call 1
    compute(device, reads, 2)  # call 2
    device.queued += 5  # a dense part, the next layers' experts: calls 3-7
    assert reads.before_copy(0).at == 1 and reads.before_copy(1).at == 1 and reads.before_copy(2).at == 2
    reads.read(3)  # handed out, its call queued but not yet marked (a caller that forgot): the tail, as before
    device.queued += 1
    assert reads.before_copy(3).at == device.queued == 8
    assert reads.before_copy(0).at == 1  # (the others keep their own)


def test_after_a_step_that_read_every_slot_each_copy_waits_for_that_step(device):
    reads = SlotReads(torch.device("cuda"))
    reads.ensure(3)
    compute(device, reads, 0)
    reads.read_all()  # ResidentLayers: a step from tables of every slot
    device.queued += 4
    assert reads.before_copy(1).at == 5  # never read one by one, yet read by that step
    assert reads.before_copy(0).at == 5
    compute(device, reads, 2)  # read again after: its own, later mark
    device.queued += 2
    assert reads.before_copy(2).at == 6


def test_a_mark_the_ring_comes_back_to_is_known_done_and_waited_for_no_more(device):
    reads = SlotReads(torch.device("cuda"), marks=4)
    reads.ensure(2)
    compute(device, reads, 0)  # mark 0
    for _ in range(4):  # marks 1-4: the ring comes back to mark 0's event, done by now
        compute(device, reads, 1)
    assert device.syncs == 1 and device.done == 1
    assert reads.before_copy(0) is None  # done: the copy waits for nothing
    assert reads.before_copy(1).at == 5
    with pytest.raises(ValueError, match="at least 1"):
        SlotReads(torch.device("cuda"), marks=0)


def test_after_the_host_waited_for_the_device_no_copy_waits_and_the_ring_reuses_marks_unsynchronized(device):
    """A layer's routing read back (the host waits for the compute stream): every mark recorded is done — a copy
    into a slot read before waits for nothing, and the ring coming back to a mark does not synchronize it."""
    reads = SlotReads(torch.device("cuda"), marks=4)
    reads.ensure(2)
    compute(device, reads, 0)  # mark 0
    compute(device, reads, 1)  # mark 1
    assert reads.before_copy(0).at == 1  # (not known done: the copy waits for it)
    reads.device_done()
    assert reads.before_copy(0) is None and reads.before_copy(1) is None
    for _ in range(4):  # marks 2-5: the ring comes back to marks 0 and 1, known done
        compute(device, reads, 1)
    assert device.syncs == 0
    compute(device, reads, 1)  # mark 6 reuses mark 2's event, not known done: synchronized, as before
    assert device.syncs == 1


@pytest.fixture(scope="module")
def store(tiny_store):
    return Store(tiny_store("olmoe", num_hidden_layers=4)[1])


@pytest.mark.parametrize("order", ["demand-first", "fifo"])
def test_prefetch_copies_start_after_their_slot_s_last_reader_and_before_the_layer_they_overlap(
        store, device, monkeypatch, order):
    """The executor prefetching behind a whole host tier: each copy into a slot waits on the device for an event no
    earlier than the last compute call that read the slot (or one the host already waited for), and for no later one
    — so a prefetch copy whose slot the layer did not read waits for none of the layer's compute (until now each
    waited for all that was queued: the layer it should overlap). The tokens stay exact mode's."""
    from moetier import Engine
    from moetier.engine.grouping import ExpertGroups
    from moetier.engine.one_token import OneToken
    from moetier.engine.tiered_slots import TieredDeviceSlots
    from moetier.store.reader import PREFETCH

    last_read: dict[int, int] = {}  # slot -> the compute call that last read it
    taken: list[int] = []  # slots whose weights were taken since the last compute call
    seen = {"copies": 0, "prefetches": 0, "early": 0}

    def counted(real):
        def call(self, *args, **kwargs):
            out = real(self, *args, **kwargs)
            device.queued += 1
            for slot in taken:
                last_read[slot] = device.queued
            taken.clear()
            return out
        return call

    for name in ("compute", "compute_layer"):
        monkeypatch.setattr(ExpertGroups, name, counted(getattr(ExpertGroups, name)))
    monkeypatch.setattr(OneToken, "compute_layer", counted(OneToken.compute_layer))  # (a token whose experts all hit)
    real_weights, real_submit, real_issue = (TieredDeviceSlots.weights_for, TieredDeviceSlots.submit,
                                             TieredDeviceSlots.issue)

    def weights_for(self, slots):  # (`weights` takes one slot through it)
        taken.extend(slots)
        return real_weights(self, slots)

    def submit(self, reader, key, blob, slot, priority):
        real_submit(self, reader, key, blob, slot, priority)
        waited = self._free[slot]  # what its copy will wait for: the previous expert's last reader exactly
        assert (waited is None and device.done >= last_read.get(slot, 0)) or waited.at == last_read[slot]
        if priority == PREFETCH:
            seen["prefetches"] += 1
            seen["early"] += waited is None or waited.at < device.queued  # (until now: always the tail)

    def issue(self, slot):
        waited = self._free[slot]
        if slot in last_read:  # the previous expert's reads: waited for on the device, or known done
            assert (waited is not None and waited.at >= last_read[slot]) or device.done >= last_read[slot]
        seen["copies"] += 1
        return real_issue(self, slot)

    monkeypatch.setattr(TieredDeviceSlots, "weights_for", weights_for)
    monkeypatch.setattr(TieredDeviceSlots, "submit", submit)
    monkeypatch.setattr(TieredDeviceSlots, "issue", issue)
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (7, 12)]
    keys, native = store.spec.expert_keys(), store.manifest.native_precision

    def run(tier, **config):
        config = EngineConfig(expert_memory=MemoryBudget.parse("25%"), **config)
        with Engine(store, config, progress=False, host_tier=tier, copy_order=order) as engine:
            return [engine.generate([p], max_new_tokens=12, ignore_eos=True).token_ids for p in prompts]

    exact = run(None)
    tier = HostTier(store.manifest, keys, {native: len(keys)}, FakePinning())
    with ExpertReader(store.path, 2, manifest=store.manifest) as reader:
        tier.fill(reader, progress=False)
    assert run(tier, prefetch="hobbit", predictor="stacked-gates") == exact
    assert seen["copies"] > seen["prefetches"] > 0
    assert seen["early"] > 0, seen  # prefetch copies free to start before the layer's compute is done


def test_the_routing_wait_tells_every_pool_after_waiting():
    """Behind a host tier the executor waits for a layer's routing through the copy queue, then tells each pool
    (a low tier's, added later, too) that the compute stream's work so far is done — only after the wait."""
    from moetier.engine.expert_executor import _RoutingWait

    calls = []

    class Copies:
        def wait_current(self):
            calls.append("wait")

    class Pool:
        def __init__(self, name):
            self.name = name

        def device_done(self):
            calls.append(self.name)

    pools = {"bf16": Pool("bf16")}
    wait = _RoutingWait(Copies(), pools)
    pools["int4"] = Pool("int4")
    wait()
    assert calls == ["wait", "bf16", "int4"]
