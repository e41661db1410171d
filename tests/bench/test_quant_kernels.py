"""bench/quant_kernels.py's GGML paths compute what they time: each block format's expert (GgmlExpert on the native
kernels) against its own blocks dequantized, warm and rotating over cold copies."""

import sys
from pathlib import Path

import pytest
import torch

from moetier.model import native

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import quant_kernels  # noqa: E402

NATIVE = native.load()


@pytest.mark.skipif(NATIVE.lib is None, reason=f"no native kernels: {NATIVE.reason}")
@pytest.mark.parametrize("cold", [0, 2])
def test_every_block_format_computes_its_own_dequantized_expert(cold):
    g = torch.Generator().manual_seed(0)
    hidden, inter = 256, 512
    gate_up = (torch.randn(2 * inter, hidden, generator=g) * hidden ** -0.5).to(torch.bfloat16)
    down = (torch.randn(hidden, inter, generator=g) * inter ** -0.5).to(torch.bfloat16)
    found = quant_kernels.ggml_paths(gate_up, down, cold)
    assert sorted(found) == sorted(f"{fmt} moetier" for fmt in quant_kernels.GGML)
    x = torch.randn(3, hidden, generator=g).to(torch.bfloat16)
    for name, (precision, fn, (w_gu, w_d)) in found.items():
        assert name == f"{precision} moetier"
        ref = quant_kernels.swiglu_out(x.float() @ w_gu.float().t(), lambda h, w_d=w_d: h @ w_d.float().t())
        outs = [fn(x).float() for _ in range(max(cold, 1))]  # each call on the next copy
        for out in outs:
            error = ((out - ref).norm() / ref.norm()).item()
            assert error < 0.03, (name, error)  # the activations' int8 rounding and bf16's, no more
        assert all(torch.equal(outs[0], o) for o in outs), name  # the copies hold the same blocks


def test_an_only_that_names_no_path_is_refused_in_one_line(tmp_path):
    import subprocess

    r = subprocess.run([sys.executable, str(Path(quant_kernels.__file__)), "--shapes", "256x512", "--tokens", "1",
                        "--only", "nothing", "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("quant_kernels: error: --only 'nothing' names no path")
    assert not (tmp_path / "quant_kernels.json").exists()  # nothing written
