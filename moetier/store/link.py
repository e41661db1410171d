"""A linked store's experts: where each expert's tensors lie in the checkpoint's safetensors files, as the segments
of a blob (moetier/store/format.py, version 3), and the CRC-32 that the reader will check them against, taken
once when the store is made (the bytes are read once, as a conversion reads them, but nothing is written).

Why: a converted store copies every expert — +13 GB for OLMoE-1B-7B, +60 GB for a 30B model — which on a laptop is
often the disk the user does not have. Linked, the store holds the dense weights, the manifest and the tokenizer."""

from __future__ import annotations

import os
from pathlib import Path

from zlib_ng.zlib_ng import crc32

from moetier.portable import drop_cached
from moetier.store.checkpoint import Located
from moetier.store.format import PrecisionLayout, Segment

READ_BYTES = 8 << 20  # a checksum's reads


def segments_of(located: dict[str, list[Located]] | None, layout: PrecisionLayout,
                names: dict[Path, str]) -> tuple[Segment, ...] | str:
    """The blob's segments for an expert whose tensors lie at `located` (each of the layout's tensors as pieces
    stacked along its first dimension), naming files by `names`; or why the checkpoint cannot be read in place."""
    if located is None:
        return "the checkpoint stores its experts in another layout than moetier's (transposed, interleaved or " \
               "quantized)"
    segments = []
    for t in layout.tensors:
        pieces = located.get(t.name)
        if not pieces:
            return f"the checkpoint has no {t.name} where moetier's layout needs one"
        dest = t.offset
        for piece in pieces:
            if piece.dtype != t.dtype:
                return f"{t.name} is {piece.dtype} in the checkpoint, {t.dtype} in the store"
            segments.append(Segment(names[piece.path], piece.offset, piece.nbytes, dest))
            dest += piece.nbytes
        rows = sum(p.shape[0] for p in pieces)
        if dest - t.offset != t.nbytes or (rows, *pieces[0].shape[1:]) != t.shape:
            return f"{t.name} is {[p.shape for p in pieces]} in the checkpoint, {t.shape} in the store"
    return tuple(segments)


def segments_crc32(segments: tuple[Segment, ...], paths: dict[str, Path]) -> int:
    """The CRC-32 of the segments' bytes back to back in blob order (what the reader checks a linked blob against).
    Read through the page cache, which is told to drop them afterwards: indexing must not leave the model cached."""
    crc = 0
    for seg in sorted(segments, key=lambda s: s.dest):
        fd = os.open(paths[seg.source], os.O_RDONLY)
        try:
            done = 0
            while done < seg.length:
                data = os.pread(fd, min(READ_BYTES, seg.length - done), seg.offset + done)
                if not data:
                    raise OSError(f"{paths[seg.source]} ends before {seg.offset + seg.length}")
                crc = crc32(data, crc)
                done += len(data)
            drop_cached(fd, seg.offset, seg.length)
        finally:
            os.close(fd)
    return crc
