"""What a llama.cpp or Hugging Face user expects of the command: --version, --help with defaults, prompts from a
file or stdin, --ignore-eos, a note at the context window, decode-only tok/s, `moetier list`, one option name
for the cache partition, calibrate honouring MOETIER_CACHE, plots only when asked, README output git-ignored."""

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from moetier import __version__
from moetier.cli import build_parser, main
from moetier.engine.engine import Engine
from moetier.store.store import Store
from moetier.store.synth import byte_tokenizer

ROOT = Path(__file__).resolve().parents[1]


def parsers(parser=None, path=("moetier",)):
    """(command path, parser) for the command and every subcommand."""
    parser = parser or build_parser()
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from parsers(sub, (*path, name))


def test_version(capsys):
    assert main(["--version"]) == 0 and capsys.readouterr().out.strip() == f"moetier {__version__}"


@pytest.mark.parametrize("argv, refusal", [
    (["--help"], None), (["generate", "--help"], None), (["sim", "--help"], None),
    (["generate", "--model", "demo-deep", "--prompt", "x", "--top-p", "2"], "--top-p"),
    (["generate", "--model", "demo-deep", "--prompt", "x", "--predictor", "nope"], "--predictor"),
    (["synth", "out", "--preset", "nope"], "--preset"),
    (["train", "predictor", "--predictor", "hot", "--trace", "t"], "--predictor"),
    (["generate", "--model", "no/such/model", "--prompt", "x"], "no model at no/such/model"),
    (["serve", "--model", str(ROOT / "README.md")], "is a file, not a model"),
    (["eval", "--model", "demo-deep", "--expert-memory", "5x"], "cannot read expert memory '5x'"),
    (["generate", "--model", "demo-deep-xl", "--host-memory", "lots", "--prompt", "x"], "cannot read host memory")])
