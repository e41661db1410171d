"""`moetier merge` from the command line: one variant, the paper's library with its quality, and refusals in one
line before anything is converted or loaded."""

import json

import pytest
import torch

from moetier.cli import main
from moetier.merge.library import Library
from moetier.store.store import Store
from tests.serve.conftest import text_store  # noqa: F401 (the fixture)

PROSE = ("It was a bright cold day in April, and the clocks were striking thirteen. The hallway smelt of boiled "
         "cabbage and old rag mats. At one end of it a coloured poster, too large for indoor display, had been "
         "tacked to the wall. ") * 12


@pytest.fixture
def texts(tmp_path):
    (tmp_path / "cal.txt").write_text(PROSE)
    (tmp_path / "held.txt").write_text(PROSE[::-1])
    return tmp_path / "cal.txt", tmp_path / "held.txt"


def test_merge_writes_a_smaller_store_and_says_what_it_kept(text_store, texts, tmp_path, capsys):  # noqa: F811
    cal, _ = texts
    assert main(["merge", "--model", str(text_store), "--out", str(tmp_path / "m"), "--ratio", "0.5",
                 "--calibration", str(cal), "--calibration-tokens", "256"]) == 0
    out = capsys.readouterr().out
    spec = Store(tmp_path / "m").spec
    assert "ratio-0.5, experts kept of" in out and "(50%)" in out and "calibrated on 255 tokens" in out  # (a window of the context less one)
    assert all(len(set(g)) == spec.num_experts // 2 for g in spec.expert_groups)
    assert spec.hf_config["moetier_merged"]["aligned"] is True
    assert main(["generate", "--model", str(tmp_path / "m"), "--prompt", "It was", "--max-tokens", "4"]) == 0


def test_theta_act_alone_merges_and_the_store_records_the_method_that_ran(text_store, texts, tmp_path,  # noqa: F811
                                                                         capsys):
    """`--threshold` without a ratio (θ_act: the experts above that share of a layer's activations); and
    `--members principal` keeps each principal's own weights — no refit — which the store says."""
    cal, _ = texts
    assert main(["merge", "--model", str(text_store), "--out", str(tmp_path / "t"), "--threshold", "0.05",
                 "--members", "principal", "--calibration", str(cal), "--calibration-tokens", "256"]) == 0
    assert "threshold-0.05, experts kept of" in capsys.readouterr().out
    merged, src = Store(tmp_path / "t"), Store(text_store)
    record = merged.spec.hf_config["moetier_merged"]
    assert (record["method"], record["threshold"], record["members"], record["refit"]) == (
        "threshold-0.05", 0.05, "principal", "none")
    layer = merged.spec.moe_layers[0]
    p = merged.spec.experts_of(layer)[0]
    assert all(torch.equal(merged.read_expert(layer, p)[k], v) for k, v in src.read_expert(layer, p).items())


def test_the_library_lists_the_papers_six_with_their_quality(text_store, texts, tmp_path, capsys):  # noqa: F811
    cal, held = texts
    assert main(["merge", "--model", str(text_store), "--out", str(tmp_path / "lib"), "--library", "--calibration",
                 str(cal), "--calibration-tokens", "256", "--text", f"held={held}", "--windows", "2", "--window",
                 "32", "--prefix", "4"]) == 0
    library = Library.load(tmp_path / "lib")
    names = [v.name for v in library.variants]
    assert names == ["original", "fixed-light", "fixed-medium", "fixed-heavy", "adaptive-light", "adaptive-medium",
                     "adaptive-heavy"]
    original, heavy = library.variants[0], library.variants[3]
    assert original.quality["perplexity_change"] == 0 and original.quality["top1_agreement"] == 1
    assert heavy.expert_bytes * 4 == original.expert_bytes and heavy.quality["kl"] > 0
    assert (tmp_path / "lib" / "library.png").stat().st_size > 0
    assert "fixed-heavy" in capsys.readouterr().out


@pytest.mark.parametrize("extra, message", [
    (["--ratio", "1.5"], "a merge ratio must be in (0, 1]"),
    (["--ratio", "0.5", "--alpha", "2"], "--alpha must be in [0, 1]"),
    (["--library", "--ratio", "0.5"], "not allowed with argument"),
    (["--ratio", "0.5", "--calibration", "{missing}"], "cannot read"),
    ([], "give one way to choose the experts kept"),
    (["--ratio", "0.5", "--threshold", "0.1"], "not --ratio and --threshold"),
    (["--threshold", "1.5"], "--threshold is a share of a layer's activations"),
    (["--ratio", "0.5", "--members", "principal", "--refit", "down"], "keeps each principal's own weights"),
])
def test_bad_input_is_refused_in_one_line_before_loading(text_store, tmp_path, capsys, extra, message):  # noqa: F811
    (tmp_path / "mine").mkdir()
    args = [a.replace("{missing}", str(tmp_path / "nothing.txt")) for a in extra]
    assert main(["merge", "--model", str(text_store), "--out", str(tmp_path / "out"), *args]) != 0
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) <= 2 and not (tmp_path / "out").exists()
    assert main(["merge", "--model", str(text_store), "--out", str(tmp_path / "mine"), "--ratio", "0.5"]) == 1
    assert "moetier: error:" in capsys.readouterr().err


def test_a_library_file_that_is_not_one_is_refused(tmp_path):
    (tmp_path / "library.json").write_text(json.dumps({"format": "something else"}))
    with pytest.raises(Exception, match="cannot read the merge library"):
        Library.load(tmp_path)


def test_a_library_folder_holding_someone_elses_library_json_is_refused(text_store, tmp_path, capsys):  # noqa: F811
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "library.json").write_text("my notes")
    assert main(["merge", "--model", str(text_store), "--out", str(tmp_path / "lib"), "--library"]) == 1
    assert "cannot read the merge library" in capsys.readouterr().err
    assert (tmp_path / "lib" / "library.json").read_text() == "my notes" and len(list((tmp_path / "lib").iterdir())) == 1


def test_variants_need_adapt_and_a_library_before_anything_loads(text_store, tmp_path, capsys):  # noqa: F811
    base = ["generate", "--model", str(text_store), "--prompt", "It was", "--max-tokens", "2"]
    assert main([*base, "--variants", str(tmp_path)]) == 1
    assert "needs --adapt" in capsys.readouterr().err
    assert main([*base, "--adapt", "--variants", str(tmp_path)]) == 1
    assert "cannot read the merge library" in capsys.readouterr().err
