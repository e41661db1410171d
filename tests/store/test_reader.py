import pytest
import torch

from moetier.engine.slots import HostSlots
from moetier.store.reader import ON_DEMAND, PREFETCH, ExpertReader, _Chunk
from moetier.store.store import Store


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("chunk", [4096, 2 << 20])
def test_reads_land_exactly_in_slots(tiny_store, direct, chunk):
    ref, path = tiny_store("mixtral")
    store = Store(path)
    pool = HostSlots(store.native_layout, 3)
    with ExpertReader(path, num_threads=3, chunk_bytes=chunk, direct=direct) as reader:
        for slot, (layer, e) in enumerate([(0, 1), (1, 7), (0, 0)]):
            reader.submit(store.manifest.blob(layer, e), pool.views[slot], pool.completions[slot])
        for slot, (layer, e) in enumerate([(0, 1), (1, 7), (0, 0)]):
            pool.completions[slot].wait()
            experts = ref.model.layers[layer].mlp.experts
            assert torch.equal(pool.weights(slot)["gate_up_proj"], experts.gate_up_proj[e])
            assert torch.equal(pool.weights(slot)["down_proj"], experts.down_proj[e])


def test_on_demand_chunks_go_before_queued_prefetches():
    def chunk(priority, seq):
        return _Chunk(priority, seq, None, 0, 0, 0, None, 0, False, "")

    late_demand = chunk(ON_DEMAND, 10)
    assert late_demand < chunk(PREFETCH, 1)
    assert chunk(ON_DEMAND, 1) < late_demand  # FIFO within a priority


def test_a_queued_load_can_be_cancelled_a_running_one_cannot(tiny_store, monkeypatch):
    import threading

    from moetier.store import reader as reader_module

    _, path = tiny_store("mixtral", copy=True)
    store = Store(path)
    pool = HostSlots(store.native_layout, 2)
    gate = threading.Event()
    real_preadv = reader_module.os.preadv

    def slow_preadv(*args):  # hold the only reader thread inside the first read
        gate.wait()
        return real_preadv(*args)

    monkeypatch.setattr(reader_module.os, "preadv", slow_preadv)
    with ExpertReader(path, num_threads=1, chunk_bytes=1 << 20) as reader:
        running, queued = pool.completions
        reader.submit(store.manifest.blob(0, 0), pool.views[0], running, PREFETCH)
        while not running.started:
            pass
        reader.submit(store.manifest.blob(0, 1), pool.views[1], queued, PREFETCH)
        assert reader.cancel(queued) is True and queued.done.is_set()
        assert reader.cancel(running) is False
        reader.submit(store.manifest.blob(1, 2), pool.views[1], queued)  # the slot is reused at once
        gate.set()
        running.wait()
        queued.wait()  # the cancelled load's stale chunks neither ran nor confused the new load
        ref = torch.frombuffer(bytearray((path / store.manifest.blob(1, 2).file).read_bytes()), dtype=torch.uint8)
    blob = store.manifest.blob(1, 2)
    assert torch.equal(torch.frombuffer(pool.views[1], dtype=torch.uint8), ref[blob.offset:blob.offset + blob.length])


def test_a_promoted_prefetch_runs_before_on_demand_loads_submitted_after_it(tiny_store, monkeypatch):
    import threading

    from moetier.store import reader as reader_module

    _, path = tiny_store("mixtral", copy=True)
    store = Store(path)
    pool = HostSlots(store.native_layout, 3)
    gate, order = threading.Event(), []
    real_preadv = reader_module.os.preadv

    def logged_preadv(fd, bufs, offset):  # hold the only reader thread inside the first read; log the rest
        gate.wait()
        order.append(offset)
        return real_preadv(fd, bufs, offset)

    monkeypatch.setattr(reader_module.os, "preadv", logged_preadv)
    blobs = [store.manifest.blob(0, e) for e in range(3)]
    with ExpertReader(path, num_threads=1, chunk_bytes=1 << 20, verify=False) as reader:
        running, prefetched, demanded = pool.completions
        reader.submit(blobs[0], pool.views[0], running, PREFETCH)
        while not running.started:
            pass
        reader.submit(blobs[1], pool.views[1], prefetched, PREFETCH)
        reader.submit(blobs[2], pool.views[2], demanded, ON_DEMAND)  # would overtake the prefetch...
        reader.promote(prefetched)  # ...unless its layer needs it now
        gate.set()
        for c in pool.completions:
            c.wait()
    assert order == [blobs[0].offset, blobs[1].offset, blobs[2].offset]


def test_activity_counts_the_bytes_and_the_busy_time(tmp_path):
    import time

    from moetier.store.format import ALIGN, BlobRef
    from moetier.store.reader import Completion, ExpertReader

    data = bytes(range(256)) * (4 * ALIGN // 256)
    (tmp_path / "blob.bin").write_bytes(data)
    blob = BlobRef(0, 0, "bf16", "blob.bin", 0, len(data), 0)
    dest = torch.empty(len(data) + ALIGN, dtype=torch.uint8)
    skip = -dest.data_ptr() % ALIGN
    view = memoryview(dest.numpy())[skip:skip + len(data)]
    with ExpertReader(tmp_path, num_threads=2, chunk_bytes=ALIGN, verify=False) as reader:
        assert reader.activity() == (0.0, 0)
        start = time.perf_counter()
        done = Completion()
        reader.submit(blob, view, done)
        done.wait()
        wall = time.perf_counter() - start
        busy, nbytes = reader.activity()
    assert nbytes == len(data) and bytes(view) == data
    assert 0 < busy <= wall


@pytest.mark.parametrize("damage", [None, 0, 2 * 4096 + 7, 5 * 4096 - 1])
def test_a_blob_read_in_chunks_is_checked_chunk_by_chunk(tmp_path, damage):
    """Each chunk's crc taken where it lands, combined in order: a good blob passes, one bad byte anywhere fails."""
    import zlib

    from moetier.errors import ChecksumError
    from moetier.store.format import ALIGN, BlobRef
    from moetier.store.reader import Completion

    data = bytearray(bytes(range(256)) * (5 * ALIGN // 256))  # five chunks of ALIGN bytes
    blob = BlobRef(0, 0, "bf16", "blob.bin", 0, len(data), zlib.crc32(data))
    if damage is not None:
        data[damage] ^= 0xFF
    (tmp_path / "blob.bin").write_bytes(bytes(data))
    dest = torch.empty(len(data) + ALIGN, dtype=torch.uint8)
    skip = -dest.data_ptr() % ALIGN
    view = memoryview(dest.numpy())[skip:skip + len(data)]
    with ExpertReader(tmp_path, num_threads=3, chunk_bytes=ALIGN, verify=True) as reader:
        done = Completion()
        reader.submit(blob, view, done)
        if damage is None:
            done.wait()
            assert bytes(view) == bytes(data)
        else:
            with pytest.raises(ChecksumError, match="fails its checksum"):
                done.wait()
