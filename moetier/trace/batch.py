"""A trace's sequences replayed as batches: what `moetier generate` does with several prompts in one call, and what
PreScope's and SMoE's batched results (batch 3 to 64) are measured on.

`interleave(trace, batch)` takes the sequences in order, `batch` at a time, and orders each group's rows as the
engine's forward steps run them: every prompt's prefill in one step, then one decode step per new token, holding
the next decode row of every sequence of the group that still has one. The result carries each row's step
(`Trace.step`), so the replay routes a step's tokens together — the union of their experts, one read serving all.
A trace recorded from a batched engine run carries its own steps already.

A trace with fewer sequences than `batch` (a stream imported with no boundaries is one) is first cut into `batch`
contiguous pieces of nearly equal rows, never inside a prompt's prefill, each then a sequence of its own: routing
taken from different places in the stream stands for different requests."""

from __future__ import annotations

import dataclasses

import numpy as np

from moetier.plan.route import PREFILL
from moetier.trace.format import Trace, TraceError


def interleave(trace: Trace, batch: int) -> Trace:
    """`trace`'s sequences as batches of `batch` (see the module docstring)."""
    if batch < 1:
        raise TraceError(f"a batch holds at least one sequence, not {batch}")
    if trace.step is not None:
        raise TraceError("the trace is batched already (it carries its forward steps)",
                         hint="replay it as it is, without --batch")
    seq = trace.seq.astype(np.int64)
    order = list(dict.fromkeys(seq.tolist()))
    if len(order) < batch:
        if trace.encoder is not None:
            raise TraceError(f"an encoder-decoder trace of {len(order)} sequences cannot be cut into a batch of "
                             f"{batch}", hint="record more prompts")
        seq = _pieces(trace, batch)
        order = list(range(batch))
    rows_of = {s: np.flatnonzero(seq == s) for s in order}
    index, step = [], []
    for g in range(0, len(order), batch):
        group = [rows_of[s] for s in order[g:g + batch]]
        prefill = [r[trace.phase[r] == PREFILL] for r in group]
        decode = [r[trace.phase[r] != PREFILL] for r in group]
        if any(len(p) for p in prefill):
            index.append(np.concatenate(prefill))
            step.append(np.full(len(index[-1]), len(step)))
        for t in range(max(len(d) for d in decode)):
            rows = np.array([d[t] for d in decode if t < len(d)])
            index.append(rows)
            step.append(np.full(len(rows), len(step)))
    index_all = np.concatenate(index)
    out = trace.take(index_all, f"interleaved into batches of {batch} sequences (trace/batch.py)",
                     step=np.concatenate(step).astype(np.int32))
    return dataclasses.replace(out, seq=seq[index_all].astype(np.int32))  # (the pieces' ids, validated again)


def _pieces(trace: Trace, batch: int) -> np.ndarray:
    """A sequence id per row: the rows, in order, cut into `batch` contiguous pieces, never inside a prompt's
    prefill."""
    n = trace.num_tokens
    if n < batch:
        raise TraceError(f"a trace of {n} token steps cannot be cut into {batch} sequences")
    cuts = []
    for i in range(1, batch):
        cut = round(i * n / batch)
        while cut < n and trace.phase[cut] == PREFILL and trace.phase[cut - 1] == PREFILL \
                and trace.seq[cut] == trace.seq[cut - 1]:
            cut += 1
        cuts.append(cut)
    return np.searchsorted(np.array(cuts), np.arange(n), side="right")
