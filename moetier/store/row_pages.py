"""A dense tensor read a row at a time (an untied embedding table) in a mapping of its own, its pages handed back as
its checksum pass reads them: what this process keeps of it is then the pages of the rows its tokens read, not the
table.

Why: the checksum pass touches every page, and touched pages of a mapping stay in the process's resident memory
until it is unmapped — safetensors maps the whole dense file as one, so any tensor kept from it keeps every page the
pass touched. gpt-oss-20b's table is 1.16 GB in bf16 (201,088 rows of 2,880), of which a decode step reads one
5.6 KiB row a token; held whole, it takes an eighth of an 8 GB laptop from the expert cache. Here the table's own
private mapping (never written, so its pages stay the file's) is advised for random reads (no read-ahead around a
row), each checked chunk is dropped from the process (`MADV_DONTNEED`: a later read faults the row back in, the same
bytes) and from the page cache (`POSIX_FADV_DONTNEED`)."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import torch
from zlib_ng.zlib_ng import crc32

from moetier.portable import drop_cached

CHUNK = 64 << 20  # bytes checked between two drops: the most of the table resident at once during the pass


def mapped_rows(path: Path, offset: int, nbytes: int, dtype: torch.dtype,
                shape: tuple[int, ...]) -> tuple[torch.Tensor, int]:
    """(the tensor at bytes [offset, offset + nbytes) of `path`, mapped on its own with nothing of it resident, the
    CRC-32 of its bytes)."""
    first = offset // mmap.ALLOCATIONGRANULARITY * mmap.ALLOCATIONGRANULARITY
    skip = offset - first
    fd = os.open(path, os.O_RDONLY)
    try:
        region = mmap.mmap(fd, skip + nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE,
                           offset=first)
        region.madvise(mmap.MADV_RANDOM)
        crc = 0
        for start in range(0, nbytes, CHUNK):
            end = min(start + CHUNK, nbytes)
            crc = crc32(memoryview(region)[skip + start:skip + end], crc)
            page = (skip + start) // mmap.PAGESIZE * mmap.PAGESIZE  # (the chunk's first page, whole; the last
            region.madvise(mmap.MADV_DONTNEED, page, skip + end - page)  # partial one with it: read again if asked)
        region.madvise(mmap.MADV_DONTNEED)  # (and what a fault mapped around it from the page cache, a chunk before)
        drop_cached(fd, offset, nbytes)
    finally:
        os.close(fd)
    flat = torch.frombuffer(region, dtype=torch.uint8)  # (the tensor keeps the mapping alive)
    return flat[skip:skip + nbytes].view(dtype).view(shape), crc
