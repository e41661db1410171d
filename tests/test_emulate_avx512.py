"""The opt-in emulation (tests/emulate_avx512.py) stays usable: each source with an AVX-512 or AVX-VNNI branch
compiles for an AVX2 CPU with that branch taken, SIMDe emulating its intrinsics (a new intrinsic SIMDe lacks fails
here, not in the slow run that needs it)."""

import platform
import shutil
import subprocess

import pytest

from moetier.model import native
from tests.emulate_avx512 import emulated

simde_py = pytest.importorskip("simde_py", reason="needs simde-py (the test extra)")


@pytest.mark.skipif(shutil.which("gcc") is None or platform.machine() not in ("x86_64", "AMD64"),
                    reason="needs gcc for x86-64 (the flags are AVX2's)")
@pytest.mark.parametrize("isa,source,says", [("avx512", "q_int.c", '#define QI_ISA "avx512-vnni"'),
                                             ("avx512", "q_ggml.c", None), ("avx512", "bf16_rows.c", None),
                                             ("avx2-vnni", "q_int.c", '#define QI_ISA "avx2-vnni"'),
                                             ("avx2-vnni", "q_ggml.c", None)])
def test_each_branch_compiles_for_avx2_under_emulation(isa, source, says):
    isa = emulated(next(i for i in native.ISAS if i.name == isa), simde_py.get_include())
    assert not any(f.startswith(("-mavx512", "-mavxvnni")) for f in isa.flags)
    assert isa.needs == next(i for i in native.ISAS if i.name == "avx2").needs
    path = native.CSRC / source
    built = subprocess.run(["gcc", *isa.flags, "-fopenmp", "-fsyntax-only", str(path)],
                           capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-2000:]
    if says:
        macros = subprocess.run(["gcc", *isa.flags, "-fopenmp", "-E", "-dM", str(path)], capture_output=True,
                                text=True).stdout
        assert says in macros.splitlines()  # the branch emulated, not the AVX2 one
