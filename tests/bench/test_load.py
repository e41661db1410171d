"""The benchmarks' load awareness (bench/load.py): a run beside a busy process is measured as such, run again, and
marked when kept; the run's own processes are not foreign."""

import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import load  # noqa: E402

SPIN = "import time\nend = time.time() + {s}\nwhile time.time() < end: pass"


def hog(seconds: float) -> subprocess.Popen:
    """A process spinning one core for `seconds` (bounded: it ends by itself)."""
    return subprocess.Popen([sys.executable, "-c", SPIN.format(s=seconds)])


def test_a_run_beside_a_busy_process_is_run_again_and_marked():
    spinner = hog(8)
    try:
        time.sleep(0.3)  # (it is spinning before the run starts)
        result = load.measured(lambda: {"tok_s": 1.0} | ({} if time.sleep(0.6) else {}), threshold=0.25, reruns=1,
                               max_wait_s=0.3, window_s=0.2)
    finally:
        spinner.kill()
        spinner.wait()
    got = result["load"]
    assert result["tok_s"] == 1.0
    assert got["foreign_cores"] > 0.5 and got["under_load"] and got["reruns"] == 1
    assert len(got["attempts_foreign_cores"]) == 2 and got["waited_s"] >= 0.3
    assert load.mark([result]) == "*"


def test_the_runs_own_children_are_not_foreign_load():
    def run():
        subprocess.run([sys.executable, "-c", SPIN.format(s=0.8)], check=True)  # the benchmark's own child
        return {}

    result = load.measured(run, threshold=0.5, reruns=0, max_wait_s=5, window_s=0.2)
    assert result["load"]["foreign_cores"] < 0.5  # (its child's full core is its own)
    assert load.mark([result]) == ("*" if result["load"]["under_load"] else "")


def test_a_quiet_machine_is_waited_for_before_a_run():
    spinner = hog(1.0)
    try:
        waited, cores = load.wait_for_idle(threshold=0.25, max_wait_s=10, window_s=0.3)
    finally:
        spinner.kill()
        spinner.wait()
    assert waited >= 0.6  # (the hog's second was waited out: the machine did not count as idle while it spun)
