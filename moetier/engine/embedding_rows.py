"""An untied embedding table read a row a token from the store file's own pages on the CPU (store/row_pages.py),
and counted in the memory budget as the rows a run reads, not as the table.

A decode step reads one row of the table a token and a prompt one a prompt token; the head, where it is the model's
own, is a matrix of its own. So on the CPU with the dense weights as the store keeps them (`--dense-precision
native`: mapped) the table stays where the file maps it, outside the huge pages the streamed weights are moved to,
and the budget counts EMBEDDING_ROWS rows of it (each row's pages, and the one it may straddle into): the rest goes
to the expert cache. gpt-oss-20b's table, 1.16 GB in bf16, is then counted as 48 MiB. Past EMBEDDING_ROWS distinct
tokens a run holds more of it than counted; those pages are the file's, clean, and under a memory cgroup's pressure
the kernel takes them back before anything is killed. Not for a tied head (every token reads the whole table
through it), a GPU (the table is copied to its memory), an encoder-decoder, or dense weights quantized at load
(read into memory of their own)."""

from __future__ import annotations

import mmap

import torch

from moetier.config import ModelSpec

EMBEDDING_ROWS = 4096  # distinct tokens whose rows the budget counts (a long conversation's)
TABLE = "embed_tokens"


def rows_read(spec: ModelSpec, tensors: dict[str, tuple[tuple[int, ...], int]], dense_precision: str,
              device: torch.device) -> tuple[str, ...]:
    """(TABLE,) where this run reads the table a row at a time from the file's pages, else ()."""
    if (dense_precision == "native" and device.type == "cpu" and spec.encoder_decoder is None
            and "lm_head" in tensors and TABLE in tensors and tensors[TABLE][1] > 0):
        return (TABLE,)
    return ()


def kept_bytes(shape: tuple[int, ...], nbytes: int) -> int:
    """What a run is counted to keep of a table of `shape` and `nbytes` read by row: EMBEDDING_ROWS rows' pages
    (a row's whole pages and one more, where it straddles), at most the table."""
    row = nbytes // shape[0]
    pages = -(-row // mmap.PAGESIZE) + 1
    return min(nbytes, EMBEDDING_ROWS * pages * mmap.PAGESIZE)


def not_kept(tensors: dict[str, tuple[tuple[int, ...], int]], by_row: tuple[str, ...]) -> int:
    """The bytes of the `by_row` tables a run does not keep (their bytes less `kept_bytes`)."""
    return sum(tensors[n][1] - kept_bytes(*tensors[n]) for n in by_row)
