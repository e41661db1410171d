"""Trace format, importers of the shared real traces, and locality statistics on hand-made traces."""

import json
from pathlib import Path

import numpy as np
import pytest

from moetier.cli import main
from moetier.plan.route import DECODE
from moetier.trace.format import Trace, TraceError
from moetier.trace.importers import import_trace
from moetier.trace.stats import reuse_distances, reuse_next, summarize

REAL_TRACES = Path(__file__).resolve().parents[2] / "data" / "traces"


def make(ids: list[list[list[int]]], seq=None, num_experts: int = 4, layers=None) -> Trace:
    topk = np.asarray(ids, np.int16)  # [N, L, k]
    n, cols, k = topk.shape
    return Trace("hand-made", cols if layers is None else max(layers) + 1, num_experts, k,
                 list(range(cols)) if layers is None else layers,
                 np.asarray(seq if seq is not None else [0] * n, np.int32), np.arange(n, dtype=np.int32),
                 np.full(n, DECODE, np.uint8), topk, np.ones(topk.shape, np.float16))


def test_round_trip_and_partial_layers(tmp_path):
    t = make([[[0, 1], [2, 3]], [[1, 2], [3, 0]]], layers=[3, 7])
    t.save(tmp_path / "t")
    back = Trace.load(tmp_path / "t")
    assert back.layers == [3, 7] and back.partial and np.array_equal(back.topk_ids, t.topk_ids)
    meta = json.loads((tmp_path / "t" / "meta.json").read_text())
    assert meta["missing_layers"] == [0, 1, 2, 4, 5, 6] and meta["synthetic"] is False


def test_expert_ids_beyond_the_model_shape_are_refused():
    with pytest.raises(TraceError, match="expert id 9 exceeds the model shape"):
        make([[[0, 9]]], num_experts=8)


def test_missing_arrays_and_meta(tmp_path):
    with pytest.raises(TraceError, match="not a trace"):
        Trace.load(tmp_path)
    make([[[0, 1]]]).save(tmp_path / "t")
    (tmp_path / "t" / "pos.npy").unlink()
    with pytest.raises(TraceError, match="missing pos.npy"):
        Trace.load(tmp_path / "t")


def test_reuse_statistics_on_a_known_sequence():
    # one layer, top-1: experts 0 0 1 0 1 1 ; a sequence boundary before the last token
    t = make([[[e]] for e in [0, 0, 1, 0, 1, 1]], seq=[0, 0, 0, 0, 0, 1])
    # t+1 reuse within a sequence: 0->0 yes, 0->1 no, 1->0 no, 0->1 no (5->6 crosses sequences)
    assert reuse_next(t)[0] == pytest.approx(1 / 4)
    counts = reuse_distances(t)  # distances: first(0), 1, first(1), 2, 2, 1
    assert counts[0] == 2 and counts[1] == 2 and counts[-1] == 2 and counts.sum() == 6
    s = summarize(t)
    assert s["experts_used"] == [2] and s["entropy_bits"][0] == pytest.approx(1.0)


def test_next_layer_predictability_sees_a_deterministic_mapping():
    rng = np.random.default_rng(0)
    a = rng.integers(0, 8, 200)
    t = make([[[x], [(x + 3) % 8]] for x in a], num_experts=8)
    assert summarize(t)["next_layer"][0]["recall"] == 1.0


@pytest.mark.parametrize("folder,tokens,layers,top_k,experts", [
    ("mixtral-8x7b", 577, list(range(32)), 2, 8),
    ("qwen1.5-moe-a2.7b", 4357, [0, 8, 12, 18, 23], 4, 60),
    ("olmoe-1b-7b", 4471, [0], 8, 64),
])
def test_real_traces_import(folder, tokens, layers, top_k, experts):
    t = import_trace(REAL_TRACES / folder)
    assert (t.num_tokens, t.layers, t.top_k, t.num_experts) == (tokens, layers, top_k, experts)
    assert not (t.topk_ids == t.topk_ids[0]).all(axis=(1, 2)).all()  # the warm-up pass is gone
    if folder != "mixtral-8x7b":
        assert any("warm-up" in n for n in t.notes)


