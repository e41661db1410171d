"""Preallocated expert slots: one anonymous mapping (page-aligned, so O_DIRECT can read straight into it),
cut into blob-sized slots, each with its tensor views made once."""

from __future__ import annotations

import mmap

import torch

from moetier.store.format import DTYPES, PrecisionLayout
from moetier.store.reader import Completion


class SlotPool:
    def __init__(self, layout: PrecisionLayout, num_slots: int) -> None:
        self.layout = layout
        self.num_slots = num_slots
        self.slot_bytes = layout.blob_bytes
        self._buffer = mmap.mmap(-1, num_slots * self.slot_bytes)
        # Fault every page in now: the budget is really reserved (and counted in RSS), and no read in the hot
        # loop pays for first-touch page faults.
        torch.frombuffer(self._buffer, dtype=torch.uint8).zero_()
        view = memoryview(self._buffer)
        self.views = [view[i * self.slot_bytes:(i + 1) * self.slot_bytes] for i in range(num_slots)]
        self.completions = [Completion() for _ in range(num_slots)]
        self.tensors: list[dict[str, torch.Tensor]] = [self._tensors(i) for i in range(num_slots)]

    def _tensors(self, slot: int) -> dict[str, torch.Tensor]:
        out = {}
        for t in self.layout.tensors:
            dtype = DTYPES[t.dtype]
            count = t.nbytes // dtype.itemsize
            out[t.name] = torch.frombuffer(self._buffer, dtype=dtype, count=count,
                                           offset=slot * self.slot_bytes + t.offset).view(t.shape)
        return out

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.slot_bytes
