"""Every bad input the trust issue lists: one line saying what is wrong, a non-zero exit, no traceback, nothing
echoed or loaded first, and nothing of the user's touched."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from moetier.cli import main
from moetier.plan.route import DECODE
from moetier.store.format import Manifest
from moetier.trace.format import Trace

META = {"type": "meta", "model_id": "allenai/OLMoE-1B-7B-0924", "top_k": 2}


def route(ids, layer=0):
    return {"type": "route", "layer": layer, "topk_ids": ids, "topk_weights": [1 / len(ids)] * len(ids)}


def jsonl(path, *records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def olmoe_trace(tokens=40, seed=0):
    """A hand-made trace of OLMoE's shape (16 layers, top-8 of 64)."""
    rng = np.random.default_rng(seed)
    ids = np.stack([[rng.choice(64, 8, replace=False) for _ in range(16)] for _ in range(tokens)]).astype(np.int16)
    return Trace("olmoe-1b-7b", 16, 64, 8, list(range(16)), np.zeros(tokens, np.int32),
                 np.arange(tokens, dtype=np.int32), np.full(tokens, DECODE, np.uint8), ids,
                 np.full(ids.shape, 1 / 8, np.float16))


@pytest.fixture
def inputs(tiny_store, tmp_path):
    _, store = tiny_store("olmoe")
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (tmp_path / "unread").mkdir()
    (theirs / "thesis.tex").write_text("years of work")
    (tmp_path / "afile").write_text("a file")
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    trace = olmoe_trace().save(tmp_path / "trace")
    truncated = olmoe_trace().save(tmp_path / "truncated")
    data = (truncated / "topk_ids.npy").read_bytes()
    (truncated / "topk_ids.npy").write_bytes(data[:len(data) // 2])
    bad_config = tmp_path / "bad-config"
    bad_config.mkdir()
    config = json.loads((Path(Manifest.load(store).source) / "config.json").read_text())
    (bad_config / "config.json").write_text(json.dumps(dict(config, num_hidden_layers="two")))
    no_manifest = tmp_path / "no-manifest"
    shutil.copytree(store, no_manifest)
    (no_manifest / "manifest.json").unlink()
    return {
        "tmp": tmp_path, "unread": tmp_path / "unread", "store": store, "hf": Path(Manifest.load(store).source),
        "theirs": theirs, "trace": trace,
        "truncated": truncated, "no_manifest": no_manifest, "bad_config": bad_config, "latin1": tmp_path / "latin1.txt",
        "meta_only": jsonl(tmp_path / "meta.jsonl", META),
        "bad_ids": jsonl(tmp_path / "bad.jsonl", META, route("ab")),
        "bool_ids": jsonl(tmp_path / "bool.jsonl", META, route([True, False])),
        "ragged": jsonl(tmp_path / "ragged.jsonl", META, route([1, 2]), route([1, 2, 3])),
    }


def snapshot(path):
    return {p: p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


BAD = [
    # arguments, refused before any model is resolved ({unread}: an empty folder, which --model takes as the options
    # are read; reaching the model would say it holds no config.json)
    (["generate", "--model", "{unread}", "--prompt", "abc\udcff"], "--prompt is not valid UTF-8"),
    (["generate", "--model", "{unread}", "--prompt", "x", "--max-tokens", "0"], "--max-tokens"),
    (["generate", "--model", "{unread}", "--prompt", "x", "--temperature", "-1"], "--temperature"),
    (["generate", "--model", "{unread}", "--prompt", "x", "--top-p", "2"], "--top-p"),
    (["generate", "--model", "{unread}", "--prompt", "x", "--reader-threads", "0"], "--reader-threads"),
    (["generate", "--model", "{unread}", "--prompt", "x", "--expert-memory", "lots"], "cannot read expert memory"),
    (["generate", "--model", "{unread}", "--prompt", "x", "--device", "tpu"], "unknown device 'tpu'"),
    (["generate", "--model", "{unread}"], "no prompt given"),
    (["generate", "--model", "{unread}", "--prompt", ""], "prompt 0 is empty"),
    (["generate", "--model", "{unread}", "--prompt-file", "{tmp}/missing.txt"], "cannot read prompt file"),
    (["generate", "--model", "{unread}", "--prompt-file", "{latin1}"], "is not valid UTF-8"),
    (["trace", "record", "--model", "{unread}", "--prompts", "{latin1}", "--out", "{tmp}/r"], "is not valid UTF-8"),
    (["trace", "record", "--model", "{unread}", "--prompts", "{latin1}", "--out", "{tmp}/r", "--max-tokens", "0"],
     "--max-tokens"),
    # destinations: refused, and nothing of the user's touched
    (["convert", "{hf}", "{tmp}/afile", "--force"], "is a file"),
    (["convert", "{hf}", "{tmp}/afile/store", "--force"], "cannot be created: "),
    (["convert", "{hf}", "{hf}", "--force"], "which this command reads"),
    (["convert", "{hf}", "{hf}/store", "--force"], "is inside"),
    (["convert", "{hf}", "{theirs}", "--force"], "is not a moetier store (it holds thesis.tex)"),
    (["synth", "{theirs}", "--preset", "tiny", "--force"], "is not a moetier store"),
    (["trace", "import", "{ragged}", "--out", "{theirs}", "--force"], "is not a moetier trace"),
    (["trace", "import", "{tmp}", "--out", "{tmp}/out", "--force"], "is inside"),
    (["trace", "synth", "--fit", "{trace}", "--out", "{trace}", "--force", "--model-shape", "olmoe-1b-7b"],
     "which this command reads"),
    # malformed inputs
    (["trace", "import", "{meta_only}", "--out", "{tmp}/t"], "no route records"),
    (["trace", "import", "{bad_ids}", "--out", "{tmp}/t"], "expert ids must be"),
    (["trace", "import", "{bool_ids}", "--out", "{tmp}/t"], "expert ids must be"),
    (["trace", "import", "{ragged}", "--out", "{tmp}/t"], "3 expert ids where earlier records have 2"),
    (["trace", "stats", "{truncated}"], "topk_ids.npy: Failed to read"),
    (["sim", "--trace", "{truncated}", "--profile", "rtx4090"], "topk_ids.npy: Failed to read"),
    (["cache-bench", "--trace", "{truncated}"], "topk_ids.npy: Failed to read"),
    # prediction and prefetch
    (["generate", "--model", "{unread}", "--prompt", "x", "--prefetch", "hobbit"], "needs a predictor"),
    # policies generate cannot run: refused before the model is looked for
    (["generate", "--model", "{unread}", "--prompt", "x", "--policy", "belady"], "belady is the offline optimum"),
    (["generate", "--model", "{unread}", "--prompt", "x", "--policy", "lfu+predicted"], "needs a predictor"),
    (["generate", "--model", "{unread}", "--prompt", "x", "--policy", "nope"], "unknown eviction policy 'nope'"),
    (["sim", "--trace", "{trace}", "--profile", "rtx4090", "--policy", "lru+predicted"], "needs a predictor"),
    (["cache-bench", "--trace", "{trace}", "--policy", "lru+predicted"], "needs a predictor"),
    (["cache-bench", "--trace", "{trace}", "--policy", "nope+predicted", "--predictor", "hot"],
     "unknown policies ['nope+predicted']"),
    (["sim", "--trace", "{trace}", "--profile", "rtx4090", "--prefetch", "hobbit"], "--prefetch needs a predictor"),
    (["sim", "--trace", "{trace}", "--profile", "rtx4090", "--prefetch", "nope", "--predictor", "oracle"],
     "unknown prefetcher 'nope'"),
    (["sim", "--trace", "{trace}", "--profile", "rtx4090", "--prefetch", "hobbit", "--predictor", "stacked-gates"],
     "this trace has none"),
    (["predict-bench", "--trace", "{trace}", "--predictor", "nope"], "unknown predictors ['nope']"),
    (["predict-bench", "--trace", "{trace}", "--predictor", "stacked-gates"], "has no gate inputs"),
    (["predict-bench", "--trace", "{trace}", "--predictor", "hot,smoe-lookahead"], "which a trace does not hold"),
    (["sim", "--trace", "{trace}", "--profile", "rtx4090", "--prefetch", "smoe", "--predictor", "smoe-lookahead"],
     "which a trace does not hold"),
    (["predict-bench", "--trace", "{trace}", "--train-fraction", "2"], "--train-fraction"),
    (["train", "thresholds", "--trace", "{trace}", "--out", ""], "--out is empty"),  # (was a TypeError: the fuzz)
    (["train", "cache-policy", "--policy", "static-hot", "--trace", "{trace}", "--out", ""], "--out is empty"),
    (["sim", "--trace", "{trace}", "--profile", "rtx4090", "--pressure", "10"], "is not STEP:BUDGET"),
    (["sim", "--trace", "{trace}", "--profile", "rtx4090", "--pressure", "-1:10%"], "is not STEP:BUDGET"),
    (["sim", "--trace", "{trace}", "--profile", "rtx4090", "--pressure", "5:10%,5:20%"], "distinct, ascending"),
    (["sim", "--trace", "{trace}", "--profile", "rtx4090", "--pressure", "100000:10%"], "beyond the trace's"),
    (["sim", "--trace", "{trace}", "--profile", "rtx4090", "--pressure", "3:lots"], "lots"),
    (["sim", "--trace", "{trace}", "--profile", "rtx4090", "--shrink", "policy"], "add --pressure"),
    (["train", "predictor", "--predictor", "llapor", "--trace", "{trace}", "--model", "{store}"],
     "has no gate inputs"),
    (["cache-bench", "--trace", "{trace}", "--expert-memory", "1,0.5%"], "no budget in 1,0.5% holds"),
    (["cache-bench", "--trace", "{trace}", "--expert-memory", "25%,lots"], "cannot read the budget 'lots'"),
    (["cache-bench", "--trace", "{trace}", "--train-fraction", "1.5"], "--train-fraction"),
    (["trace", "synth", "--fit", "{trace}", "--out", "{tmp}/s", "--tokens", "0"], "--tokens"),
    (["synth", "{tmp}/s", "--preset", "tiny", "--num-heads", "0"], "--num-heads: must be at least 1"),
    (["convert", "{bad_config}", "{tmp}/s"], "num_hidden_layers must be a positive integer"),
    (["synth", "{tmp}/s", "--inflate", "{store}", "--num-layers", "3"], "--num-layers sets a random model's shape"),
    (["synth", "{tmp}/s", "--expert-intermediate", "64"], "--expert-intermediate sizes an inflated model"),
    (["synth", "{tmp}/s", "--inflate", "{store}", "--expert-intermediate", "8"], "already have intermediate size 48"),
    (["synth", "{theirs}", "--inflate", "{store}", "--force"], "is not a moetier store"),
    (["synth", "{store}/xl", "--inflate", "{store}"], "is inside"),
    (["synth", "{tmp}/s", "--inflate", "/no/such"], "no model at /no/such"),
    # precisions: refused before the model is looked for, or before anything is written
    (["generate", "--model", "{unread}", "--prompt", "x", "--precision", "hobbit", "--thresholds", "high"],
     "--thresholds takes T1,T2"),
    (["generate", "--model", "{unread}", "--prompt", "x", "--precision", "hobbit", "--thresholds", "0.9,0.5"],
     "0 <= T1 <= T2"),
    (["generate", "--model", "{store}", "--prompt", "x", "--precision", "int4"], "moetier quantize"),
    (["quantize", "{store}", "--precisions", "int3"], "unknown or unavailable precision 'int3'"),
    (["convert", "{hf}", "{tmp}/s", "--precisions", "bf16,int4"],
     "unknown or unavailable precision 'bf16' (this store's experts are fp32)"),
    # substitution: refused before the model is looked for
    (["generate", "--model", "{unread}", "--prompt", "x", "--substitute", "lots"],
     "--substitute takes off, auto, similar or a number"),
    (["generate", "--model", "{unread}", "--prompt", "x", "--substitute", "1.5"], "must be within [0, 1)"),
    (["generate", "--model", "{unread}", "--prompt", "x", "--tpot-budget", "fast"], "'fast' is not a duration"),
    (["generate", "--model", "{unread}", "--prompt", "x", "--tpot-budget", "0ms"], "must be positive"),
    (["generate", "--model", "{unread}", "--prompt", "x", "--tpot-budget", "80ms", "--substitute", "0.3"],
     "--tpot-budget chooses alpha itself"),
    (["eval", "--model", "{unread}", "--sweep", "alpha=0,big"], "--sweep alpha: 'big' is not a number"),
    (["generate", "--model", "{unread}", "--prompt", "x", "--substitute", "similar", "--tpot-budget", "80ms"],
     "--substitute similar takes the replaced expert's weight"),
    (["eval", "--model", "{unread}", "--substitute", "similar", "--sweep", "alpha=0.1"],
     "--substitute similar has no alpha"),
    (["generate", "--model", "{store}", "--prompt", "x", "--substitute", "similar"], "moetier train similarity"),
    (["generate", "--model", "{store}", "--prompt", "x", "--offload", "encoder"], "this model is a decoder alone"),
    (["merge", "--model", "{store}", "--ratio", "0.5", "--scope", "encoder", "--out", "{tmp}/m"],
     "merges an encoder-decoder's encoder"),
    (["eval", "--model", "{unread}", "--sweep", "policy=lru,nope"], "nope"),
    # stores
    (["generate", "--model", "{no_manifest}", "--prompt", "x"], "looks like a moetier store but has no manifest"),
    (["generate", "--model", "{store}", "--prompt", "x", "--reconvert"], "is a converted store"),
]


@pytest.mark.parametrize("args,message", BAD, ids=[" ".join(a[:2]) + f" [{m[:24]}]" for a, m in BAD])
def test_bad_input_one_line_error_non_zero_exit(inputs, capsys, args, message):
    before = snapshot(inputs["tmp"])
    args = [a.format(**inputs) for a in args]
    assert main(args) == 1
    out, err = capsys.readouterr()
    assert message in err and "Traceback" not in err
    assert err.startswith("moetier: error: ") and err.count("moetier: error") == 1
    assert out == ""  # no prompt echoed, no partial output
    assert snapshot(inputs["tmp"]) == before  # nothing written, nothing removed


def test_convert_force_on_the_source_and_on_a_foreign_folder_leaves_both_untouched(inputs):
    hf, theirs = inputs["hf"], inputs["theirs"]
    before = snapshot(hf.parent), snapshot(theirs)
    assert main(["convert", str(hf), str(hf), "--force"]) == 1
    assert main(["convert", str(hf), str(theirs), "--force"]) == 1
    assert main(["trace", "import", str(inputs["ragged"]), "--out", str(theirs), "--force"]) == 1
    assert (snapshot(hf.parent), snapshot(theirs)) == before


def test_force_replaces_a_store_moetier_made(inputs, tmp_path):
    out = tmp_path / "replaced"
    assert main(["convert", str(inputs["hf"]), str(out)]) == 0
    first = (out / "manifest.json").stat().st_mtime_ns
    assert main(["convert", str(inputs["hf"]), str(out)]) == 1  # without --force: refused
    assert main(["convert", str(inputs["hf"]), str(out), "--force"]) == 0
    assert (out / "manifest.json").stat().st_mtime_ns != first
    assert [p for p in os.listdir(tmp_path) if p.startswith(".")] == []


def test_broken_pipe_exits_quietly():
    """`moetier generate | head -c 5`: the reader leaves; moetier stops with no traceback."""
    p = subprocess.Popen([sys.executable, "-m", "moetier.cli", "generate", "--prompt", "The sea was",
                          "--max-tokens", "200", "--ignore-eos"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout.read(5) == b"The s"
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 141  # 128 + SIGPIPE, as a shell reports `yes | head`
    assert "Traceback" not in err and "Error" not in err



def test_every_learned_policy_without_its_file_is_refused_alike(tmp_path):
    from moetier.cache.policies import LEARNED, PolicyContext
    from moetier.errors import MoetierError
    from moetier.policy_files import make_policy_for_model

    messages = {}
    ctx = PolicyContext(8, (0, 1), 8, 2)
    for model_dir in (tmp_path, None):
        for name in LEARNED:
            with pytest.raises(MoetierError) as e:
                make_policy_for_model(name, ctx, model_dir)
            messages.setdefault(model_dir, set()).add(str(e.value).replace(name, "NAME"))
    assert all(len(m) == 1 for m in messages.values()), messages
    assert "is a learned policy and has no trained file" in next(iter(messages[tmp_path]))