def test_malformed_line_names_file_and_line(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"type": "meta", "top_k": 2, "model_id": "olmoe-1b-7b"}\n'
                 '{"type": "route", "layer": 0, "topk_ids": [1, 2], "topk_weights": [0.5, 0.5]}\n{oops\n')
    with pytest.raises(TraceError, match=r"bad.jsonl:3: malformed JSON"):
        import_trace(f)
    f.write_text('{"dataset": "x", "problem_id": 0, "layer": 0, "experts": [7, 99], "gating_probs": [0.5, 0.5]}\n')
    with pytest.raises(TraceError, match="token_idx"):
        import_trace(f)


def test_cli_import_and_stats(tmp_path, capsys):
    f = tmp_path / "t.jsonl"
    f.write_text("".join(json.dumps({"dataset": "d", "problem_id": 0, "layer": layer, "experts": [e, 99 if e > 5 else 1],
                                     "gating_probs": [0.5, 0.5], "token_idx": i}) + "\n"
                         for i, e in enumerate([0, 3, 6]) for layer in (0, 1)))
    assert main(["trace", "import", str(f), "--out", str(tmp_path / "t"), "--num-layers", "2",
                 "--num-experts", "8"]) == 1
    assert "expert id 99 exceeds the model shape (8 experts" in capsys.readouterr().err
    f.write_text(f.read_text().replace("99", "2"))
    assert main(["trace", "import", str(f), "--out", str(tmp_path / "t"), "--num-layers", "2",
                 "--num-experts", "8"]) == 0
    assert main(["trace", "stats", str(tmp_path / "t")]) == 0
    assert "reuse t+1" in capsys.readouterr().out and (tmp_path / "t" / "stats.png").exists()


def test_recorder_captures_every_step_with_full_scores(tiny_store, tmp_path):
    import torch

    from moetier import Engine
    from moetier.trace.record import TraceRecorder

    ref, path = tiny_store("qwen2_moe")
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    with Engine.from_pretrained(path, expert_memory="50%") as engine, \
            TraceRecorder(engine, gate_inputs=True) as rec:
        for p in prompts:
            engine.generate([p], max_new_tokens=4, ignore_eos=True)
        trace = rec.trace(["a", "b"])
    assert trace.seq.tolist() == [0] * 8 + [1] * 6  # prompt tokens + 3 decode steps each
    assert trace.pos.tolist() == list(range(8)) + list(range(6))
    assert trace.phase.tolist() == [0] * 5 + [1] * 3 + [0] * 3 + [1] * 3
    assert trace.scores.shape == (14, 2, 8) and trace.gate_inputs.shape == (14, 2, 64)
    # the recorded ids are the reference model's routing of the prompt
    with torch.no_grad():
        out = ref(torch.tensor([prompts[0]]), output_router_logits=True)
    for j, logits in enumerate(out.router_logits):
        expected = torch.topk(logits.softmax(-1), 2, dim=-1).indices
        assert np.array_equal(np.sort(trace.topk_ids[:5, j], -1), np.sort(expected.numpy(), -1))
    trace.save(tmp_path / "t")
    assert Trace.load(tmp_path / "t").gate_inputs is not None


def test_record_cli_bad_prompts_file(tmp_path, capsys):
    assert main(["trace", "record", "--prompts", str(tmp_path / "none.txt"), "--out", str(tmp_path / "t")]) == 1
    assert "cannot read prompts" in capsys.readouterr().err


def test_unknown_format_and_unknown_shape_are_clear(tmp_path):
    f = tmp_path / "x.jsonl"
    f.write_text('{"hello": 1}\n')
    with pytest.raises(TraceError, match="unknown trace format"):
        import_trace(f)
    f.write_text('{"dataset": "d", "problem_id": 0, "layer": 0, "experts": [1, 2], "gating_probs": [0.5, 0.5], '
                 '"token_idx": 0}\n')
    with pytest.raises(TraceError, match="(?s)cannot tell the model shape.*--num-experts"):
        import_trace(f)
    with pytest.raises(TraceError, match="does not exist"):
        import_trace(tmp_path / "nope.jsonl")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TraceError, match="no \\*.jsonl"):
        import_trace(tmp_path / "empty")


