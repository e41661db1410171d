"""The opt-in AVX-512 emulation (tests/emulate_avx512.py) stays usable: each source with an AVX-512 branch compiles
for an AVX2 CPU with that branch taken, SIMDe emulating its intrinsics (a new intrinsic SIMDe lacks fails here, not
in the slow run that needs it)."""

import platform
import shutil
import subprocess

import pytest

from moetier.model import native
from tests.emulate_avx512 import emulated

simde_py = pytest.importorskip("simde_py", reason="needs simde-py (the test extra)")


@pytest.mark.skipif(shutil.which("gcc") is None or platform.machine() not in ("x86_64", "AMD64"),
                    reason="needs gcc for x86-64 (the flags are AVX2's)")
@pytest.mark.parametrize("source,says", [("q_int.c", '#define QI_ISA "avx512-vnni"'), ("q_ggml.c", None),
                                         ("bf16_rows.c", None)])
def test_each_avx512_branch_compiles_for_avx2_under_emulation(source, says):
    isa = emulated(next(i for i in native.ISAS if i.name == "avx512"), simde_py.get_include())
    assert "-mavx512f" not in isa.flags and isa.needs == next(i for i in native.ISAS if i.name == "avx2").needs
    path = native.CSRC / source
    built = subprocess.run(["gcc", *isa.flags, "-fopenmp", "-fsyntax-only", str(path)],
                           capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-2000:]
    if says:
        macros = subprocess.run(["gcc", *isa.flags, "-fopenmp", "-E", "-dM", str(path)], capture_output=True,
                                text=True).stdout
        assert says in macros.splitlines()  # the AVX-512 branch, not the AVX2 one
