"""The compute device's free memory as a share of its total: CoMoE's m_avail(t)/m_GPU (Eq. 19) and M_avail/M_GPU
(Eq. 37) — what the machine has free beside the process, not the expert cache's own free share (a cache is full
by design once warm, which made Eq. 37's threshold 0 and its prefetch take every predicted expert).

- `HostMemory`: the CPU's: memory this process may still take (the host's available memory, or an enclosing
  cgroup's allowance: moetier/memory.py) over the same bound's total; read at most every `refresh_s`, so a
  prefetch stage asking once a layer does not read /proc once a layer.
- `CudaMemory`: a GPU's, from torch.cuda.mem_get_info (the driver's free and total), likewise.
- `FixedMemory`: a share given (the simulator's: the profile's fast tier less the dense weights and the cache;
  tests' made series)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Protocol


class DeviceMemory(Protocol):
    def free_share(self) -> float:
        """The device's free memory over its total, in [0, 1]."""


class FixedMemory:
    """A free share that does not change, or a made series of them, one per reading (the last repeats)."""

    def __init__(self, shares: Sequence[float] = (0.0,)) -> None:
        if not shares or not all(0.0 <= s <= 1.0 for s in shares):
            raise ValueError(f"free-memory shares are in [0, 1], got {tuple(shares)}")
        self.shares, self._next = tuple(float(s) for s in shares), 0

    def free_share(self) -> float:
        share = self.shares[self._next]
        self._next = min(self._next + 1, len(self.shares) - 1)
        return share


class _Sampled:
    """A reading of (free, total) bytes taken at most every `refresh_s` seconds."""

    def __init__(self, read: Callable[[], tuple[int, int]], refresh_s: float = 0.1) -> None:
        self.read, self.refresh_s = read, refresh_s
        self._at, self._share = -float("inf"), 0.0

    def free_share(self) -> float:
        now = time.monotonic()
        if now - self._at >= self.refresh_s:
            free, total = self.read()
            self._at, self._share = now, min(1.0, max(0.0, free / total)) if total > 0 else 0.0
        return self._share


class HostMemory(_Sampled):
    def __init__(self, refresh_s: float = 0.1) -> None:
        super().__init__(_host_free_and_total, refresh_s)


class CudaMemory(_Sampled):
    def __init__(self, device: int | str = 0, refresh_s: float = 0.1) -> None:
        import torch

        super().__init__(lambda: torch.cuda.mem_get_info(device), refresh_s)


def _host_free_and_total() -> tuple[int, int]:
    import psutil

    from moetier.memory import memory_available

    view = memory_available()
    return view.available, view.limit if view.limit is not None else psutil.virtual_memory().total


def device_memory(device: str) -> HostMemory | CudaMemory:
    """The gauge of the device a run computes on ("cpu" or "cuda[:N]")."""
    return CudaMemory(device) if device.startswith("cuda") else HostMemory()
