"""The `moetier` command: output, statistics line, JSON, and a clear message with a non-zero exit on bad input."""

import json
import shutil
import subprocess
import sys

import pytest

from moetier.cli import main
from moetier.store.format import Manifest


def test_generate_streams_text_then_one_statistics_line(tiny_store, capsys):
    _, path = tiny_store("olmoe")
    synth = path.parent / "synth"
    assert main(["synth", str(synth), "--preset", "tiny"]) == 0
    capsys.readouterr()
    assert main(["generate", "--model", str(synth), "--prompt", "Hello", "--max-tokens", "8",
                 "--expert-memory", "50%"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("Hello")
    stats = err.strip().splitlines()[-1]
    for field in ("TTFT", "TPOT", "p50", "p90", "tok/s", "hit rate", "/token", "peak RSS"):
        assert field in stats


def test_generate_json(tiny_store, capsys):
    _, path = tiny_store("olmoe")
    assert main(["generate", "--model", str(path), "--prompt", "a", "--prompt", "bb", "--max-tokens", "4",
                 "--json"]) != 0  # the tiny checkpoint has no tokenizer: text prompts are refused
    assert "no tokenizer" in capsys.readouterr().err
    synth = path.parent / "synth-json"
    main(["synth", str(synth), "--preset", "tiny"])
    capsys.readouterr()
    assert main(["generate", "--model", str(synth), "--prompt", "a", "--prompt", "bb", "--max-tokens", "4",
                 "--json", "--expert-memory", "auto"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert len(d["token_ids"]) == 2 and 0 <= d["stats"]["hit_rate"] <= 1 and d["stats"]["tpot_s"] > 0


@pytest.mark.parametrize("args,message", [
    (["generate", "--model", "/no/such/model", "--prompt", "x"], "no model at /no/such/model"),
    (["generate", "--model", "{store}", "--prompt", "x", "--expert-memory", "1KiB"], "needs 2"),
    (["generate", "--model", "{store}", "--prompt", "x", "--expert-memory", "lots"], "cannot read expert memory"),
    (["convert", "{tmp}/nothing", "{tmp}/out"], "does not exist"),
])
def test_bad_input_exits_non_zero_with_a_message(tiny_store, tmp_path, capsys, args, message):
    _, path = tiny_store("olmoe")
    args = [a.format(store=path, tmp=tmp_path) for a in args]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_console_script_exit_code_on_a_damaged_store(tiny_store, tmp_path):
    from moetier.store.synth import byte_tokenizer

    _, path = tiny_store("olmoe", copy=True)
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    byte_tokenizer().save(str(bad / "tokenizer.json"))
    for blob in Manifest.load(bad).blobs:  # damage every expert of layer 0: whichever is routed fails
        if blob.layer == 0:
            with open(bad / blob.file, "r+b") as f:
                f.seek(blob.offset)
                f.write(b"\0\1\2\3")
    r = subprocess.run([sys.executable, "-m", "moetier.cli", "generate", "--model", str(bad), "--prompt", "x",
                        "--expert-memory", "100%"], capture_output=True, text=True)
    assert r.returncode == 1
    assert "fails its checksum" in r.stderr and "of layer 0" in r.stderr and "re-convert" in r.stderr
    assert "Traceback" not in r.stderr