def test_help_and_the_parsers_refusals_answer_without_loading_torch(argv, refusal):
    """What the options alone answer — help; a choice, a number or a budget refused; a `--model` that names nothing
    — in a fresh process that never imports torch (~2 s on these machines: the whole of such an answer's time
    before; a mistyped --model took 3 s to refuse)."""
    code = ("import sys; from moetier.cli import main; status = main(sys.argv[1:]); "
            "print(status, 'torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120)
    assert r.stdout.splitlines()[-1] == f"{int(refusal is not None)} False", r.stdout[-500:] + r.stderr[-500:]
    if refusal:
        assert r.stderr.startswith("moetier: error: ") and len(r.stderr.strip().splitlines()) <= 2, r.stderr
        assert refusal in r.stderr.splitlines()[0], r.stderr


def test_the_package_hands_over_the_engine_when_first_asked():
    """`import moetier` loads no torch; `moetier.Engine` (and `from moetier import Engine`) is the engine's class,
    imported then; a name the package does not have is an AttributeError."""
    code = ("import sys, moetier; print('torch' in sys.modules); from moetier import EngineConfig; "
            "from moetier.engine import engine; print(moetier.Engine is engine.Engine, EngineConfig is "
            "engine.EngineConfig, 'torch' in sys.modules); print(hasattr(moetier, 'Engines'))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.stdout.split() == ["False", "True", "True", "True", "False"], r.stderr[-500:]


def test_every_option_of_every_command_has_a_help_line_with_its_default(monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # no wrapping inside a default
    for path, parser in parsers():
        help_text = parser.format_help()
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)):
                continue
            assert action.help, f"{' '.join(path)} {action.option_strings or action.dest} has no help"
            flag = action.nargs == 0 and isinstance(action.const, bool)  # --x / --no-x: no default to show
            if action.option_strings and action.default not in (None, False, "") and not flag:
                assert f"(default: {action.default})" in help_text, (path, action.dest)
        # what says nothing: an empty default, a flag's True (`--no-batch-aware (default: True)`)
        assert "(default: )" not in help_text and "(default: True)" not in help_text, path


def test_one_option_name_for_the_cache_partition():
    for path, parser in parsers():
        options = {o for a in parser._actions for o in a.option_strings}
        assert "--partition" not in options, path
    commands = {p[1] for p, parser in parsers() if len(p) == 2 and "--cache-partition" in parser.format_help()}
    assert {"generate", "serve", "chat", "sim", "cache-bench"} <= commands


def run_json(args, **kw):
    r = subprocess.run([sys.executable, "-m", "moetier.cli", "generate", *args, "--max-tokens", "6", "--json",
                        "--seed", "7"],  # (sampling, as by default: the same draws each time)
                       capture_output=True, text=True, **kw)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_prompt_from_a_file_and_from_stdin_equals_the_prompt_argument(tmp_path):
    (tmp_path / "p.txt").write_text("The sea was\n")  # one final newline is dropped, as llama.cpp's -f does
    direct = run_json(["--prompt", "The sea was"])["token_ids"]
    assert run_json(["--prompt-file", str(tmp_path / "p.txt")])["token_ids"] == direct
    assert run_json(["--prompt", "-"], input="The sea was\n")["token_ids"] == direct


@pytest.fixture
def text_store(tiny_store, tmp_path):
    """A tiny converted store with a byte-level tokenizer, so the command can take text."""
    def get(**overrides):
        _, path = tiny_store("olmoe", **overrides)
        out = tmp_path / f"text-{len(list(tmp_path.iterdir()))}"
        shutil.copytree(path, out)
        byte_tokenizer().save(str(out / "tokenizer.json"))
        return out
    return get


def test_ignore_eos_generates_past_end_of_sequence(text_store, capsys):
    store = text_store()
    with Engine(Store(store)) as engine:
        first = engine.generate("x", max_new_tokens=4).token_ids[0]
    eos_store = text_store(eos_token_id=first[1])  # same weights; its second greedy token ends the sequence
    greedy = ["--temperature", "0"]
    assert main(["generate", "--model", str(eos_store), "--prompt", "x", "--max-tokens", "4", "--json", *greedy]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"][0] == first[:2]
    assert main(["generate", "--model", str(eos_store), "--prompt", "x", "--max-tokens", "4", "--json", *greedy,
                 "--ignore-eos"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"][0] == first


def test_a_note_when_generation_stops_at_the_context_window(text_store, capsys):
    store = text_store(max_position_embeddings=8)
    assert main(["generate", "--model", str(store), "--prompt", "xxxx", "--max-tokens", "20"]) == 0
    err = capsys.readouterr().err
    assert "stopped at the model's context window (8 tokens) after 5 new tokens" in err


def test_statistics_line_has_decode_only_tok_s_beside_overall(text_store, capsys):
    assert main(["generate", "--model", str(text_store()), "--prompt", "x", "--max-tokens", "5"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("moetier: expert cache ") and "available (" in err[0]  # the chosen budget
    assert " tok/s (decode " in err[-1]


@pytest.mark.parametrize("kind,expected", [("models", "demo-fine"), ("policies", "flashmoe-ml"),
                                           ("predictors", "stacked-gates"), ("profiles", "rtx4090"),
                                           ("shapes", "qwen3-30b-a3b"), ("shapes", "gpt-oss-120b"),
                                           ("families", "switch_transformers"), ("families", "refused")])
def test_list(capsys, kind, expected):
    assert main(["list", kind]) == 0
    assert expected in capsys.readouterr().out


def test_calibrate_writes_into_moetier_cache(private_cache, capsys):
    assert main(["calibrate"]) == 0
    assert (private_cache / "profiles" / "this-machine.json").exists()
    assert main(["list", "profiles"]) == 0 and "this-machine" in capsys.readouterr().out


def test_cache_bench_writes_a_plot_only_when_asked(tmp_path, monkeypatch, capsys):
    from tests.test_cli_inputs import olmoe_trace

    olmoe_trace(tokens=20).save(tmp_path / "t")
    monkeypatch.chdir(tmp_path)
    assert main(["cache-bench", "--trace", "t", "--policy", "lru", "--expert-memory", "25%"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t"]
    assert main(["cache-bench", "--trace", "t", "--policy", "lru", "--expert-memory", "25%", "--plot", "p.png"]) == 0
    assert (tmp_path / "p.png").stat().st_size > 0


def test_the_readmes_generated_folders_are_git_ignored():
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        pytest.skip("not a git checkout")
    readme = (ROOT / "README.md").read_text()
    written = ["traces/mixtral", "sweep/sweep.json", "step.png", "cache-bench.png", "records.json",
               "merged/demo-deep/library.json"]
    for path in written:
        assert path.split("/")[0] in readme
    for path in [*written, "sim-sweep/sweep.json"]:  # and sim's default output folder
        r = subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT)
        assert r.returncode == 0, f"{path} (written by a README example) is not git-ignored"


def test_preload_starts_a_resident_run_resident(capsys):
    """(The command a user runs, `generate --expert-memory 100%`, read every expert from disk during its first
    tokens: 0.87x of the benchmark harness's preloaded figure.)"""
    args = ["generate", "--model", "demo-fine", "--expert-memory", "100%", "--prompt", "The sea", "--max-tokens",
            "4", "--json", "--seed", "1"]
    assert main(args) == 0
    cold = json.loads(capsys.readouterr().out)["stats"]
    assert main([*args, "--preload"]) == 0
    out, err = capsys.readouterr()
    warm = json.loads(out)["stats"]
    assert cold["prefill"]["loads"] > 0 and warm["prefill"]["loads"] == warm["decode"]["loads"] == 0
    assert warm["hit_rate"] == 1 and "moetier: preloaded 128 experts" in err
