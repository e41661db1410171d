"""The order of a GPU's copies from host memory (moetier/engine/copy_queue.py), on a stood-in device whose copies
run in the order queued and finish when the test says (or as the host polls); on a GPU, tests/engine/test_cuda.py
and bench/gpu/bench_gpu.py's rows."""

import contextlib

import pytest
import torch

from moetier.engine.copy_queue import DemandFirstCopies, FifoCopies


class Device:
    """Copies run in the order queued; `finished` of them are done. The compute stream's work (a layer's routing)
    is done after `routing_polls` looks at it, the device finishing one more copy at each look."""

    def __init__(self) -> None:
        self.issued: list[tuple[str, int]] = []
        self.finished = 0
        self.routing_polls = 0
        self.polls = 0
        self.syncs = 0
        self.synced_after = None  # the looks at the routing before the host waited for it plainly


class Stream:
    def __init__(self, device=None, compute: bool = False) -> None:
        self.compute = compute

    def wait_event(self, event) -> None:
        pass

    def synchronize(self) -> None:
        pass


@pytest.fixture
def device(monkeypatch):
    dev = Device()

    class Event:
        def __init__(self, enable_timing: bool = False) -> None:
            self.at, self.compute = 0, False

        def record(self, stream=None) -> None:
            self.compute = stream is not None and stream.compute
            self.at = dev.polls + dev.routing_polls if self.compute else len(dev.issued)

        def query(self) -> bool:
            if self.compute:
                dev.polls += 1
                dev.finished = min(dev.finished + 1, len(dev.issued))
                return dev.polls >= self.at
            return dev.finished >= self.at

        def synchronize(self) -> None:
            dev.syncs += 1
            if self.compute:
                dev.synced_after = dev.polls
            else:
                dev.finished = max(dev.finished, self.at)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream(compute=True))
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    return dev


class Pool:
    def __init__(self, name: str, dev: Device) -> None:
        self.name, self.dev = name, dev

    def issue(self, slot: int):
        """The copy queued; the event recorded after it (TieredDeviceSlots.issue's return)."""
        self.dev.issued.append((self.name, slot))
        done = torch.cuda.Event()
        done.record()
        return done


def test_an_on_demand_copy_goes_ahead_of_every_held_prefetch(device):
    copies, pool = DemandFirstCopies(torch.device("cuda"), depth=2), Pool("p", device)
    for slot in range(4):  # prefetches: two on the stream (one running, one behind it), two held
        copies.hold(pool, slot)
    assert device.issued == [("p", 0), ("p", 1)]
    copies.demand(pool, 9)  # queued at once: behind the two on the stream, ahead of the held ones
    assert device.issued[-1] == ("p", 9)
    assert copies.feed()  # no room: three unfinished
    device.finished = 2
    assert copies.feed()  # room for one: the oldest held
    assert device.issued == [("p", 0), ("p", 1), ("p", 9), ("p", 2)]
    device.finished = 4
    assert not copies.feed()
    assert device.issued[-1] == ("p", 3)
    assert (copies.counts.asked, copies.counts.held) == (4, 2)


def test_a_held_copy_needed_now_is_queued_at_once_and_a_wrong_one_never(device):
    copies, a, b = DemandFirstCopies(torch.device("cuda"), depth=1), Pool("a", device), Pool("b", device)
    for pool, slot in ((a, 0), (a, 1), (b, 1), (a, 2)):
        copies.hold(pool, slot)
    assert device.issued == [("a", 0)]
    assert copies.force(b, 1) and not copies.force(b, 1)  # (a pool and a slot: b's slot 1, not a's)
    assert copies.drop(a, 2) and not copies.drop(a, 2)
    device.finished = 2
    assert not copies.feed()
    assert device.issued == [("a", 0), ("b", 1), ("a", 1)]  # a's slot 2 never
    assert (copies.counts.forced, copies.counts.dropped) == (1, 1)


def test_the_host_feeds_the_link_while_it_waits_for_the_routing(device):
    copies, pool = DemandFirstCopies(torch.device("cuda"), depth=1), Pool("p", device)
    for slot in range(4):
        copies.hold(pool, slot)
    device.routing_polls = 10
    copies.wait_current()  # each look at the routing, the device finishes a copy: the next goes on
    assert device.issued == [("p", s) for s in range(4)]
    assert device.synced_after == 3 and device.syncs == 1  # a look a held copy; none left: a plain wait
    assert copies.counts.fed_waiting == 3


def test_fifo_queues_every_copy_when_asked(device):
    copies, pool = FifoCopies(torch.device("cuda")), Pool("p", device)
    copies.hold(pool, 0)
    copies.demand(pool, 1)
    assert device.issued == [("p", 0), ("p", 1)]
    assert not copies.force(pool, 0) and not copies.drop(pool, 0) and not copies.feed()


def test_hundreds_of_unfinished_copies_wait_for_the_oldest_rather_than_lose_count(device):
    copies, pool = DemandFirstCopies(torch.device("cuda"), depth=1, marks=4), Pool("p", device)
    for slot in range(5):
        copies.demand(pool, slot)
    assert device.finished == 1  # the fifth copy's mark reused the first's: that copy was waited for
    copies.hold(pool, 5)
    assert device.issued[-1] == ("p", 4)  # four unfinished: held


@pytest.mark.parametrize("depth, marks", [(0, 8), (4, 4)])
def test_a_queue_with_no_room_is_refused(device, depth, marks):
    with pytest.raises(ValueError, match="depth"):
        DemandFirstCopies(torch.device("cuda"), depth=depth, marks=marks)


def test_the_link_may_hold_what_it_finishes_while_the_host_is_away(device, monkeypatch):
    """Prefetches are asked at a layer's end; the host next looks at the next layer's routing, after queueing its
    dense part: as many copies as the link finishes meanwhile go on at once (at least `depth`). The absence is the
    host's own time, from its last look to the routing's wait, not the wait itself."""
    from moetier.engine import copy_queue
    from moetier.plan.costs import RunningCosts

    clock = [0.0]
    monkeypatch.setattr(copy_queue.time, "perf_counter", lambda: clock[0])
    costs = RunningCosts(expert_bytes=1000)
    copies, pool = DemandFirstCopies(torch.device("cuda"), costs, depth=2), Pool("p", device)
    costs.observe_read(1000, 0.25e-3)  # a copy takes 0.25 ms
    assert copies.room() == 2  # the host's absence not yet seen

    def layer(away_s: float, prefetches) -> None:
        for slot in prefetches:  # a layer's end: its prefetches asked (each a look)
            copies.hold(pool, slot)
        clock[0] += away_s  # the next dense part queued
        copies.wait_current()
        clock[0] += 5e-3  # (the wait and the layer's own work: spent looking, not away)

    copies.feed()
    layer(1.2e-3, ())
    assert copies.away_s == pytest.approx(1.2e-3) and copies.room() == 5  # four copies' time, and one behind them
    layer(1.2e-3, range(8))
    assert device.issued[:5] == [("p", s) for s in range(5)]  # five let on at the layer's end, the rest in the wait
    for _ in range(12):
        copies.feed()
        layer(0.05e-3, ())  # a host hardly away: the floor
    assert copies.room() == 2
