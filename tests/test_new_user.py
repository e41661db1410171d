"""What a new user met going wrong (issue 28's "found wrong" list), each held by a test that failed before the fix:
one line, exit status 1, nothing built or half-written first."""

import json
import os
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from moetier import resolve
from moetier.atomic import target_lock
from moetier.cli import main
from moetier.cli.models import model_shape
from moetier.store import inflate as inflate_module
from moetier.store.convert import convert
from moetier.store.store import Store
from moetier.trace.format import Trace
from moetier.trace.importers import WARMUP_MIN_RUN, import_trace
from tests.faults import moetier, run_with_mounts
from tests.test_cli_inputs import olmoe_trace
from tests.tiny_models import build_tiny

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "tiny"
    build_tiny("olmoe", path)
    return path


@pytest.fixture
def tiny_builtin(hf, tmp_path, monkeypatch):
    """`tiny` a built-in model and `tiny-xl` its inflation (twice the tiny fp32 experts), with an empty cache."""
    shutil.copytree(hf, tmp_path / "models" / "tiny")
    monkeypatch.setattr(resolve, "BUILTIN_DIR", tmp_path / "models")
    monkeypatch.setattr(inflate_module, "OLMOE_EXPERT_BYTES", 3 * 96 * 64 * 4)
    cache = tmp_path / "cache"
    monkeypatch.setenv("MOETIER_CACHE", str(cache))
    return cache


def cache_entries(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir()) if cache.exists() else []


# 1. a shape needs only config.json: naming an -xl model builds nothing, and a sweep is checked whole first


