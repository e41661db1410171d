"""bench/kernel_ab.py: two builds of the quantized expert kernels timed side by side in one process, their outputs
compared bit for bit first — the same sources agree, a change to the activation's blocks is seen to differ — and
what it cannot take refused in one line before anything is built."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from moetier.model import native

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "kernel_ab.py"
CSRC = ROOT / "moetier" / "model" / "csrc"
pytestmark = pytest.mark.skipif(not native.runnable_isas() or native._compiler() is None,
                                reason="needs a C compiler and an AVX2 CPU (the native kernels' own needs)")
SMALL = ["--bits", "4", "--shape", "256x128", "--copies", "8", "--rounds", "2", "--calls", "8"]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300)


def base_folder(tmp_path: Path, change: tuple[str, str] | None = None) -> Path:
    folder = tmp_path / "base"
    folder.mkdir(parents=True)
    for name in ("q_int.c", "bf16.h"):
        shutil.copy(CSRC / name, folder / name)
    if change:
        text = (folder / "q_int.c").read_text()
        assert change[0] in text
        (folder / "q_int.c").write_text(text.replace(*change))
    return folder


def test_the_same_sources_agree_bit_for_bit_and_a_changed_rounding_is_seen_to_differ(tmp_path, monkeypatch, capsys):
    """(In this process: the interpreter and torch started once for both runs.)"""
    sys.path.insert(0, str(ROOT / "bench"))
    import kernel_ab

    def main(base: Path, out: Path) -> str:
        monkeypatch.setattr(sys, "argv", ["kernel_ab.py", "--base", str(base), *SMALL, "--out", str(out)])
        kernel_ab.main()
        return capsys.readouterr().out

    printed = main(base_folder(tmp_path / "same"), tmp_path / "same" / "out")
    body = json.loads((tmp_path / "same" / "out" / "kernel-ab.json").read_text())
    assert [(row["bits"], row["kernel"]) for row in body["rows"]] == [(4, "expert"), (4, "layer")]
    for row in body["rows"]:
        assert row["same_outputs"] and row["base_ms"] > 0 and row["head_ms"] > 0
        assert [len(ts) for ts in row["rounds_ms"].values()] == [2, 2]
    assert "bit for bit" in printed and (tmp_path / "same" / "out" / "kernel-ab.png").stat().st_size > 0
    # activation blocks of 32 where ours are 128: the same weights, the activations rounded otherwise
    changed = base_folder(tmp_path / "changed", ("#define QI_BIG_BLOCK 128", "#define QI_BIG_BLOCK 32"))
    printed = main(changed, tmp_path / "changed" / "out")
    rows = json.loads((tmp_path / "changed" / "out" / "kernel-ab.json").read_text())["rows"]
    assert not any(row["same_outputs"] for row in rows) and "DIFFER" in printed


@pytest.mark.parametrize("args, said", [(["--bits", "3"], "--bits from 8, 4, 2"),
                                        (["--shape", "100x128"], "whole groups of 128"),
                                        (["--shape", "wide"], "HIDDENxINTERMEDIATE"),
                                        (["--base", "no-such-revision"], "neither a folder"),
                                        (["--rounds", "1"], "--rounds at least 2")])
def test_what_it_cannot_take_is_refused_in_one_line(tmp_path, args, said):
    r = run(*args, "--out", str(tmp_path / "out"))
    assert r.returncode == 1 and said in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert r.stderr.startswith("kernel_ab: error: ") and not (tmp_path / "out").exists()


def test_a_base_that_does_not_compile_is_refused_in_one_line(tmp_path):
    broken = base_folder(tmp_path, ("static qim make_qim(", "static qim make_qim(}"))
    r = run("--base", str(broken), *SMALL, "--out", str(tmp_path / "out"))
    assert r.returncode == 1 and "the base's kernels do not compile" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


def test_emulating_avx512_builds_its_branch_for_avx2_under_its_own_name(tmp_path, monkeypatch):
    """`--emulate-avx512`: SIMDe's shim force-included, no AVX-512 instruction enabled, a library named apart from the
    real ones (the compile itself, ~20 s, is the plugin's: tests/test_emulate_avx512.py builds each branch)."""
    pytest.importorskip("simde_py", reason="needs simde-py (the test extra)")
    sys.path.insert(0, str(ROOT / "bench"))
    import kernel_ab

    commands = []
    monkeypatch.setattr(kernel_ab.subprocess, "run", lambda argv, **kw: commands.append(argv))
    monkeypatch.setattr(kernel_ab.os, "replace", lambda a, b: None)
    monkeypatch.setenv("MOETIER_CACHE", str(tmp_path))
    lib = kernel_ab.build(kernel_ab.sources_at(None), emulate_avx512=True)
    assert lib.name.startswith("kernel-ab-avx512-emulated-")
    [argv] = commands
    assert "-include" in argv and argv[argv.index("-include") + 1].endswith("tests/emulate_avx512.h")
    assert not any(flag.startswith("-mavx512") for flag in argv) and "-mavx2" in argv


def test_emulating_avx512_without_simde_is_refused_in_one_line_before_anything_is_built(tmp_path, monkeypatch,
                                                                                          capsys):
    sys.path.insert(0, str(ROOT / "bench"))
    import kernel_ab

    monkeypatch.setitem(sys.modules, "simde_py", None)  # (an import of it raises ImportError, as where not installed)
    monkeypatch.setattr(kernel_ab, "build", lambda *a, **k: pytest.fail("built"))
    monkeypatch.setattr(sys, "argv", ["kernel_ab.py", "--emulate-avx512", *SMALL, "--out", str(tmp_path / "out")])
    with pytest.raises(SystemExit) as e:
        kernel_ab.main()
    assert str(e.value).startswith("kernel_ab: error: --emulate-avx512 needs SIMDe's headers: pip install simde-py")
    assert not (tmp_path / "out").exists()
