"""`moetier bench` (moetier/engine/speed.py, moetier/cli/bench.py): llama-bench's pp and tg tests on a tiny model —
what each run feeds the engine and times, the table and JSON, and refusals before anything loads."""

import json

import pytest

from moetier import Engine
from moetier.cli import main
from moetier.cli.bench import table, token_counts
from moetier.engine.speed import SpeedResult, SpeedTest, measure
from moetier.errors import MoetierError


def test_tests_and_results_are_checked_and_summarised():
    assert SpeedTest("pp", 512).name == "pp512" and SpeedTest("tg", 128, batch=4).name == "tg128 x4"
    for bad in (("xx", 8), ("pp", 0), ("tg", 8, 0), ("pp", 8, 2)):
        with pytest.raises(MoetierError):
            SpeedTest(*bad)
    r = SpeedResult(SpeedTest("tg", 8), (10.0, 14.0))
    assert r.mean == 12.0 and r.std == pytest.approx(2 ** 0.5 * 2) and r.row()["samples"] == [10.0, 14.0]
    assert SpeedResult(SpeedTest("tg", 8), (5.0,)).std == 0.0
    with pytest.raises(ValueError):
        SpeedResult(SpeedTest("tg", 8), ())
    assert token_counts("128,0,512") == [128, 0, 512]
    lines = table({"model": "m", "threads": 2}, [r]).splitlines()
    assert [c.strip() for c in lines[0].split("|")[1:-1]] == ["model", "threads", "test", "t/s"]
    assert lines[0].endswith(" t/s |") and lines[2].startswith("| m     | 2       | tg8  |")  # (t/s right-aligned)
    assert lines[2].endswith(" 12.00 ± 2.83 |") and lines[1].endswith(": |") and len({len(x) for x in lines}) == 1


class Spy:
    """Engine.generate's calls, delegated: what each test feeds it."""

    def __init__(self, engine):
        self.engine, self.spec, self.calls = engine, engine.spec, []

    def generate(self, prompts, **kw):
        self.calls.append(([len(p) for p in prompts], kw))
        out = self.engine.generate(prompts, **kw)
        self.calls[-1] += (out.stats,)
        return out


def test_pp_times_a_new_prompt_of_n_ids_and_tg_the_decode_steps_after_one(tiny_store):
    _, store = tiny_store("olmoe")
    with Engine.from_pretrained(store, expert_memory="100%", progress=False) as engine:
        spy = Spy(engine)
        pp = measure(spy, SpeedTest("pp", 12), repetitions=2)
        assert len(pp.samples) == 2 and len(spy.calls) == 3  # (one to warm, not kept)
        assert all(lens == [12] and kw["max_new_tokens"] == 1 for lens, kw, _ in spy.calls)
        assert pp.samples == tuple(12 / stats["ttft_s"] for _, _, stats in spy.calls[1:])
        spy.calls.clear()
        tg = measure(spy, SpeedTest("tg", 5, batch=3), repetitions=2)
        assert all(lens == [1, 1, 1] and kw == {"max_new_tokens": 6, "ignore_eos": True} for lens, kw, _ in spy.calls)
        for (_, _, stats), tok_s in zip(spy.calls[1:], tg.samples):
            assert stats["new_tokens"] == 18 and tok_s == stats["decode_tokens_per_s"]
            assert tok_s == pytest.approx(15 / (stats["tpot_s"] * 5))  # five steps of three tokens each


def test_bench_prints_llama_benchs_table_and_json(tiny_store, capsys):
    _, store = tiny_store("olmoe")
    assert main(["bench", "--model", str(store), "-p", "8,16", "-n", "4", "-r", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split("|")[-3].strip() for line in out[2:]] == ["pp8", "pp16", "tg4"]
    assert all(float(line.split("|")[-2].split("±")[0]) > 0 for line in out[2:])
    assert main(["bench", "--model", str(store), "-p", "0", "-n", "3", "-r", "3", "-b", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["repetitions"] == 3 and [r["test"] for r in report["rows"]] == ["tg3 x2"]
    assert len(report["rows"][0]["samples"]) == 3 and "experts)" in report["expert cache"]


@pytest.mark.parametrize("argv, message", [
    (["-p", "0", "-n", "0"], "no test to run"),
    (["-p", "100000"], "pp100000 needs 100001 tokens of context; the model's context window is"),
    (["-p", "8,x"], "is not comma-separated whole numbers"),
    (["-n", "-4"], "token counts are 0 (no test) or more"),
    (["-r", "0"], "must be between 1 and 1000"),
    (["-b", "0"], "must be between 1 and 256"),
])
def test_bad_counts_are_refused_in_one_line_before_the_model_loads(tiny_store, capsys, monkeypatch, argv, message):
    _, store = tiny_store("olmoe")
    monkeypatch.setattr(Engine, "from_pretrained", lambda *a, **k: pytest.fail("the model was loaded"))
    assert main(["bench", "--model", str(store), *argv]) == 1
    err = capsys.readouterr().err
    assert err.startswith("moetier: error: ") and message in err and err.count("\n") == 2