def test_the_shape_of_an_xl_model_is_read_without_building_it(tiny_builtin):
    shape, blob = model_shape("tiny-xl")
    assert cache_entries(tiny_builtin) == []  # nothing converted, nothing inflated
    built = Store(resolve.resolve_model("tiny-xl", progress=False))  # what the engine would build
    assert shape.moe_intermediate_size == built.spec.moe_intermediate_size == 96
    assert blob == built.native_layout.blob_bytes
    assert model_shape("tiny") == (shape.__class__.from_spec(Store(resolve.resolve_model("tiny", progress=False))
                                                             .spec, "tiny", "fp32"), blob // 2)


def test_a_sim_sweep_is_refused_whole_before_any_cell_runs_or_anything_is_built(tiny_builtin, tmp_path, monkeypatch,
                                                                                capsys):
    from moetier.sim import sweep

    trace = olmoe_trace().save(tmp_path / "trace")
    ran = []
    monkeypatch.setattr(sweep, "run", lambda *a, **k: ran.append(a))
    args = ["sim", "--trace", str(trace), "--profile", "rtx4090", "--model-shape", "olmoe-1b-7b", "--out",
            str(tmp_path / "sweep")]
    assert main([*args, "--expert-memory", "10%,25%,1MiB"]) == 1  # the last cell holds no top-k: none runs
    assert "one layer's top-8 needs 8" in capsys.readouterr().err and ran == [] and not (tmp_path / "sweep").exists()
    assert main([*args, "--expert-memory", "10%,25%", "--policy", "lru,static-hot"]) == 1  # no trained file
    assert "static-hot is a learned policy" in capsys.readouterr().err and ran == []
    # a trace of another shape than the -xl model's is refused, and nothing is built to find out
    assert main(["sim", "--trace", str(trace), "--profile", "rtx4090", "--model-shape", "tiny-xl"]) == 1
    assert "top-8 of 64 experts" in capsys.readouterr().err and cache_entries(tiny_builtin) == []


# 2. a prompt beyond the context window: refused before anything loads, nothing of it printed


def test_a_prompt_beyond_the_context_window_is_refused_before_loading_and_not_echoed(tmp_path):
    long = tmp_path / "long.txt"
    long.write_text("word " * 3000)  # demo-fine's window is 1024 tokens
    cache = tmp_path / "cache"
    r = subprocess.run(moetier("generate", "--prompt-file", str(long), "--cache-dir", str(cache)),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stdout == ""
    assert re.fullmatch(r"moetier: error: prompt 0 has \d+ tokens; the model's context window is 1024\n  hint: .*\n",
                        r.stderr)
    assert cache_entries(cache) == []  # nothing converted


# 3. argparse's own refusals: one line and a hint, status 1, naming the option


@pytest.mark.parametrize("args,message", [
    (["generate", "--max-tokens", "abc"], "argument --max-tokens: invalid int value: 'abc'"),
    (["generate", "--precision", "int3"], "argument --precision: invalid choice: 'int3'"),
    (["generate", "--predictor", "nonsense"], "argument --predictor: invalid choice: 'nonsense'"),
    (["generate", "--nonsense"], "unrecognized arguments: --nonsense"),
    (["sim"], "the following arguments are required: --trace"),
    ([], "the following arguments are required: command"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
])
def test_argparse_refusals_are_one_line_with_status_1(capsys, args, message):
    assert main(args) == 1
    err = capsys.readouterr().err
    assert message in err and "usage:" not in err
    assert re.fullmatch(r"moetier: error: [^\n]+\n  hint: `moetier[a-z -]*--help` lists the options\n", err), err


def test_a_value_starting_with_a_dash_reaches_its_own_check(capsys, tmp_path):
    assert main(["generate", "--model", str(tmp_path), "--prompt", "x", "--expert-memory", "-5%"]) == 1
    err = capsys.readouterr().err
    assert "expert memory share must be in (0%, 100%], got -5%" in err and "hint: --expert-memory takes" in err
    assert main(["generate", "--model", str(tmp_path), "--prompt", "x", "--max-tokens", "-3"]) == 1
    assert "--max-tokens" in capsys.readouterr().err
    assert main(["generate", "--temperature", "-0.5"]) == 1  # a value, refused by its own range, in one line
    assert "argument --temperature: must be a finite number between 0 and 100, got -0.5" in capsys.readouterr().err
    for value in ("nan", "inf", "-inf"):
        assert main(["generate", "--top-p", value]) == 1
        assert "argument --top-p: must be a finite number" in capsys.readouterr().err
    assert main(["generate", "--seed", "-1"]) == 1  # a seed is a whole number of at least 0
    assert "argument --seed: must be between 0 and" in capsys.readouterr().err


# 4. trace stats on a read-only trace: the table printed, the plot a warning


def test_trace_stats_on_a_read_only_trace_prints_the_table_and_warns(tmp_path):
    trace = olmoe_trace().save(tmp_path / "trace")
    r = run_with_mounts(moetier("trace", "stats", str(trace)), read_only=(trace,))
    assert r.returncode == 0, r.stderr
    assert "reuse t+1" in r.stdout and "Traceback" not in r.stderr
    assert r.stderr == f"moetier: warning: cannot write the plot {trace / 'stats.png'}: Read-only file system\n"
    assert sorted(p.name for p in trace.iterdir()) == sorted(p.name for p in olmoe_trace().save(
        tmp_path / "again").iterdir())  # nothing written, nothing half-written


def test_a_plot_that_cannot_be_written_leaves_the_results(tmp_path, monkeypatch, capsys):
    """The same without a mount: the plot's folder refuses (any machine)."""
    from moetier.trace import stats

    def refuse(trace, summary, path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(stats, "plot", refuse)
    trace = olmoe_trace().save(tmp_path / "trace")
    assert main(["trace", "stats", str(trace), "--json"]) == 0
    out, err = capsys.readouterr()
    assert "next_layer" in json.loads(out) and "cannot write the plot" in err


# 5. a read-only cache: works if it holds what is needed, else one line


def test_a_read_only_cache_holding_the_model_works_and_one_without_says_so(tmp_path):
    cache = tmp_path / "cache"
    run = ("generate", "--prompt", "The sea", "--max-tokens", "2", "--cache-dir", str(cache))
    r = subprocess.run(moetier(*run), capture_output=True, text=True, timeout=300)  # converts demo-fine
    assert r.returncode == 0, r.stderr
    before = {p: p.stat().st_mtime_ns for p in cache.rglob("*")}
    r = run_with_mounts(moetier(*run), read_only=(cache,))
    assert r.returncode == 0 and r.stdout.startswith("The sea"), r.stderr
    r = run_with_mounts(moetier(*run, "--model", "demo-coarse"), read_only=(cache,))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert re.fullmatch(r"moetier: error: cannot write demo-coarse-\w+ into the cache \S+: it is on a read-only file "
                        r"system\n  hint: point --cache-dir \(or \$MOETIER_CACHE\) at a folder you can write\n",
                        r.stderr), r.stderr
    assert {p: p.stat().st_mtime_ns for p in cache.rglob("*")} == before


# 6. --reader-threads is bounded


def test_reader_threads_are_bounded_before_anything_starts(capsys, tmp_path):
    assert main(["generate", "--model", str(tmp_path), "--prompt", "x", "--reader-threads", "100000"]) == 1
    assert "--reader-threads must be between 1 and 64, got 100000" in capsys.readouterr().err
    assert main(["calibrate", "--reader-threads", "0"]) == 1
    assert "--reader-threads must be between 1 and 64" in capsys.readouterr().err


# 8. a store is readable by whoever may read its folder: every file at the umask's mode


@pytest.mark.parametrize("mask", [0o022, 0o027])
def test_every_file_of_a_store_gets_the_umasks_mode(hf, tmp_path, mask):
    old = os.umask(mask)
    try:
        store = convert(hf, tmp_path / "store", progress=False, copy=True)  # (the most files and folders)
    finally:
        os.umask(old)
    modes = {p.relative_to(store).as_posix(): p.stat().st_mode & 0o777 for p in store.rglob("*")}
    assert modes["dense.safetensors"] == 0o666 & ~mask
    assert {m for p, m in modes.items() if (store / p).is_file()} == {0o666 & ~mask}
    assert {m for p, m in modes.items() if (store / p).is_dir()} == {0o777 & ~mask}
    assert store.stat().st_mode & 0o777 == 0o777 & ~mask


# 9. trace import drops a warm-up pass only where there is one, and says what it dropped


def vllm_file(path: Path, records: list[list[int]]) -> Path:
    lines = [{"type": "meta", "model_id": "allenai/OLMoE-1B-7B-0924", "top_k": 2}]
    lines += [{"type": "route", "layer": 0, "topk_ids": ids, "topk_weights": [0.5, 0.5]} for ids in records]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_trace_import_keeps_every_record_of_a_file_without_warm_up(tmp_path):
    rng = np.random.default_rng(0)
    real = [sorted(rng.choice(64, 2, replace=False).tolist()) for _ in range(50)]
    real[1] = real[0]  # two tokens routed alike: not a warm-up pass
    t = import_trace(vllm_file(tmp_path / "plain.jsonl", real))
    assert t.num_tokens == 50 and t.topk_ids[:, 0].tolist() == real
    assert "layer 0: no warm-up pass found, kept all 50 records" in t.notes


def test_trace_import_drops_a_warm_up_pass_and_obeys_the_flag(tmp_path, capsys):
    rng = np.random.default_rng(1)
    real = [sorted(rng.choice(64, 2, replace=False).tolist()) for _ in range(30)]
    f = vllm_file(tmp_path / "warm.jsonl", [[3, 4]] * WARMUP_MIN_RUN * 2 + real)
    t = import_trace(f)
    assert t.num_tokens == 30 and t.topk_ids[:, 0].tolist() == real
    assert any(f"dropped {WARMUP_MIN_RUN * 2} warm-up records" in n for n in t.notes)
    assert import_trace(f, warmup=0).num_tokens == 30 + WARMUP_MIN_RUN * 2
    assert import_trace(f, warmup=5).num_tokens == 25 + WARMUP_MIN_RUN * 2
    assert main(["trace", "import", str(f), "--out", str(tmp_path / "t"), "--warmup", "0"]) == 0
    assert Trace.load(tmp_path / "t").num_tokens == 30 + WARMUP_MIN_RUN * 2
    assert main(["trace", "import", str(f), "--out", str(tmp_path / "u"), "--warmup", "-1"]) == 1
    assert main(["trace", "import", str(f), "--out", str(tmp_path / "u"), "--warmup", "some"]) == 1
    assert "--warmup takes auto or a number" in capsys.readouterr().err and not (tmp_path / "u").exists()


# 10. the smaller ones


def test_a_refused_model_leaves_no_lock_in_the_cache_and_a_live_one_keeps_its_own(hf, tmp_path):
    from moetier.errors import MoetierError

    broken = tmp_path / "broken"
    shutil.copytree(hf, broken)
    shard = next(broken.glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:100])  # the checkpoint cannot be read: converting it is refused
    cache = tmp_path / "cache"
    with pytest.raises(MoetierError):
        resolve.resolve_model(broken, cache, progress=False)
    assert cache_entries(cache) == []
    live = resolve.resolve_model(hf, cache, progress=False)
    assert cache_entries(cache) == sorted([f".{live.name}.lock", live.name])


def test_a_lock_removed_by_its_holder_is_taken_afresh_by_the_waiter(tmp_path):
    """The holder of a failed attempt unlinks the lock file; a waiter that wakes on the unlinked file must lock the
    path anew, or a third process could lock a new file at the same path beside it."""
    import fcntl

    dest = tmp_path / "store"
    lock = tmp_path / ".store.lock"
    holding, waiter_in, release = threading.Event(), threading.Event(), threading.Event()

    def first():
        with target_lock(dest):
            holding.set()
            time.sleep(0.3)  # the waiter is blocked on this lock file meanwhile

    def second():
        with target_lock(dest):
            waiter_in.set()
            release.wait(10)

    a = threading.Thread(target=first)
    a.start()
    holding.wait(5)
    b = threading.Thread(target=second)
    b.start()
    a.join()
    assert waiter_in.wait(5)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)  # a third process, now: the path's file is held by the waiter
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)
        release.set()
        b.join()
    assert not lock.exists()  # dest never made: no lock left


def test_an_empty_trace_file_says_it_is_empty(tmp_path, capsys):
    (tmp_path / "empty.jsonl").write_text("")
    assert main(["trace", "import", str(tmp_path / "empty.jsonl"), "--out", str(tmp_path / "t")]) == 1
    assert "empty.jsonl is empty" in capsys.readouterr().err


def test_list_summaries_are_never_cut_inside_parentheses(capsys):
    for what in ("policies", "predictors"):
        assert main(["list", what]) == 0
        for line in capsys.readouterr().out.splitlines():
            assert line.count("(") == line.count(")"), line
            assert not re.search(r"\bEq\s*$|\bEq\b(?!\.)", line), line


def test_the_budget_refusal_states_one_share(tmp_path, capsys):
    from moetier.cache.capacity import cache_capacity
    from moetier.config import MemoryBudget
    from moetier.errors import BudgetError

    with pytest.raises(BudgetError) as e:
        cache_capacity(MemoryBudget.parse("1%"), 32 * 4 * 196608, 196608, 4)
    shares = set(re.findall(r"\d+\.\d%", str(e.value)))
    assert len(shares) == 1, str(e.value)
    cache_capacity(MemoryBudget.parse(shares.pop()), 32 * 4 * 196608, 196608, 4)  # the share it names suffices


def test_the_readme_examples_write_to_different_folders():
    outs = re.findall(r"^\s+moetier eval .*--out (\S+)", (ROOT / "README.md").read_text(), re.M)
    assert len(outs) >= 2 and len(set(outs)) == len(outs), outs


def test_the_first_command_writes_text_that_does_not_loop(capsys):
    """The README's first command (the default model, the default sampling) on three seeds: no word 3-gram three
    times in 64 tokens."""
    from collections import Counter

    for seed in ("1", "2", "3"):
        assert main(["generate", "--prompt", "It was a fine morning, and", "--max-tokens", "64", "--seed", seed,
                     "--json"]) == 0
        words = json.loads(capsys.readouterr().out)["texts"][0].split()
        assert len(words) > 20
        grams = Counter(tuple(words[i:i + 3]) for i in range(len(words) - 2))
        assert max(grams.values()) < 3, (seed, grams.most_common(2))
