"""bench/repro's harness: a claim agrees when both sides point the same way; one simulated configuration is a row of
the replay's summary; the report writes its table, JSON and plot."""

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "repro"))
from harness import Claim, Config, report, shape_of, simulate  # noqa: E402

from moetier.trace.format import Trace  # noqa: E402


def test_a_claim_agrees_when_both_sides_point_the_same_way():
    assert Claim("Fig. 1", "x", 3.2, 2.1).agrees  # both faster: magnitude is not the bar
    assert Claim("Fig. 1", "x", 0.8, 0.95).agrees
    assert Claim("Fig. 1", "x", 1.005, 0.995).agrees  # both no change (within 1%)
    assert not Claim("Fig. 1", "x", 1.05, 0.97).agrees
    assert not Claim("Fig. 1", "x", 1.01, 0.93).agrees


def test_a_claim_is_in_band_within_2x_of_the_papers_ratio_or_within_its_range():
    """Direction alone let 6.0x stand for the paper's 1.57x: the band is the magnitude's bar beside it."""
    assert Claim("Fig. 1", "x", 1.57, 3.0).in_band and not Claim("Fig. 1", "x", 1.57, 6.0).in_band
    assert Claim("Fig. 1", "x", 1.57, 6.0).agrees  # the same way round, far off
    assert not Claim("Fig. 1", "x", 3.21, 1.5).in_band and Claim("Fig. 1", "x", 3.21, 1.7).in_band
    ranged = Claim("Fig. 1", "x", 1.19, 1.7, band=(1.19, 1.57))  # the paper's own range: 1.19-1.57x
    assert not ranged.in_band and ranged.bounds == (1.19, 1.57) and Claim("F", "x", 1.19, 1.5, band=(1.19, 1.57)).in_band
    at_least = Claim("Fig. 12", "x", 1.65, 1.04, band=(1.65, float("inf")))  # "at least 1.65x"
    assert not at_least.in_band and Claim("Fig. 12", "x", 1.65, 5.0, band=(1.65, float("inf"))).in_band
    import pytest

    with pytest.raises(ValueError, match="ratios are positive"):
        Claim("Fig. 1", "x", 2.0, 0.0)
    with pytest.raises(ValueError, match="must hold the paper's"):
        Claim("Fig. 1", "x", 2.0, 1.0, band=(1.0, 1.5))


def tiny_trace(shape, tokens=40, seqs=4):
    rng = np.random.default_rng(0)
    layers = list(shape.moe_layers)
    ids = np.stack([[rng.choice(shape.num_experts, shape.top_k, replace=False) for _ in layers]
                    for _ in range(tokens)]).astype(np.int16)
    seq = np.repeat(np.arange(seqs), tokens // seqs).astype(np.int32)
    pos = np.tile(np.arange(tokens // seqs), seqs).astype(np.int32)
    return Trace(shape.name, shape.num_layers, shape.num_experts, shape.top_k, layers, seq, pos,
                 np.ones(tokens, np.uint8), ids, np.full(ids.shape, 1 / shape.top_k, np.float16))


def test_simulate_gives_the_replays_summary_and_batches_interleave(tmp_path):
    shape = shape_of("mixtral-8x7b", "fp16")
    trace = tiny_trace(shape)
    one = simulate(trace, shape, "a100-pcie4", "25%", Config("lru"))
    four = simulate(trace, shape, "a100-pcie4", "25%", Config("lru"), batch=4)
    assert one["batch"] == 1 and four["batch"] == 4 and four["interleaved"] == 4
    assert four["decode_tokens_per_s"] > one["decode_tokens_per_s"]  # one read serves the batch's tokens
    pre = simulate(trace, shape, "a100-pcie4", "25%", Config("lru", "hobbit", predictor="oracle"))
    assert pre["prefetches"]["issued"] > 0
    path = report("t", "test", [one, four], [Claim("Fig. 1", "x", 2.0, 1.5, "s")], out=tmp_path)
    written = json.loads(path.read_text())
    assert written["claims"][0]["agrees"] and (tmp_path / "t.png").exists() and (tmp_path / "t.md").exists()
    assert written["claims"][0]["in_band"] and "| yes (1.00–4.00×) |" in (tmp_path / "t.md").read_text()
