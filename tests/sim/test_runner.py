"""Where a sweep's cells run: in this process, in forked local workers, or as Ray tasks — the same results in the
same order wherever they ran."""

import importlib.util
import json

import pytest

from moetier.cli import main
from moetier.sim.runner import InProcess, LocalProcesses, make_runner


def test_local_workers_run_a_closure_and_keep_the_cells_order():
    offset = 100  # a closure over local state: forked workers inherit it, nothing is pickled but indices

    def cell(i):
        return i * i + offset

    done = []
    out = LocalProcesses(2).map(cell, list(range(7)), lambda: done.append(1))
    assert out == [i * i + offset for i in range(7)] == InProcess().map(cell, list(range(7)), lambda: None)
    assert len(done) == 7
    assert isinstance(make_runner(None, 1), InProcess) and isinstance(make_runner(None), LocalProcesses)


def sweep(trace, out, *extra):
    assert main(["sim", "--trace", str(trace), "--profile", "rtx4090", "--model-shape", "mixtral-8x7b",
                 "--policy", "lru,lfu", "--expert-memory", "10%,20%", "--out", str(out), *extra]) == 0
    return [(r["policy"], r["expert_memory"], r["tpot_s"], r["hit_rate"]) for r in
            json.loads((out / "sweep.json").read_text())["runs"]]


def test_a_sweep_gives_the_same_table_in_this_process_and_in_workers(tmp_path):
    trace = mixtral_shaped(tmp_path)
    assert sweep(trace, tmp_path / "a", "--workers", "1") == sweep(trace, tmp_path / "b", "--workers", "2")


def mixtral_shaped(tmp_path):
    """A drawn trace of Mixtral's shape (8 experts, top-2, 32 layers)."""
    from moetier.sim.doctor import LOCALITY
    from moetier.trace.synthetic import generate

    path = tmp_path / "mixtral"
    generate(LOCALITY, 32, 8, 2, 40, model="mixtral-8x7b").save(path)
    return path


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="Ray is an optional extra")
def test_a_sweep_on_ray_gives_the_same_table(tmp_path):
    trace = mixtral_shaped(tmp_path)
    try:
        assert sweep(trace, tmp_path / "r", "--ray", "local") == sweep(trace, tmp_path / "l", "--workers", "1")
    finally:
        import ray

        ray.shutdown()


def test_ray_without_ray_installed_is_refused_before_anything_loads(monkeypatch, capsys, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    assert main(["sim", "--trace", str(tmp_path / "missing"), "--ray", "auto"]) == 1
    err = capsys.readouterr().err
    assert "--ray needs Ray" in err and "moetier[ray]" in err
