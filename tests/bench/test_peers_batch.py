"""bench/peers/compare.py's batch setting: llama-batched-bench (B sequences decoded together) beside moetier
decoding B prompts together, each engine's decode tokens/s over all the sequences."""

import json
import subprocess
import sys
from pathlib import Path

import torch

from tests.bench.test_peers_pairs import SCRIPT, load_compare
from tests.tiny_models import build_tiny


def test_a_batch_row_per_size_is_resident_and_asks_llama_batched_bench_for_that_many_sequences(tmp_path):
    compare = load_compare()
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"0" * 100)
    rows = compare.rows_of(["q4_k_m"], ["resident", "batch"], {"q4_k_m": gguf}, batches=(2, 8))
    assert [r["setting"] for r in rows] == ["resident", "batch 2", "batch 8"]
    assert rows[2]["batch"] == 8 and rows[2]["cap_bytes"] is None and "batch" not in rows[0]
    import llamacpp

    argv = llamacpp.LlamaCpp(Path("tree")).batched_argv(gguf, 4, 32, 2)
    assert Path(argv[0]).name == "llama-batched-bench"
    assert [argv[argv.index(f) + 1] for f in ("-npl", "-ntg", "-npp", "-lm", "--output-format")] == \
        ["4", "32", "16", "none", "jsonl"]
    assert int(argv[argv.index("-c") + 1]) >= 4 * (16 + 32)  # (every sequence's context fits)

    class FakeLlama:  # what llama-batched-bench prints: logs, then one JSON line a configuration
        def batched_argv(self, gguf, sequences, tokens, threads):
            line = json.dumps({"pp": 16, "tg": tokens, "pl": sequences, "t_tg": 1.5, "speed_tg": 42.5})
            return [sys.executable, "-c", f"print('main: n_kv_max = 800'); print({json.dumps(line)})"]

    r = compare.llama_batched_run(FakeLlama(), gguf, 4, 32, 2, 60)
    assert r["tok_s"] == 42.5 and r["sequences"] == 4 and r["tokens"] == 32


def test_the_harness_decodes_a_batch_and_counts_every_sequences_tokens(tmp_path):
    load_compare()  # (bench/peers on the path)
    import moetier_run

    model = tmp_path / "tiny"
    build_tiny("olmoe", model, dtype=torch.bfloat16)
    one = moetier_run.run(dict(store=str(model), budget="100%", preload=True, tokens=4, warmup_tokens=2))
    three = moetier_run.run(dict(store=str(model), budget="100%", preload=True, tokens=4, warmup_tokens=2, batch=3))
    assert one["batch"] == 1 and three["batch"] == 3
    assert abs(three["tok_s"] - 3 / three["tpot_s"]) < 1e-9 and abs(one["tok_s"] - 1 / one["tpot_s"]) < 1e-9


def test_a_batch_size_that_is_not_a_count_is_refused_before_anything_runs():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--caps", "batch", "--batch", "2,x"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0 and "--batch" in proc.stderr and "Traceback" not in proc.stderr


def test_a_build_made_before_a_tool_was_added_builds_that_tool_alone(tmp_path, monkeypatch):
    """A cache whose llama.cpp was built before llama-batched-bench was a target: the finished build is kept and the
    tools it lacks are built into it (cmake builds what is missing: seconds), not fetched and built again."""
    load_compare()
    import llamacpp

    home = llamacpp.home(tmp_path)
    (home / "llama.cpp" / "build" / "bin").mkdir(parents=True)
    (home / "built").write_text(llamacpp.VERSION)
    for tool in ("llama-bench", "llama-perplexity", "llama-quantize"):  # (the targets before)
        (home / "llama.cpp" / "build" / "bin" / tool).write_text("")
    calls = []
    monkeypatch.setattr(llamacpp, "fetch_source", lambda *a, **k: calls.append("fetch"))
    monkeypatch.setattr(llamacpp, "compile_tree", lambda tree, isa, log=print, added=False: calls.append((isa, added)))
    llamacpp.build(tmp_path, log=lambda *a: None)
    assert calls == [("native", True)]
