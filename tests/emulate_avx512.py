"""A pytest plugin: the native kernels' AVX-512 paths (and the avx2-vnni library's) tested on a CPU without them,
their intrinsics emulated by SIMDe (the simde-py package's headers, a test dependency):

    python -m pytest -p tests.emulate_avx512 tests/model -k avx512     # the library's own tests: 391, ~75 s
    python -m pytest -p tests.emulate_avx512 tests/model -k vnni       # the avx2-vnni library's: the AVX2 bits
    python -m pytest -p tests.emulate_avx512 tests/model tests/engine/test_demo_models.py \
        tests/engine/test_block_precisions.py tests/store/test_gguf_store.py   # and the engine on it: ~5 min

Where the plugin is on, the "avx512" library is built for AVX2 with tests/emulate_avx512.h force-included (the sources'
AVX-512 branches taken — vdpbf16ps rows, VNNI integer dot products, 64-byte chunks — as at any revision), and
needs only AVX2's flags, so every test parametrized by instruction set runs that path —
the code a Zen 4 or a Sapphire Rapids runs, checked by the same assertions on an AVX2-only machine. Emulation is
~10x slower and its library takes ~30 s to build (2 cores): for correctness only, and off in the README's test
command. The engine's own choice ("auto") then takes the emulated library too, so the second command decodes the
demo models, GGUF blocks and every family's bf16 parity on it. What it does not reach: processes a test starts (they
see the real CPU), and AMX (torch's). The three tests whose premise is the CPU's own instruction sets are skipped."""

from __future__ import annotations

from pathlib import Path

import pytest

from moetier.model import native

SHIM = Path(__file__).resolve().parent / "emulate_avx512.h"


EMULATED = ("avx512", "avx2-vnni")  # the libraries built here for a CPU without their instructions


def emulated(isa: native.Isa, include: str) -> native.Isa:
    """`isa` ("avx512", or "avx2-vnni") built for AVX2 with its own branches emulated; the CPU flags it needs:
    AVX2's."""
    avx2 = next(i for i in native.ISAS if i.name == "avx2")
    which = ("-DMOETIER_EMULATE_AVXVNNI",) if isa.name == "avx2-vnni" else ()
    return native.Isa(isa.name, (*avx2.flags, *which, "-I", include, "-include", str(SHIM),
                                 "-Wno-psabi"), avx2.needs)  # (psabi: SIMDe's 512-bit types passed by value)


def pytest_configure(config: pytest.Config) -> None:
    try:
        import simde_py
    except ImportError:
        raise pytest.UsageError("tests.emulate_avx512 needs simde-py (pip install simde-py): SIMDe's headers") from None
    if "avx2" not in native.runnable_isas():
        raise pytest.UsageError("tests.emulate_avx512 emulates AVX-512 on AVX2: this CPU has no AVX2")
    mp = pytest.MonkeyPatch()  # (the CPU's flags stay its own: what else reads them — the choice of a GEMM — sees it)
    mp.setattr(native, "ISAS", tuple(emulated(i, simde_py.get_include()) if i.name in EMULATED else i
                                     for i in native.ISAS))
    config.add_cleanup(mp.undo)


# tests whose premise is which instruction sets the CPU runs: under emulation this one "runs" avx512
PREMISE_IS_THE_CPU = ("test_the_instruction_sets_follow_the_cpus_flags",
                      "test_the_best_library_the_cpu_runs_is_built_and_one_it_cannot_run_is_refused",
                      "test_a_kernel_path_the_cpu_lacks_is_refused_in_one_line_before_anything_loads")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="its premise is the CPU's own instruction sets; tests.emulate_avx512 has this CPU "
                                   "run avx512")
    for item in items:
        if item.originalname in PREMISE_IS_THE_CPU:
            item.add_marker(skip)
