"""bench/peers/compare.py's prefill setting: llama-bench's pp test beside moetier's prefill of as many tokens, the
harness's prefills (random ids, warmed) and a user's first one (`moetier generate --prompt-file`)."""

import json
import subprocess
import sys
from pathlib import Path

import torch

from tests.bench.test_peers_pairs import SCRIPT, load_compare
from tests.tiny_models import build_tiny

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "models" / "demo-fine"


def test_a_prefill_row_is_resident_and_asks_llama_bench_for_its_pp_test(tmp_path):
    compare = load_compare()
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"0" * 100)
    rows = compare.rows_of(["q4_k_m"], ["resident", "prefill", "35"], {"q4_k_m": gguf}, prompt_tokens=64)
    assert [r["setting"] for r in rows] == ["resident", "prefill 64", "35% cap"]
    assert rows[1]["cap_bytes"] is None and rows[1]["prompt_tokens"] == 64 and "prompt_tokens" not in rows[0]
    import llamacpp

    argv = llamacpp.LlamaCpp(Path("tree")).bench_argv(gguf, 0, 2, repetitions=3, load="none", prompt=64)
    assert argv[argv.index("-p") + 1] == "64" and argv[argv.index("-n") + 1] == "0"
    seen = {}

    class FakeLlama:
        def bench_argv(self, gguf, tokens, threads, repetitions, load, prompt=0):
            seen.update(tokens=tokens, prompt=prompt)
            rows = [{"avg_ts": 80.0, "samples_ts": [60.0, 80.0, 90.0], "build_commit": "x"}]
            return [sys.executable, "-c", f"print({json.dumps(json.dumps(rows))})"]

    r = compare.llama_run(FakeLlama(), gguf, None, 32, 2, 60, repetitions=3, prompt=64)
    assert seen == {"tokens": 0, "prompt": 64} and r["tok_s"] == 85.0


def test_the_harness_times_prefills_of_new_prompts_after_a_warm_one(tmp_path):
    load_compare()  # (bench/peers on the path)
    import moetier_run

    model = tmp_path / "tiny"
    build_tiny("olmoe", model, dtype=torch.bfloat16)
    r = moetier_run.run(dict(store=str(model), budget="100%", preload=True, prompt_tokens=24, repetitions=2,
                             tokens=4))
    assert len(r["samples_tok_s"]) == 2 and all(t > 0 for t in r["samples_tok_s"]) and r["prompt_tokens"] == 24
    assert r["tok_s"] == sum(r["samples_tok_s"]) / 2  # (the median of two)
    assert "tpot_s" not in r  # (nothing decoded is timed)


def test_a_users_row_is_its_first_prefill_of_the_prompt_file(tmp_path):
    compare = load_compare()
    prompt = compare.prompt_text(DEMO / "tokenizer.json", 40, tmp_path / "prompt.txt")
    r = compare.user_run(DEMO, ("native", "native", "native"), 4, 300, prompt_file=prompt)
    assert "error" not in r, r
    # (a demo tokenizer may merge across the cut: the count the engine saw, not the one asked for)
    assert 36 <= r["prompt_tokens"] <= 40 and abs(r["tok_s"] - r["prompt_tokens"] / r["ttft_s"]) < 1e-6
    assert "--prompt-file" in r["command"] and "--max-tokens 1" in r["command"]


def test_a_setting_it_does_not_know_is_refused_in_one_line_before_anything_runs(tmp_path):
    for caps, said in (("resident,prefil", "prefil"), ("resident,0", "'0'"), ("150", "150")):
        r = subprocess.run([sys.executable, str(SCRIPT), "--formats", "q4_k_m", "--caps", caps, "--out",
                            str(tmp_path / "out")], capture_output=True, text=True, timeout=60)
        assert r.returncode == 1 and said in r.stderr and "known: resident, prefill" in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()
    r = subprocess.run([sys.executable, str(SCRIPT), "--caps", "prefill", "--prompt-tokens", "0"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "--prompt-tokens" in r.stderr
