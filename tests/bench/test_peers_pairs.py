"""bench/peers/compare.py --pairs: each round's ratio pairs the two engines of that round (not the medians of a
row, which on a host whose memory speed moves can pair a fast run with a slow one)."""

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "peers" / "compare.py"


def load_compare():
    spec = importlib.util.spec_from_file_location("peers_compare", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["peers_compare"] = module
    spec.loader.exec_module(module)
    return module


def run(fmt, engine, rnd, tok_s):
    return dict(format=fmt, setting="resident", engine=engine, round=rnd, tok_s=tok_s)


def test_each_round_pairs_its_own_two_runs(tmp_path):
    compare = load_compare()
    # round 0 on a fast host, round 1 on a slow one: the medians (15 vs 15) would say 1.0, the rounds 0.9 and 0.9
    done = {"meta": {"threads": 2, "cpu": {"model": "test"}},
            "runs": [run("bf16", "llama.cpp", 0, 20.0), run("bf16", "native", 0, 18.0),
                     run("bf16", "llama.cpp", 1, 10.0), run("bf16", "native", 1, 9.0),
                     run("q4_k_m", "llama.cpp", 0, 40.0), dict(run("q4_k_m", "int4", 0, 0), error="killed")]}
    del done["runs"][-1]["tok_s"]  # (a failed run has no speed: its round has no ratio)
    ratios = compare.round_ratios(done)
    assert ratios == {("bf16", "resident", "native"): [0.9, 0.9]}
    md = compare.plot_pairs({"a-run": done}, tmp_path / "pairs.png", "title")
    assert "0.90 0.90 (**0.90**)" in md and (tmp_path / "pairs.png").stat().st_size > 0


def test_every_repetition_is_kept_and_a_row_says_its_spread_and_its_load(tmp_path):
    import json

    compare = load_compare()

    class FakeLlama:
        def bench_argv(self, gguf, tokens, threads, repetitions, load, prompt=0):
            rows = [{"avg_ts": 9.0, "samples_ts": [5.0, 10.0, 12.0][:repetitions], "build_commit": "x"}]
            return [sys.executable, "-c", f"print({json.dumps(json.dumps(rows))})"]

    r = compare.llama_run(FakeLlama(), tmp_path / "m.gguf", None, 8, 2, 60, repetitions=3)
    assert r["samples_tok_s"] == [5.0, 10.0, 12.0] and r["tok_s"] == 11.0  # (the first warms: left out)
    load = {"foreign_cores": 0.9, "under_load": True}
    runs = [dict(run("bf16", "llama.cpp", 0, 11.0), samples_tok_s=[5.0, 10.0, 12.0], load=load),
            dict(run("bf16", "llama.cpp", 1, 13.0), samples_tok_s=[6.0, 13.0, 13.0], load={"under_load": False}),
            dict(run("bf16", "native", 0, 14.0), load={"under_load": False}),
            dict(run("bf16", "native", 1, 15.0), load={"under_load": False})]
    rows = [dict(format="bf16", setting="resident", cap_bytes=None, gguf_bytes=1)]
    summary = {s["engine"]: s for s in compare.summarize(rows, runs)}
    assert summary["llama.cpp"]["tok_s"] == 12.0 and summary["llama.cpp"]["spread_tok_s"] == [5.0, 13.0]
    assert summary["llama.cpp"]["under_load"] and not summary["native"]["under_load"]
    assert summary["native"]["ratio"] == 14.5 / 12.0
    text = compare.table(list(summary.values()))
    assert "12.00*" in text and "5.00–13.00" in text and "kept although another process" in text
    assert "(5.00–13.00)" in compare.markdown(list(summary.values()))


def test_only_the_copies_the_modes_read_are_built():
    compare = load_compare()
    assert compare.copies_needed(["bf16"]) == []
    assert compare.copies_needed(["q8_0", "q4_k_m"]) == ["int2", "int4", "int8"]
    compare.MODES["q4_k_m"] = [m for m in compare.MODES["q4_k_m"] if m[0] == "int4"]  # (--modes int4)
    assert compare.copies_needed(["q4_k_m"]) == ["int4"]


def test_the_avx2_row_holds_llama_cpp_to_avx2_too():
    load_compare()  # puts bench/peers on the path
    import llamacpp

    native, avx2 = llamacpp.LlamaCpp(Path("tree")), llamacpp.LlamaCpp(Path("tree"), "avx2")
    assert native.bin == Path("tree/build/bin") and avx2.bin == Path("tree/build-avx2/bin")
    flags = llamacpp.ISAS["avx2"]
    assert "-DGGML_NATIVE=OFF" in flags and "-DGGML_AVX2=ON" in flags
    assert {"-DGGML_AVX512=OFF", "-DGGML_AVX512_BF16=OFF", "-DGGML_AMX_INT8=OFF"} <= set(flags)
    with pytest.raises(ValueError, match="avx9"):
        llamacpp.LlamaCpp(Path("tree"), "avx9")
