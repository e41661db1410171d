"""bench/peers/probe.py: the memory read rate compare.py records beside each run, from a fresh process."""

import subprocess
import sys
from pathlib import Path

PROBE = Path(__file__).resolve().parents[2] / "bench" / "peers" / "probe.py"


def test_the_probe_prints_a_read_rate_a_machine_can_have():
    out = subprocess.run([sys.executable, str(PROBE)], capture_output=True, text=True, check=True, timeout=120)
    rate = float(out.stdout.strip())  # GB/s
    assert 0.5 < rate < 2000, rate
