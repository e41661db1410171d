"""bench/peers/compare.py --policy: moetier's runs evict by it, and a name moetier does not know is refused in one
line before anything is built, converted or run."""

import subprocess
import sys

from tests.bench.test_peers_pairs import SCRIPT


def test_an_unknown_policy_is_refused_before_anything_runs(tmp_path):
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, str(SCRIPT), "--policy", "bogus", "--formats", "q4_k_m", "--caps", "20",
                        "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert r.stderr.startswith("compare.py: error: unknown eviction policy 'bogus'")
    assert "hint: one of lru" in r.stderr and "comoe" in r.stderr
    assert not out.exists()  # nothing written


def test_the_policy_reaches_moetiers_run(monkeypatch, tmp_path):
    from tests.bench.test_peers_pairs import load_compare

    compare = load_compare()
    seen = {}

    def caged(argv, cap, name, timeout, env):
        import json

        seen.update(json.loads(argv[-1]))
        return subprocess.CompletedProcess(argv, 1, "", "stopped here"), 0

    monkeypatch.setattr(compare, "run_caged", caged)
    r = compare.moetier_run(tmp_path, ("same file", "native", "native"), None, 4, 10, policy="lfu")
    assert seen["policy"] == "lfu" and "error" in r
