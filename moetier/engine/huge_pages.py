"""Weights kept in transparent huge pages (2 MiB), where the kernel allows them.

Why: a decode step streams every active weight from memory once, and with 4 KiB pages each page is a TLB miss — in
a virtual machine a two-level page walk — that the hardware prefetchers, which stop at page boundaries, cannot hide.
Measured on a Zen 4 guest (2 vCPUs, two threads summing 1 GiB): 29-45 GB/s in 4 KiB pages, 59-65 GB/s in huge
pages. Linux gives an anonymous private mapping huge pages when asked (`madvise(MADV_HUGEPAGE)`, honoured under
THP "always" or "madvise", the usual defaults); a shared anonymous mapping would need shmem's own setting, which is
off by default — so slots are private mappings. Where the kernel has no THP the advice is refused and nothing
changes but the speed."""

from __future__ import annotations

import mmap
from collections import Counter
from dataclasses import replace

import torch

from moetier.memory import release_freed_memory
from moetier.model.dense_quant import BlockMatrix
from moetier.model.stacked import Stacked


def private_mapping(nbytes: int) -> mmap.mmap:
    """An anonymous private mapping of `nbytes`, advised for huge pages before anything touches it."""
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    huge_pages(region)
    return region


def huge_pages(region: mmap.mmap) -> bool:
    """Advise huge pages for a mapping not yet touched (advice after the first touch leaves the 4 KiB pages already
    there until khugepaged collapses them). False where the kernel or platform refuses."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None:
        return False
    try:
        region.madvise(advice)
    except OSError:
        return False
    return True


def in_huge_pages(dense: dict, leave: tuple[str, ...] = ()) -> dict:
    """The dense weights (tensors, and quantized matrices' codes, scales and zeros) moved one by one into one
    private mapping advised for huge pages, each at a 64-byte boundary; a tensor under two names is copied once; a
    `Stacked` matrix's parts copied one after another, each role (codes, scales, zeros) one tensor there. Each
    original is let go as soon as nothing left to move names it, and its memory handed back, so the peak is the
    mapping plus the largest tensor. Those named in `leave` stay as they are (a table read a row at a time:
    engine/embedding_rows.py)."""
    order, out = list(dense), {name: dense.pop(name) for name in leave}  # (`dense` is emptied as it is moved)
    uses = Counter(id(t) for v in dense.values() for t in _tensors(v))
    total = sum(_padded(t) for t in {id(t): t for v in dense.values() for t in _tensors(v)}.values())
    if not total:
        out.update(dense)
        dense.clear()
        return {name: out[name] for name in order}
    flat = torch.frombuffer(private_mapping(total), dtype=torch.uint8)  # (the tensor keeps the mapping alive)
    offset, copies = 0, {}  # copies: id of an original still named by what is left -> its copy

    def let_go(t: torch.Tensor) -> None:
        key = id(t)  # (unique while `dense` still holds the original: its use count is above 0)
        uses[key] -= 1
        if not uses[key]:
            copies.pop(key, None)

    def moved(t: torch.Tensor) -> torch.Tensor:
        nonlocal offset
        key = id(t)
        if key not in copies:
            n = t.numel() * t.element_size()
            copies[key] = flat[offset:offset + n].view(t.dtype).view(t.shape)
            copies[key].copy_(t)
            offset += _padded(t)
        copy = copies[key]
        let_go(t)
        return copy

    def stacked(parts: list[torch.Tensor]) -> torch.Tensor:
        """The parts' rows one after another, from a 64-byte boundary (within the total: at most the parts' sum)."""
        nonlocal offset
        rows = sum(t.shape[0] for t in parts)
        n = sum(t.numel() * t.element_size() for t in parts)
        whole = flat[offset:offset + n].view(parts[0].dtype).view(rows, *parts[0].shape[1:])
        first = 0
        for t in parts:
            whole[first:first + t.shape[0]].copy_(t)
            first += t.shape[0]
            let_go(t)
        offset += (n + 63) & ~63
        return whole

    for name in list(dense):
        value = dense.pop(name)
        out[name] = value.build(stacked) if isinstance(value, Stacked) else _rebuilt(value, moved)
        release_freed_memory()
    return {name: out[name] for name in order}


def _padded(t: torch.Tensor) -> int:
    return (t.numel() * t.element_size() + 63) & ~63


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, Stacked):
        return [t for role in value.pieces() for t in role]
    if isinstance(value, BlockMatrix):
        return [value.data]
    q = value.q  # a QuantizedMatrix
    return [t for t in (q.codes, q.scales, q.zeros) if t is not None]


def _rebuilt(value, moved):
    if isinstance(value, torch.Tensor):
        return moved(value)
    if isinstance(value, BlockMatrix):
        return replace(value, data=moved(value.data))
    q = value.q
    return replace(value, q=replace(q, codes=moved(q.codes), scales=moved(q.scales),
                                    zeros=None if q.zeros is None else moved(q.zeros)))