def test_synthetic_trace_reproduces_the_fitted_locality(tmp_path, capsys):
    from moetier.trace.synthetic import LocalityFit, fit_locality, generate

    truth = LocalityFit(zipf_s=0.8, p_keep=0.4, reuse_next=0.0, source="hand-made")
    source = generate(truth, 2, 16, 2, 1500, seed=3)
    fit = fit_locality(source)
    assert fit.p_keep == pytest.approx(0.4, abs=0.08) and fit.zipf_s > 0.3
    made = generate(fit, 6, 32, 4, 800, seed=4, model="wide")
    assert made.synthetic and "synthetic" in made.notes[0] and made.topk_ids.shape == (800, 6, 4)
    assert all(len(set(row)) == 4 for row in made.topk_ids[:, 0].tolist())  # k distinct experts per token
    source.save(tmp_path / "src")
    assert main(["trace", "synth", "--fit", str(tmp_path / "src"), "--num-layers", "3", "--num-experts", "8",
                 "--top-k", "2", "--tokens", "300", "--out", str(tmp_path / "syn")]) == 0
    assert Trace.load(tmp_path / "syn").meta()["synthetic"] is True


@pytest.mark.parametrize("num_experts,p_keep", [(64, 0.003), (8, 0.9), (16, 1.0), (128, 0.3)])
def test_a_synthetic_stream_draws_what_numpys_choice_draws(num_experts, p_keep):
    """The stream's own draw without replacement is numpy's `choice(..., replace=False, p=...)` draw for draw: the
    same generator left in the same state, so a trace seeded before it existed is the same trace."""
    from moetier.trace.synthetic import _popularity, _stream, draw_without_replacement

    def by_choice(pop, p_keep, top_k, tokens, rng):  # the stream as it was written with numpy's choice
        ids, prev = np.zeros((tokens, top_k), np.int16), []
        for t in range(tokens):
            keep = min(len(prev), int((rng.random(top_k) < p_keep).sum()))
            chosen = list(rng.choice(prev, keep, replace=False)) if keep else []
            rest = pop.copy()
            rest[chosen] = 0
            chosen += list(rng.choice(len(pop), top_k - keep, replace=False, p=rest / rest.sum()))
            ids[t] = prev = chosen
        return ids

    for seed in range(8):
        ours, theirs = np.random.default_rng(seed), np.random.default_rng(seed)
        pop = _popularity(num_experts, 0.8, ours)
        _popularity(num_experts, 0.8, theirs)
        for top_k in (1, 2, min(8, num_experts // 2)):  # (k = E and all kept: numpy refused a p of 0s)
            assert (_stream(pop, p_keep, top_k, 120, ours) == by_choice(pop, p_keep, top_k, 120, theirs)).all()
        assert ours.random() == theirs.random()
    p = np.array([0.5, 0.0, 0.25, 0.25])  # an index of no weight is never drawn
    assert sorted(draw_without_replacement(np.random.default_rng(0), p.copy(), 3)) == [0, 2, 3]
    with pytest.raises(ValueError, match="fewer non-zero entries"):  # as numpy refuses it
        draw_without_replacement(np.random.default_rng(0), p.copy(), 4)


def test_a_synthetic_switch_trace_has_its_encoder_and_sim_replays_it(tmp_path, capsys):
    """`trace synth --model-shape switch-base-8`: prompts through the encoder's layers beside the generations; `sim`
    replays both, with a predictor over both stacks too."""
    import json

    from moetier.trace.synthetic import LocalityFit, generate

    generate(LocalityFit(0.8, 0.4, 0.0, "hand-made"), 2, 8, 1, 400, seed=3).save(tmp_path / "src")
    assert main(["trace", "synth", "--fit", str(tmp_path / "src"), "--model-shape", "switch-base-8", "--tokens", "12",
                 "--sequences", "3", "--prompt-tokens", "10", "--out", str(tmp_path / "sw")]) == 0
    trace = Trace.load(tmp_path / "sw")
    assert trace.layers == [13, 15, 17, 19, 21, 23] and trace.encoder.layers == [1, 3, 5, 7, 9, 11]
    assert (trace.num_tokens, trace.encoder.num_tokens) == (12, 30) and "prompt tokens" in capsys.readouterr().out
    assert main(["sim", "--trace", str(tmp_path / "sw"), "--profile", "nuc-a500", "--expert-memory", "50%"]) == 0
    whole = json.loads(capsys.readouterr().out)
    assert main(["sim", "--trace", str(tmp_path / "sw"), "--profile", "nuc-a500", "--expert-memory", "50%",
                 "--predictor", "hot", "--prefetch", "ahead"]) == 0
    out = capsys.readouterr()
    assert "set aside" not in out.err  # hot's table covers the encoder's layers too: the prompts are still encoded
    ahead = json.loads(out.out)
    assert ahead["prefetches"]["issued"] > 0 and ahead["ttft_s"] > 0.5 * whole["ttft_s"]


@pytest.mark.parametrize("family", ["deepseek_v3", "gpt_oss", "phimoe", "switch_transformers"])
def test_recorder_on_the_new_families(tiny_store, tmp_path, family):
    """Every family records: decoder-only ones a row per token; Switch a row per decoder token, and its encoder a
    row per prompt token."""
    from moetier import Engine
    from moetier.trace.record import TraceRecorder

    _, path = tiny_store(family)
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    with Engine.from_pretrained(path, expert_memory="50%") as engine, TraceRecorder(engine) as rec:
        engine.generate(prompts, max_new_tokens=4, ignore_eos=True)
        trace = rec.trace(["a", "b"])
    spec = engine.spec
    if spec.encoder_decoder is None:
        assert trace.layers == list(spec.moe_layers) and len(trace.seq) == 8 + 2 * 3
    else:
        enc = spec.encoder_decoder.encoder_layers
        assert trace.layers == [layer for layer in spec.moe_layers if layer >= enc] and trace.partial
        assert trace.seq.tolist() == [0, 1] + [0, 1] * 3 and trace.pos.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
        assert any("encoder" in note for note in trace.notes)
        encoder = trace.encoder  # the prompts' tokens through the encoder's MoE layers
        assert encoder.layers == [layer for layer in spec.moe_layers if layer < enc]
        assert encoder.seq.tolist() == [0] * 5 + [1] * 3 and encoder.pos.tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
        assert trace.all_layers == list(spec.moe_layers) and (encoder.phase == 0).all()
    trace.save(tmp_path / "t")
    loaded = Trace.load(tmp_path / "t")
    assert loaded.topk_ids.shape == trace.topk_ids.shape
    if trace.encoder is not None:
        assert (loaded.encoder.topk_ids == trace.encoder.topk_ids).all() and loaded.encoder.layers == encoder.layers
        first, rest = loaded.split(0.5)  # each part keeps the encoder's rows of the prompts it prefills
        assert first.encoder.seq.tolist() == [0] * 5 + [1] * 3 and rest.encoder.num_tokens == 0
        assert loaded.decoder_only().encoder is None


def test_an_encoder_that_is_not_the_decoders_is_refused():
    """The encoder's table must share the model's layers, experts and top-k, hold prefill rows only, and route layers
    before the decoder's."""
    import dataclasses

    from moetier.trace.format import TraceError
    from moetier.trace.synthetic import LocalityFit, generate_seq2seq

    trace = generate_seq2seq(LocalityFit(0.8, 0.3, 0.0, "hand-made"), 4, 8, 1, 2, [1, 3], 2, 5, 3)
    enc = trace.encoder
    for bad, match in [(dataclasses.replace(enc, num_experts=9), "layers, experts and top-k"),
                       (dataclasses.replace(enc, phase=np.ones_like(enc.phase)), "one prefill row per prompt token"),
                       (dataclasses.replace(enc, layers=[3], topk_ids=enc.topk_ids), "must come before the decoder's")]:
        with pytest.raises(TraceError, match=match):
            dataclasses.replace(trace, encoder=bad)
