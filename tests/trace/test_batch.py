"""Interleaving a trace's sequences into batches, on hand-made traces: the steps the engine would run, the stream
cut into pieces, and the refusals."""

import numpy as np
import pytest

from moetier.sim.replay import steps
from moetier.trace.batch import interleave
from moetier.trace.format import Trace, TraceError

E, K = 8, 2


def make(seqs: list[tuple[int, int]], step=None) -> Trace:
    """One row per token: for each (prompt tokens, decode tokens), its prefill rows then its decode rows; every
    row routes to experts (row mod E, row+1 mod E) so rows can be told apart."""
    seq, pos, phase = [], [], []
    for s, (prompt, new) in enumerate(seqs):
        seq += [s] * (prompt + new)
        pos += list(range(prompt + new))
        phase += [0] * prompt + [1] * new
    n = len(seq)
    ids = np.stack([np.arange(n) % E, (np.arange(n) + 1) % E], axis=1)[:, None, :].astype(np.int16)
    return Trace("m", 1, E, K, [0], np.array(seq, np.int32), np.array(pos, np.int32), np.array(phase, np.uint8), ids,
                 np.full(ids.shape, 0.5, np.float16), step=step)


def test_a_batch_prefills_its_prompts_together_then_decodes_a_token_of_each_per_step():
    t = make([(3, 2), (2, 4), (1, 1), (2, 2)])  # four sequences, batch 3: [0, 1, 2] then [3]
    b = interleave(t, 3)
    got = [(phase, b.seq[rows].tolist(), b.pos[rows].tolist()) for phase, rows in steps(b)]
    assert got == [
        (0, [0, 0, 0, 1, 1, 2], [0, 1, 2, 0, 1, 0]),
        (1, [0, 1, 2], [3, 2, 1]),
        (1, [0, 1], [4, 3]),
        (1, [1], [4]),
        (1, [1], [5]),
        (0, [3, 3], [0, 1]),
        (1, [3], [2]),
        (1, [3], [3]),
    ]
    # every row kept once, with its routing
    key = lambda tr: sorted(zip(tr.seq.tolist(), tr.pos.tolist(), tr.topk_ids[:, 0, 0].tolist()))  # noqa: E731
    assert key(b) == key(t)
    assert interleave(t, 1).step is not None and [len(r) for _, r in steps(interleave(t, 1))] == \
        [len(r) for _, r in steps(t)]  # batch 1: the steps a trace without them replays


def test_a_single_stream_is_cut_into_pieces_that_decode_together():
    t = make([(0, 10)])
    b = interleave(t, 4)  # pieces of 2, 3, 2, 3 rows (cut at 2.5 → 2, 5, 7.5 → 8)
    sizes = [len(rows) for _, rows in steps(b)]
    assert sizes == [4, 4, 2] and sorted(set(b.seq.tolist())) == [0, 1, 2, 3]
    assert sorted(b.pos.tolist()) == list(range(10))


def test_refusals():
    t = make([(2, 2), (2, 2)])
    with pytest.raises(TraceError, match="batched already"):
        interleave(interleave(t, 2), 2)
    with pytest.raises(TraceError, match="at least one"):
        interleave(t, 0)
    with pytest.raises(TraceError, match="cannot be cut into 4"):
        interleave(make([(0, 3)]), 4)
    with pytest.raises(TraceError, match="must not decrease"):
        make([(2, 2)], step=np.array([0, 0, 2, 1], np.int32))
    with pytest.raises(TraceError, match="prefill or a decode step"):
        make([(2, 2)], step=np.array([0, 0, 0, 1], np.int32))


def test_steps_survive_saving_and_splitting(tmp_path):
    b = interleave(make([(2, 3), (1, 3), (2, 3)]), 3)
    loaded = Trace.load(b.save(tmp_path / "t"))
    assert np.array_equal(loaded.step, b.step)
    head, tail = loaded.split(0.4)  # never inside a step
    assert head.step[-1] != tail.step[0]
    assert [len(r) for _, r in steps(head)] + [len(r) for _, r in steps(tail)] == [len(r) for _, r in steps(b)]


def test_fewer_sequences_than_the_batch_are_cut_into_as_many_pieces():
    t = make([(2, 4), (1, 5)])  # 12 rows, batch 3: pieces of rows 0-3, 4-7 and 8-11
    b = interleave(t, 3)
    assert sorted(set(b.seq.tolist())) == [0, 1, 2]
    # one prefill step holding both prompts (rows 0, 1 of the first piece, row 6 of the second), then decode steps
    # of one row of each piece: 2, 4, 8 / 3, 5, 9 / 7, 10 / 11
    assert [(phase, rows.size) for phase, rows in steps(b)] == [(0, 3), (1, 3), (1, 3), (1, 2), (1, 1)]


def test_the_sim_command_refuses_a_bad_batch_in_one_line(tmp_path, capsys):
    from moetier.cli import main

    path = interleave(make([(2, 2), (2, 2)]), 2).save(tmp_path / "t")
    assert main(["sim", "--trace", str(path), "--batch", "0"]) == 1
    assert "--batch '0' is not a batch size" in capsys.readouterr().err
    assert main(["sim", "--trace", str(path), "--profile", "rtx4090", "--model-shape", "mixtral-8x7b",
                 "--batch", "2"]) == 1  # a trace that carries its steps already
    assert "batched already" in capsys.readouterr().err
