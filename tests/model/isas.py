"""The native libraries the kernel tests run: each this CPU runs, and those it cannot, skipped with the reason.

The avx2-vnni library is not among them: built from the AVX2 branch with its dot products in VNNI, its outputs are
held to the AVX2 library's bit for bit instead (test_expert_kernels.py, test_ggml_linear.py) — a stronger check
than each test's tolerance, at a fraction of the time (its ~400 runs of every kernel test would be the AVX2 ones
again on the CPUs that have it)."""

import pytest

from moetier.model import native

SAME_BITS_AS = {"avx2-vnni": "avx2"}  # library -> the library whose outputs it must equal


def isa_params() -> list:
    return [pytest.param(isa.name, marks=pytest.mark.skipif(isa.name not in native.runnable_isas(),
                                                             reason=f"this CPU cannot run {isa.name}"))
            for isa in native.ISAS if isa.name not in SAME_BITS_AS]
