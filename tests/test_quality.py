"""The quality harness: its measures on hand-made distributions with known answers, and `moetier eval` end to end
on a demo model in the engine."""

import json
import math

import pytest
import torch

from moetier.cli import main
from moetier.cli.evaluate import parse_sweep, point
from moetier.engine.engine import Engine
from moetier.engine.score import teacher_forced
from moetier.errors import MoetierError
from moetier.quality import DomainScore, Windows


def test_identical_distributions_agree_fully_at_zero_kl():
    logp = torch.log_softmax(torch.randn(5, 7), dim=-1)
    s = DomainScore("x")
    s.add(logp, logp, torch.tensor([0, 1, 2, 3, 4]))
    out = s.summary()
    assert out["top1_agreement"] == 1 and out["kl"] == pytest.approx(0, abs=1e-6)
    assert out["perplexity"] == pytest.approx(math.exp(-logp[torch.arange(5), torch.arange(5)].mean().item()))


def test_kl_and_agreement_on_known_distributions():
    exact = torch.log(torch.tensor([[0.5, 0.5], [0.9, 0.1]]))
    other = torch.log(torch.tensor([[0.25, 0.75], [0.9, 0.1]]))
    s = DomainScore("x")
    s.add(other, exact, torch.tensor([1, 0]))
    out = s.summary()
    kl = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)  # the first row; the second is equal
    assert out["kl"] == pytest.approx(kl / 2) and out["top1_agreement"] == 0.5
    assert out["perplexity"] == pytest.approx(math.exp(-(math.log(0.75) + math.log(0.9)) / 2))


def test_windows_spread_over_the_text_and_refuse_a_short_one():
    w = Windows.spread("t", list(range(100)), 10, 4)
    assert [r[0] for r in w.rows] == [0, 30, 60, 90] and all(len(r) == 10 for r in w.rows)
    with pytest.raises(MoetierError, match="fewer than one window"):
        Windows.spread("t", list(range(5)), 10, 4)


@pytest.mark.parametrize("text, match", [("speed=1,2", "cannot sweep"), ("t1=", "cannot sweep")])
def test_bad_sweeps_are_refused(text, match):
    with pytest.raises(MoetierError, match=match):
        parse_sweep(text)


def test_a_sweep_point_is_checked_before_any_engine_runs():
    fields = {"mode": "hobbit", "high": "", "low": "", "t1": None, "t2": None, "high_share": 0.75}
    assert point(fields, "t1", "0.3").t1 == 0.3 and point(fields, "precision", "low-tier").t2 == 1.0
    with pytest.raises(MoetierError, match="not a number"):
        point(fields, "t2", "high")
    with pytest.raises(MoetierError, match="0 <= T1 <= T2"):
        point(fields | {"t2": 0.9}, "t1", "0.95")


def test_teacher_forcing_scores_what_generation_computes(tiny_store):
    """The distribution scored for each position is the one greedy generation picks its token from."""
    _, path = tiny_store("olmoe", num_hidden_layers=2)
    with Engine.from_pretrained(path, expert_memory="50%", progress=False) as engine:
        prompt = [5, 9, 17, 33]
        out = engine.generate([prompt], max_new_tokens=6, ignore_eos=True).token_ids[0]
        logp, stats = teacher_forced(engine, prompt + out, len(prompt))
    assert logp.argmax(-1).tolist() == out  # one distribution per generated token
    assert stats.decode_tokens == len(out) - 1  # the prefill predicted the first


def test_eval_end_to_end_on_a_demo_model(tmp_path, capsys):
    text = tmp_path / "prose.txt"
    text.write_text("It was a fine morning, and the sea was calm. The captain stood upon the deck and looked "
                    "out over the water, where the gulls were crying above the waves. " * 4)
    assert main(["eval", "--model", "demo-fine", "--expert-memory", "30%", "--text", f"prose={text}",
                 "--windows", "1", "--window", "24", "--prefix", "8", "--sweep", "precision=int8,int2",
                 "--out", str(tmp_path / "out"), "--json"]) == 0
    rows = {r["label"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert set(rows) == {"exact", "precision=int8", "precision=int2"}
    assert rows["exact"]["kl"] == 0 and rows["exact"]["top1_agreement"] == 1
    assert rows["precision=int8"]["kl"] <= rows["precision=int2"]["kl"]
    assert rows["precision=int2"]["domains"][0]["tokens"] == 16
    assert (tmp_path / "out" / "eval.png").stat().st_size > 0


def test_a_point_the_budget_cannot_hold_is_a_row_with_its_reason(tiny_store):
    from moetier.errors import BudgetError
    from moetier.quality import sweep

    _, path = tiny_store("olmoe", num_hidden_layers=2)

    def make_engine(label):
        if label == "low-tier":
            raise BudgetError("low-tier keeps every expert resident at low precision; even int2 takes more")
        return Engine.from_pretrained(path, expert_memory="50%", progress=False)

    rows = list(sweep(make_engine, ["exact", "low-tier", "again"], [Windows("t", ((5, 9, 17, 33, 65, 100),))], 2))
    assert [r.label for r in rows] == ["exact", "low-tier", "again"]
    assert rows[1].note.startswith("low-tier keeps") and not rows[1].domains
    assert rows[2].domains[0]["kl"] == pytest.approx(0, abs=1e-9)  # the same configuration as exact
