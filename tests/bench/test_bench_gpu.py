"""bench/gpu/bench_gpu.py stays runnable where it matters, on the GPU machine: here on the CPU (`--device cpu`), a
small synthetic shape through every kind of row a GPU run makes — lru at a share and at 100%, the modes (the
oracle handed the lru run's routing), `--kernels torch` — each a measured row, none an error; accelerate's first. (Every 100% row of
the next GPU run would have failed on a route log the engine no longer took: found here first.)"""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu" / "bench_gpu.py"


def test_every_row_kind_measures_on_the_cpu(tmp_path):
    r = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path / "out"), "--models", "small-synth",
                        "--device", "cpu", "--cache", str(tmp_path / "cache"), "--budgets", "50%,100%",
                        "--batch", "1", "--modes", "prefetch-oracle,cpu-offload,hobbit,prefetch-hobbit-fifo,comoe",
                        "--mode-budget", "50%",
                        "--kernel-budgets", "100%", "--disk-budgets=", "--tokens", "3", "--warmup", "2",
                        "--no-process-warmup", "--accelerate", "small-synth:50%"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads((tmp_path / "out" / "rows.json").read_text())["rows"]
    # accelerate's row first (a deadline cuts the last rows): measured, or where accelerate is not installed (CI) an
    # error row of its own, the rows going on after it
    first, rows = rows[0], rows[1:]
    assert first["engine"] == "accelerate" and ("tpot_s" in first or "accelerate" in first["error"]), first
    assert not [row for row in rows if "error" in row], rows
    got = {(row["mode"], row["budget"]) for row in rows}
    assert got == {("lru", "50%"), ("lru", "100%"), ("prefetch-oracle", "50%"), ("cpu-offload", "50%"),
                   ("hobbit", "50%"), ("prefetch-hobbit-fifo", "50%"), ("torch-kernels", "100%"), ("comoe", "50%")}
    # every mode evicts by LRU as the first GPU runs did, but the default policy's own row
    assert {row["mode"] for row in rows if row["policy"] != "lru"} == {"comoe"}
    # (HOBBIT's low copies added to the store; the mode as the engine resolved it, for sim_check.py)
    assert [row["precision"]["cached"] for row in rows if row["mode"] == "hobbit"] == ["by-gate"]
    assert all(row["tpot_s"] > 0 for row in rows)
    assert all(row["graphs"] is None for row in rows)  # (--graph-budgets' rows record what the graphs did)
    # what the stages that weigh time heard (sim_check.py's to compare): a layer's dense part, an expert and a read
    # timed in every row that loaded; nothing where every expert was resident (ResidentLayers times nothing)
    assert all(0 < row["costs"][k] < 1 for row in rows if row["budget"] == "50%"
               for k in ("dense_s", "expert_s", "read_s")), rows
    assert all(row["costs"]["dense_s"] is None for row in rows if row["budget"] == "100%"), rows
    assert [row["costs"]["host_s_1"] is not None for row in rows if row["mode"] == "cpu-offload"] == [True]


def test_a_models_entry_names_its_rows_or_is_its_own_name():
    """LABEL=SOURCE (a GGUF file's rows named as llama.cpp's on the same file); a bare entry is both."""
    sys.path.insert(0, str(SCRIPT.parent))
    from bench_gpu import label_and_source

    assert label_and_source("olmoe-synth") == ("olmoe-synth", "olmoe-synth")
    assert label_and_source("olmoe-synth Q4_K_M=/c/olmoe-synth-hf.q4_k_m.gguf") == (
        "olmoe-synth Q4_K_M", "/c/olmoe-synth-hf.q4_k_m.gguf")
