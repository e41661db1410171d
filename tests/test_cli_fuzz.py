"""Every subcommand driven with generated option values — numbers of every sign and size, empty and non-UTF-8
text, paths to files, folders, devices and nothing — each run ends in one line (or a result), status 0 or 1, never
a traceback, and nothing is made outside the test's own folders.

Each run starts from a command line that would do nothing heavy (a model that is not there, a tiny trace, a tiny
synthetic shape) and changes one or two options; the disk looks 64 MiB free, so a generated size that would write
gigabytes is refused by the space check instead of written."""

import argparse
import contextlib
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moetier.cli import build_parser, main
from tests.test_cli_inputs import olmoe_trace
from train.corpus import build as build_corpus

ROOT = Path(__file__).resolve().parent.parent


def commands() -> dict[tuple[str, ...], argparse.ArgumentParser]:
    out = {}

    def walk(parser, path):
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            out[path] = parser
        for name, sub in (subs[0].choices.items() if subs else ()):
            walk(sub, (*path, name))

    walk(build_parser(), ())
    return out


COMMANDS = commands()
# a starting command line per subcommand: everything it requires, nothing heavy ({...} are the test's paths)
BASE = {
    ("generate",): ["--model", "{missing}", "--prompt", "x"],
    ("bench",): ["--model", "{missing}", "-p", "8", "-n", "4"],
    ("serve",): ["--model", "{missing}"],
    ("chat",): ["--model", "{missing}"],
    ("eval",): ["--model", "{missing}"],
    ("convert",): ["{missing}", "{out}"],
    ("quantize",): ["{missing}", "--precisions", "int8"],
    ("merge",): ["--model", "{missing}", "--out", "{out}", "--ratio", "0.5"],
    ("synth",): ["{out}", "--preset", "tiny"],
    ("trace", "import"): ["{jsonl}", "--out", "{out}"],
    ("trace", "record"): ["--model", "{missing}", "--prompts", "{text}", "--out", "{out}"],
    ("trace", "synth"): ["--fit", "{trace}", "--out", "{out}", "--model-shape", "olmoe-1b-7b", "--tokens", "20"],
    ("trace", "stats"): ["{trace}", "--plot", "{out}.png"],
    ("calibrate",): ["--model", "{missing}", "--out", "{out}.json"],
    ("doctor",): ["{missing}", "--profile", "rtx4090", "--tokens", "16"],
    ("sim",): ["--trace", "{trace}", "--profile", "rtx4090", "--model-shape", "olmoe-1b-7b", "--out", "{out}"],
    ("cache-bench",): ["--trace", "{trace}", "--expert-memory", "25%", "--out", "{out}"],
    ("train", "cache-policy"): ["--policy", "static-hot", "--trace", "{trace}", "--model", "{missing}"],
    ("train", "thresholds"): ["--trace", "{trace}", "--out", "{out}.json"],
    ("train", "similarity"): ["--trace", "{trace}", "--model", "{missing}", "--out", "{out}.json"],
    ("train", "predictor"): ["--predictor", "llapor", "--trace", "{trace}", "--model", "{missing}", "--out",
                             "{out}.safetensors"],
    ("predict-bench",): ["--trace", "{trace}", "--predictor", "hot"],
    ("list",): ["policies"],
}

NUMBERS = st.one_of(st.integers(-2**70, 2**70), st.integers(-3, 300),
                    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0, -0.0, 1e308, 2**63, -1]))
TEXT = st.one_of(st.just(""), st.just(" "), st.text(max_size=12), st.just("abc\udcff"), st.just("-"),
                 st.just("5%"), st.just("-5%"), st.just("1e9%"), st.just("512MiB"), st.just("auto"), st.just("nan"),
                 st.just("a,b,,c"), st.just("0.6,0.9"), st.just("lru+predicted"))
PATHS = st.sampled_from(["{missing}", "{afile}", "{folder}", "/dev/null", "{out}", "{trace}", "{jsonl}", "/",
                         "{afile}/under"])


def value() -> st.SearchStrategy[str]:
    return st.one_of(NUMBERS.map(str), TEXT, PATHS)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    (root / "folder").mkdir()
    (root / "afile").write_text("a file")
    (root / "text.txt").write_text("The sea was\n")
    trace = olmoe_trace(tokens=24).save(root / "trace")
    jsonl = root / "t.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in [
        {"type": "meta", "model_id": "allenai/OLMoE-1B-7B-0924", "top_k": 2},
        *({"type": "route", "layer": 0, "topk_ids": [i % 64, (i + 1) % 64], "topk_weights": [0.5, 0.5]}
          for i in range(20))]))
    corpus = build_corpus(root / "corpus")  # (what `eval` reads from the cache; each example's cache links to it)
    return {"corpus": corpus, "root": root, "missing": str(root / "missing"), "afile": str(root / "afile"),
            "folder": str(root / "folder"), "text": str(root / "text.txt"), "trace": str(trace), "jsonl": str(jsonl)}


def git_status() -> str:
    return subprocess.run(["git", "status", "--porcelain", "--ignored"], cwd=ROOT, capture_output=True,
                          text=True).stdout


@pytest.fixture(scope="module")
def clean_tree():
    before = git_status()
    yield
    assert git_status() == before  # nothing made in the checkout


# MOETIER_FUZZ_RANDOM=1 MOETIER_FUZZ_EXAMPLES=5000 explores beyond the fixed examples the suite runs
@settings(max_examples=int(os.environ.get("MOETIER_FUZZ_EXAMPLES", "250")), deadline=None,
          derandomize=os.environ.get("MOETIER_FUZZ_RANDOM") is None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_every_subcommand_refuses_any_value_in_one_line(world, clean_tree, tmp_path_factory, monkeypatch, data):
    import shutil

    path = data.draw(st.sampled_from(sorted(COMMANDS)), label="command")
    parser = COMMANDS[path]
    options = [a for a in parser._actions if a.option_strings and a.option_strings[0] not in ("-h", "--help")]
    run = tmp_path_factory.mktemp("run")
    names = dict(world, out=str(run / "out"))
    argv = [*path, *BASE[path]]
    for action in data.draw(st.lists(st.sampled_from(options), min_size=1, max_size=2), label="options"):
        flag = action.option_strings[-1]
        argv += [flag] if action.nargs == 0 else [flag, data.draw(value(), label=flag)]
    argv = [a.format(**names) if "{" in a and "}" in a else a for a in argv]
    home = run / "home"
    (run / "cache").mkdir()
    (run / "cache" / "corpus").symlink_to(world["corpus"])  # built once: ~2 s an `eval` example otherwise
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("MOETIER_CACHE", str(run / "cache"))
    monkeypatch.chdir(run)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"The sea was")))  # for `--prompt -`
    # the disk looks nearly full: a generated size that would write gigabytes is refused, not written
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(64 << 20, 0, 64 << 20))
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        code = main(argv)
    stderr = err.getvalue()
    assert "Traceback" not in stderr, (argv, stderr)
    assert code in (0, 1), (argv, code, stderr)
    if code == 1:
        # (not splitlines: \x1e may be in a path; a progress bar's last redraw may follow the error)
        tail = [line for line in stderr.split("\n") if line.strip() and "\r" not in line][-2:]
        errors = [line for line in tail if line.startswith("moetier: error: ")]
        assert len(errors) == 1 and re.fullmatch(r"(moetier: error: .+)(\n  hint: .+)?",
                                                 "\n".join(tail[tail.index(errors[0]):])), (argv, stderr)
    assert not (home / ".cache" / "moetier").exists(), argv  # (matplotlib keeps its font cache there)
