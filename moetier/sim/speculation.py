"""Speculative decoding in a replay (`moetier sim --speculate K --accept A`): a batch-1 trace's decode tokens
regrouped into the verify steps the engine's `--speculate K` runs (moetier/engine/decoding.py), so that the planner
and the clock see a step of k + 1 tokens — their experts' union read once, their compute together.

A verify step computes the sequence's last token and k drafts. Each draft is kept with probability A (drawn, seeded;
the first rejection ends the step), and the step yields the kept drafts and one token more. A kept draft is the
token the trace has next, so its routing is the trace's; a rejected draft is a token the trace does not have, and
the routing of the token that truly comes next stands in for it (the same position, a different token: an
approximation, named). The next step begins at the first token not yet produced."""

from __future__ import annotations

import numpy as np

from moetier.errors import MoetierError
from moetier.plan.route import PREFILL
from moetier.sim.replay import steps
from moetier.trace.format import Trace


def verify_steps(trace: Trace, k: int, accept: float, seed: int = 0) -> tuple[Trace, list[int]]:
    """The trace with its rows (repeated where a step's rejected drafts stand in) numbered by the step that computes
    them, and the tokens each step produces (a prompt's prefill: its prompt's, as a plain replay counts it)."""
    if trace.encoder is not None:
        raise MoetierError("speculative decoding runs decoder-only models; this trace has an encoder")
    if trace.step is not None:
        raise MoetierError("speculation is replayed on a batch-1 trace (this one's steps are batched)",
                           hint="replay the trace without --batch, or record one request at a time")
    if not 1 <= k <= 16 or not 0 <= accept <= 1:
        raise MoetierError(f"--speculate takes 1..16 draft tokens and --accept a probability, got {k}, {accept}")
    rng = np.random.default_rng(seed)
    rows, ids, produced = [], [], []
    decode: list[int] = []  # the current sequence's decode rows, in order

    def flush() -> None:
        at = 0
        while at < len(decode):
            kept = 0
            while kept < k and rng.random() < accept:
                kept += 1
            window = decode[at:at + k + 1]  # the last token and k drafts (fewer at the sequence's end)
            rows.extend(window)
            ids.extend([len(produced)] * len(window))
            made = min(kept + 1, len(window))
            produced.append(made)
            at += made
        decode.clear()

    for phase, step_rows in steps(trace):
        if phase == PREFILL or (decode and trace.seq[step_rows[0]] != trace.seq[decode[-1]]):
            flush()
        if phase == PREFILL:
            rows.extend(step_rows.tolist())
            ids.extend([len(produced)] * len(step_rows))
            produced.append(len(step_rows))  # (a prefill's tokens, counted as a plain replay counts them)
        else:
            decode.extend(step_rows.tolist())
    flush()
    out = trace.take(np.asarray(rows, np.int64), f"verify steps of {k} drafts, each kept with p={accept:g} "
                                                   f"(seed {seed}); a rejected draft's routing: the next token's",
                     step=np.asarray(ids, np.int32))
    return out, produced
