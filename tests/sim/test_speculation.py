"""Speculation in a replay (moetier/sim/speculation.py): decode rows regrouped into verify steps on hand-made traces,
the planner's union over a step's tokens, and the refusals of `moetier sim --speculate`."""

import json

import numpy as np
import pytest

from moetier.cli import main
from moetier.errors import MoetierError
from moetier.plan.route import DECODE, PREFILL
from moetier.sim.cost import CostModel
from moetier.sim.profile import HardwareProfile
from moetier.sim.replay import steps
from moetier.sim.shapes import SHAPES
from moetier.sim.speculation import verify_steps
from moetier.sim.sweep import run
from moetier.trace.format import Trace


def one_sequence(decode: int, experts: list[list[int]] | None = None) -> Trace:
    """A prompt of 3 tokens, then `decode` tokens, one MoE layer of 8 experts, top-2."""
    n = 3 + decode
    ids = np.asarray(experts if experts is not None else [[t % 8, (t + 1) % 8] for t in range(n)], np.int16)
    return Trace("hand-made", 1, 8, 2, [0], np.zeros(n, np.int32), np.arange(n, dtype=np.int32),
                 np.array([PREFILL] * 3 + [DECODE] * decode, np.uint8), ids[:, None, :],
                 np.full((n, 1, 2), 0.5, np.float16))


def test_every_draft_kept_makes_steps_of_k_plus_one_tokens():
    trace, produced = verify_steps(one_sequence(8), k=3, accept=1.0)
    groups = [rows.tolist() for _, rows in steps(trace)]
    assert produced == [3, 4, 4] and [len(g) for g in groups] == [3, 4, 4]
    assert trace.pos.tolist() == list(range(11))  # each token once


def test_every_draft_rejected_makes_one_token_a_step_computing_k_plus_one():
    trace, produced = verify_steps(one_sequence(5), k=2, accept=0.0)
    assert produced == [3, 1, 1, 1, 1, 1]
    decode_steps = [trace.pos[rows].tolist() for phase, rows in steps(trace) if phase == DECODE]
    assert decode_steps == [[3, 4, 5], [4, 5, 6], [5, 6, 7], [6, 7], [7]]  # rejected drafts: the next tokens' rows


def test_a_replay_reads_a_steps_experts_once_and_counts_the_tokens_it_produced():
    """Tokens that share experts: plain decoding with a cache of one token's experts reads each token's; a verify
    step of 4 tokens reads their union once."""
    same = [[0, 1]] * 3 + [[2, 3], [2, 3], [2, 3], [2, 3], [4, 5], [4, 5], [4, 5], [4, 5]]
    trace = one_sequence(8, same)
    cost = CostModel.of(HardwareProfile.load("rtx4090"), SHAPES["mixtral-8x7b"])
    trace = Trace("mistralai/Mixtral-8x7B-v0.1", 32, 8, 2, [0], trace.seq, trace.pos, trace.phase, trace.topk_ids,
                  trace.topk_weights)
    plain = run(trace, cost, "lru", "25%", True)  # two slots: one token's experts
    fast = run(trace, cost, "lru", "25%", True, speculation=(3, 1.0))
    assert fast.result.summary()["decode_tokens_per_s"] > plain.result.summary()["decode_tokens_per_s"]
    assert sum(fast.result.step_tokens) == sum(plain.result.step_tokens)  # the same tokens produced
    assert fast.row()["speculation"]["tokens_computed_per_token"] == 1.0


def test_speculation_refuses_what_it_cannot_replay(tmp_path, capsys):
    with pytest.raises(MoetierError, match="batch-1"):
        verify_steps(one_sequence(4).take(np.arange(7), "x", step=np.arange(7)), 2, 0.5)
    path = tmp_path / "t"
    one_sequence(6).save(path)
    base = ["sim", "--trace", str(path), "--profile", "rtx4090", "--model-shape", "mixtral-8x7b"]
    for extra, says in ((["--accept", "0.5"], "add --speculate"), (["--speculate", "2"], "give --accept"),
                        (["--speculate", "2", "--accept", "0.5", "--batch", "2"], "drop --batch"),
                        (["--speculate", "40", "--accept", "0.5"], "1..16 draft tokens")):
        assert main(base + extra) == 1
        assert says in capsys.readouterr().err
    assert main(base + ["--speculate", "2", "--accept", "1", "--expert-memory", "50%"]) == 0
    assert json.loads(capsys.readouterr().out)["speculation"]["draft_tokens"] == 2


def test_the_replay_splits_the_cache_by_layer_where_speculation_runs_under_a_budget():
    """--cache-partition auto (the engine's default): per-layer with --speculate under a budget, else global."""
    rng = np.random.default_rng(0)
    n = 3 + 24
    ids = np.stack([rng.choice(8, 2, replace=False) for _ in range(2 * n)]).reshape(n, 2, 2).astype(np.int16)
    ids[:, 1] = ids[:, 1] % 3  # layer 1 routes to 3 experts, layer 0 to all 8: a global cache shares unevenly
    ids[:, 1, 1] = (ids[:, 1, 0] + 1) % 3
    trace = Trace("mistralai/Mixtral-8x7B-v0.1", 32, 8, 2, [0, 1], np.zeros(n, np.int32), np.arange(n, dtype=np.int32),
                  np.array([PREFILL] * 3 + [DECODE] * (n - 3), np.uint8), ids, np.full((n, 2, 2), 0.5, np.float16))
    cost = CostModel.of(HardwareProfile.load("rtx4090"), SHAPES["mixtral-8x7b"])

    def replay(partition, speculation=None):
        return run(trace, cost, "lru", "50%", True, partition=partition, speculation=speculation).result.summary()

    spec = (3, 0.8)
    assert replay("per-layer", spec) != replay("global", spec)  # (the two differ on this trace)
    assert replay("auto", spec) == replay("per-layer", spec)
    assert replay("auto") == replay("global") != replay("per-layer")
    assert run(trace, cost, "lru", "100%", True, partition="auto", speculation=spec).result.summary() == \
        run(trace, cost, "lru", "100%", True, partition="global", speculation=spec).result.summary()  # all held
