"""A table read by row (store/row_pages.py): mapped on its own, checked, and nothing of it left resident."""

import os

import torch
from zlib_ng.zlib_ng import crc32

from moetier.store.row_pages import CHUNK, mapped_rows

MiB = 1 << 20


def resident(address: int) -> int:
    """The resident bytes of the mapping that holds `address` (/proc/self/smaps)."""
    lines = open("/proc/self/smaps").read().splitlines()
    for i, line in enumerate(lines):
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            if lo <= address < hi:
                rss = next(x for x in lines[i + 1:] if x.startswith("Rss:"))
                return int(rss.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")


def test_a_table_mapped_by_row_is_the_files_bytes_with_nothing_of_it_resident(tmp_path):
    """A 96 MiB table starting mid-page in a file: the same values, its CRC-32, and after the pass that read every
    page of it (in chunks) the process holds none of it; reading a few rows brings back a few pages."""
    g = torch.Generator().manual_seed(0)
    rows, width = 24576, 2048  # [R, W] bf16: 4 KiB a row
    table = torch.randn(rows, width, generator=g).bfloat16()
    raw = table.view(torch.uint8).numpy().tobytes()
    offset = 3 * 4096 + 100  # (not on a page, as a safetensors file's tensors are not)
    path = tmp_path / "dense.bin"
    with open(path, "wb") as f:  # (written and out of the page cache, as a store written before the run)
        f.write(os.urandom(offset) + raw + os.urandom(77))
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    assert len(raw) > CHUNK  # (more than one chunk: each dropped in turn)
    got, crc = mapped_rows(path, offset, len(raw), torch.bfloat16, (rows, width))
    assert crc == crc32(raw)
    assert resident(got.data_ptr()) == 0  # (the pass read 96 MiB; none of it stays)
    picked = [0, 5, 12000, rows - 1]
    assert torch.equal(got[picked], table[picked])
    assert resident(got.data_ptr()) <= 8 * MiB  # (the pages of four rows, with what the kernel maps around a fault
    # where the page cache holds them in large folios — 2.1 MiB seen in one run — of a 96 MiB table)
    assert torch.equal(got, table)  # (all of it, paged back in)
    assert resident(got.data_ptr()) >= len(raw)

