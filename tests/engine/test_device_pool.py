"""A GPU's pools of slots (DeviceSlots, TieredDeviceSlots) grow by whole slots through their shared `ensure`: each new
slot a block of `slot_bytes`, its tensors' views, its completion and the pool's own state — run here with CUDA's
streams and events stood in for and the blocks in host memory (on a GPU: tests/engine/test_cuda.py)."""

import pytest
import torch

from moetier.engine.host_tier import HostTier
from moetier.engine.slots import DeviceSlots
from moetier.engine.tiered_slots import TieredDeviceSlots
from moetier.store.store import Store
from tests.engine.test_host_tier import FakePinning, cuda_stand_ins  # noqa: F401


@pytest.fixture(scope="module")
def store(tiny_store):
    return Store(tiny_store("olmoe", num_hidden_layers=2)[1])


def staging(self):  # (page-locked staging needs CUDA: plain host memory stands in)
    raw = torch.empty(self.slot_bytes, dtype=torch.uint8)
    return raw, memoryview(raw.numpy()).cast("B")


@pytest.mark.usefixtures("cuda_stand_ins")
@pytest.mark.parametrize("kind", ["device", "tiered"])
def test_a_device_pool_grows_by_whole_slots(store, monkeypatch, kind):
    layout, cpu = store.native_layout, torch.device("cpu")
    if kind == "device":
        monkeypatch.setattr(DeviceSlots, "_pinned", staging)
        pool = DeviceSlots(layout, 3, cpu, staging=2)
        own = [pool._copied, pool._after]
    else:
        keys = store.spec.expert_keys()
        tier = HostTier(store.manifest, keys, {store.manifest.native_precision: len(keys)}, FakePinning())
        pool = TieredDeviceSlots(layout, 3, cpu, tier, store.manifest.native_precision)
        own = [pool._copied, pool._free, pool._start, pool._done, pool._copies]
    pool.ensure(5)
    pool.ensure(4)  # (never shrinks)
    assert pool.num_slots == 5 and pool.nbytes == 5 * layout.blob_bytes
    assert len(pool._blocks) == len(pool.completions) == 5 and all(len(state) == 5 for state in own)
    assert all(b.numel() == layout.blob_bytes for b in pool._blocks)
    assert set(pool.weights(4)) == {t.name for t in layout.tensors}
    pool.queued()
    pool.read_all()
