"""The native kernels — bf16 rows (`csrc/bf16_rows.c`), quantized experts unpacked to floats (`csrc/q_rows.c`) and
by integer dot products (`csrc/q_int.c`): compiled on first use with the machine's C compiler into moetier's
cache, then loaded with ctypes. Nothing to build at install time, no torch headers (it compiles in 4 s on two
cores, its sources at once); where there is no compiler or no AVX2, `load()` says why and the torch kernels run
instead.

One library per instruction set (`ISAS`), built for the best this CPU has: AVX2 + FMA is the floor; `avx2-vnni`
adds AVX-VNNI (the 256-bit vpdpbusd of Intel's cores from Alder Lake on, which have no AVX-512: the
integer kernels' sums in one instruction, the AVX2 library's bits); `avx512` adds AVX-512 VNNI (vpdpbusd: 64
products an instruction) and BF16. The sources choose their paths by the compiler's own macros (`__AVX512VNNI__`,
`__AVXVNNI__`, ...), so each library is the same code built for another CPU; the tests run every library the
machine can run, and tests/emulate_avx512.py the others, their intrinsics emulated."""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from moetier.paths import default_cache_dir
from moetier.portable import usable_cores

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = tuple(CSRC / name for name in ("bf16_rows.c", "q_rows.c", "q_int.c", "decode_block.c", "route.c",
                                         "token_routed.c", "decode_step.c", "q_ggml.c"))
HEADERS = (CSRC / "bf16.h",)
FLAGS = ("-O3", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC")
VECTOR_CAPABILITIES = ("AVX2", "AVX512")  # what torch.backends.cpu.get_cpu_capability() calls AVX2 or better


@dataclass(frozen=True)
class Isa:
    """An instruction-set level: the compiler's flags, and the CPU flags (/proc/cpuinfo) it needs."""

    name: str
    flags: tuple[str, ...]
    needs: tuple[str, ...]


# best last; each includes avx2's (a CPU may run avx512 and not avx2-vnni: Zen 4)
ISAS = (
    Isa("avx2", ("-mavx2", "-mfma", "-mf16c"), ("avx2", "fma", "f16c")),
    # AVX2 with AVX-VNNI's 256-bit integer dot products (Intel's cores from Alder Lake on, whose AVX-512 is off):
    # the integer kernels' sums in one instruction where AVX2 takes three, the same sums (the AVX2 library's bits)
    Isa("avx2-vnni", ("-mavx2", "-mfma", "-mf16c", "-mavxvnni"), ("avx2", "fma", "f16c", "avx_vnni")),
    Isa("avx512", ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
                   "-mavx512vnni", "-mavx512bf16"),
        ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16")),
)


@dataclass(frozen=True)
class Loaded:
    """The library, or why there is none; `isa`: the instruction set it was built for."""

    lib: ctypes.CDLL | None
    reason: str = ""
    isa: str = ""


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux lists them (empty where there is no /proc/cpuinfo)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def runnable_isas(flags: frozenset[str] | None = None) -> list[str]:
    """The instruction sets this CPU runs, best last. Without a flag list (not Linux), AVX2 when torch sees it."""
    flags = cpu_flags() if flags is None else flags
    if not flags:
        return ["avx2"] if torch.backends.cpu.get_cpu_capability() in VECTOR_CAPABILITIES else []
    return [isa.name for isa in ISAS if set(isa.needs) <= flags]


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _flags(isa: str) -> tuple[str, ...]:
    return (*FLAGS, *next(i.flags for i in ISAS if i.name == isa))


def _library_path(compiler: str, isa: str) -> Path:
    """Named by what went into it, so a changed source or compiler builds anew beside the old one."""
    key = hashlib.sha256(b"".join(s.read_bytes() for s in SOURCES + HEADERS)
                         + " ".join((compiler, *_flags(isa))).encode())
    return default_cache_dir() / "kernels" / f"moetier-kernels-{isa}-{key.hexdigest()[:16]}.so"


def _build(compiler: str, isa: str, path: Path) -> None:
    """Compile each source in a process of its own, as many at once as this process may use cores (all eight one
    after another took 9 s on a Zen 3, q_int.c a third of it), link them under a temporary name beside `path`
    and rename into place (two processes building at once both succeed; nothing half-written is ever loaded)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{path.name}.", dir=path.parent) as tmp:
        objects = [Path(tmp) / f"{source.stem}.o" for source in SOURCES]
        compiles = [[compiler, *_flags(isa), "-c", str(source), "-o", str(obj)]
                    for source, obj in zip(SOURCES, objects)]
        with ThreadPoolExecutor(usable_cores()) as pool:
            list(pool.map(_compile, compiles))  # (the first failure raises here)
        linked = Path(tmp) / path.name
        _compile([compiler, *_flags(isa), *map(str, objects), "-o", str(linked), "-lm"])
        os.replace(linked, path)


def _compile(argv: list[str]) -> None:
    subprocess.run(argv, check=True, capture_output=True, text=True)


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, n = ctypes.c_void_p, ctypes.c_long
    lib.moetier_linear_bf16.argtypes = [p, p, p, p, n, n, p]
    lib.moetier_linear_bf16.restype = None
    lib.moetier_swiglu_bf16.argtypes = [p, p, p, ctypes.c_float, p, n, n, p]
    lib.moetier_swiglu_bf16.restype = None
    lib.moetier_rms_norm_bf16.argtypes = [p, p, p, n, n, ctypes.c_float]
    lib.moetier_rms_norm_fp32w_bf16.argtypes = [p, p, p, n, n, ctypes.c_float]
    lib.moetier_rms_norm_fp32w_bf16.restype = None
    lib.moetier_sum_rows_bf16.argtypes = [p, n, n, p]
    lib.moetier_sum_rows_bf16.restype = None
    lib.moetier_rms_norm_bf16.restype = None
    lib.moetier_rope_bf16.argtypes = [p, p, p, p, n, n]
    lib.moetier_rope_bf16.restype = None
    lib.moetier_decode_attention_bf16.argtypes = [p, p, p, p, n, n, n, n, n, n, ctypes.c_float, p]
    lib.moetier_decode_attention_bf16.restype = None
    lib.moetier_decode_attention_sinks_bf16.argtypes = [p, p, p, p, n, n, n, n, n, n, ctypes.c_float, p, p]
    lib.moetier_decode_attention_sinks_bf16.restype = None
    i = ctypes.c_int
    lib.moetier_swiglu_q.argtypes = [i, p, p, p, n, p, p, p, n, p, p, p, n, n, i, p]
    lib.moetier_swiglu_q.restype = None
    lib.moetier_dequant_q.argtypes = [i, p, p, p, n, n, n, p]
    lib.moetier_dequant_q.restype = None
    lib.moetier_qi_isa.argtypes = []
    lib.moetier_qi_isa.restype = ctypes.c_char_p
    lib.moetier_qi_fits.argtypes = [i, n, n]
    lib.moetier_qi_fits.restype = i
    lib.moetier_qi_block.argtypes = [i, n, n]
    lib.moetier_qi_block.restype = n
    lib.moetier_swiglu_qi_scratch.argtypes = [i, n, n, n, n, i]
    lib.moetier_swiglu_qi_scratch.restype = n
    lib.moetier_swiglu_qi.argtypes = [i, p, p, p, n, p, p, p, n, p, p, p, n, n, i, p]
    lib.moetier_swiglu_qi.restype = None
    lib.moetier_linear_qi_scratch.argtypes = [i, n, n, n, i]
    lib.moetier_linear_qi_scratch.restype = n
    lib.moetier_linear_qi.argtypes = [i, p, p, p, n, p, p, n, n, i, p]
    lib.moetier_linear_qi.restype = None
    lib.moetier_swiglu_qi_layer_scratch.argtypes = [i, n, n, n, n, n]
    lib.moetier_swiglu_qi_layer_scratch.restype = n
    lib.moetier_swiglu_qi_layer.argtypes = [i, n, p, p, p, n, p, p, p, n, p, n, p, p, p, n, n, p]
    lib.moetier_swiglu_qi_layer.restype = None
    lib.moetier_swiglu_qi_token_scratch.argtypes = [i, n, n, n, n, n]
    lib.moetier_swiglu_qi_token_scratch.restype = n
    lib.moetier_swiglu_qi_token.argtypes = [i, n, p, p, p, n, p, p, p, n, p, p, p, n, n, p]
    lib.moetier_swiglu_qi_token.restype = None
    lib.moetier_linear_bf16_rows.argtypes = [p, p, p, p, n, n, n, p]
    lib.moetier_linear_bf16_rows.restype = None
    lib.moetier_swiglu_bf16_layer.argtypes = [n, p, p, p, n, p, p, p, n, n, p]
    lib.moetier_swiglu_bf16_token.argtypes = [n, p, p, p, p, p, n, n, p]
    lib.moetier_swiglu_bf16_token.restype = None
    lib.moetier_kv_write.argtypes = [p, p, p, p, n, n, n, n, n]
    lib.moetier_kv_write.restype = None
    lib.moetier_swiglu_bf16_layer.restype = None
    lib.moetier_decode_block_bf16.argtypes = [p, p, p, p, p, n, n, p, p, p, p, p, p]
    lib.moetier_decode_block_bf16.restype = None
    lib.moetier_decode_block_rows.argtypes = [p, n, p, p, p, p, p, n, p, p, p, p, p, p, p]
    lib.moetier_decode_block_rows.restype = None
    lib.moetier_swiglu_bf16_token_routed.argtypes = [p, p, p, n, n, p, p, n, n, p]
    lib.moetier_swiglu_bf16_token_routed.restype = None
    lib.moetier_swiglu_qi_token_routed.argtypes = [i, p, p, p, n, n, n, n, p, p, n, n, p]
    lib.moetier_swiglu_qi_token_routed.restype = None
    lib.moetier_decode_step_resident.argtypes = [n, p, p, p, n, n, n, p, p, p, p, p, p]
    lib.moetier_decode_step_resident.restype = None
    lib.moetier_route_softmax.argtypes = [p, n, n, n, n, n, ctypes.c_float, n, p, p, p]
    lib.moetier_route_softmax.restype = None
    lib.moetier_gq_act_bytes.argtypes = [i, n]
    lib.moetier_gq_act_bytes.restype = n
    lib.moetier_gq_quantize_act.argtypes = [i, p, n, i, p]
    lib.moetier_gq_quantize_act.restype = None
    lib.moetier_gq_fits.argtypes = [i, n]
    lib.moetier_gq_fits.restype = i
    lib.moetier_gq_linear.argtypes = [i, p, n, n, p, i, p]
    lib.moetier_gq_linear.restype = None
    lib.moetier_gq_linear_tokens.argtypes = [i, p, n, n, p, n, p]
    lib.moetier_gq_linear_tokens.restype = None
    lib.moetier_gq_dequantize.argtypes = [i, p, n, n, p]
    lib.moetier_gq_dequantize.restype = None
    lib.moetier_gq_dequantize_bf16.argtypes = [i, p, n, n, p]
    lib.moetier_gq_dequantize_bf16.restype = None
    lib.moetier_gq_token_scratch.argtypes = [n, n, n]
    lib.moetier_gq_token_scratch.restype = n
    lib.moetier_gq_swiglu_token_routed.argtypes = [p, p, p, n, n, n, n, p, p, p]
    lib.moetier_gq_swiglu_token_routed.restype = None
    lib.moetier_gq_swiglu_scratch.argtypes = [i, i, n, n, i]
    lib.moetier_gq_swiglu_scratch.restype = n
    lib.moetier_gq_swiglu.argtypes = [i, p, i, p, n, n, p, i, p, p, p]
    lib.moetier_gq_swiglu.restype = None
    lib.moetier_gq_layer_scratch.argtypes = [n, n, n]
    lib.moetier_gq_layer_scratch.restype = n
    lib.moetier_gq_swiglu_layer.argtypes = [n, p, p, p, p, p, n, p, p, p, n, n, p]
    lib.moetier_gq_swiglu_layer.restype = None
    f = ctypes.c_float  # gpt-oss's experts (q_ggml.c gq_glu): their biases, alpha and limit beside
    lib.moetier_gq_glu_token_routed.argtypes = [p, p, p, n, n, n, n, f, f, p, p, p]
    lib.moetier_gq_glu_token_routed.restype = None
    lib.moetier_gq_glu_layer.argtypes = [n, p, p, p, p, p, p, f, f, p, n, p, p, p, n, n, p]
    lib.moetier_gq_glu_layer.restype = None
    lib.moetier_threads.argtypes = []
    lib.moetier_threads.restype = n
    return lib


def best_buildable(compiler: str, runnable: list[str]) -> str:
    """The best of `runnable` built already, or whose flags `compiler` takes (gcc before 11 has no -mavxvnni: an
    Alder Lake's AVX2 library then, not none), else the floor."""
    return next((isa for isa in reversed(runnable)
                 if _library_path(compiler, isa).exists() or _compiler_takes(compiler, isa)), runnable[0])


def _compiler_takes(compiler: str, isa: str) -> bool:
    """Whether `compiler` accepts `isa`'s flags (preprocessing nothing: ~20 ms)."""
    try:
        probe = subprocess.run([compiler, *_flags(isa), "-E", "-x", "c", os.devnull, "-o", os.devnull],
                               capture_output=True)
    except OSError:  # (no such compiler: the build says so)
        return False
    return probe.returncode == 0


def load(isa: str | None = None) -> Loaded:
    """Build (once per machine, source and instruction set) and load the kernels: for `isa`, or the best this CPU
    runs."""
    runnable = runnable_isas()
    if not runnable:
        return Loaded(None, f"this CPU has no AVX2 (torch reports {torch.backends.cpu.get_cpu_capability()})")
    if isa is not None and isa not in runnable:
        return Loaded(None, f"this CPU cannot run {isa} (it runs {', '.join(runnable)})")
    compiler = _compiler()
    if compiler is None:
        return Loaded(None, "no C compiler found (set CC, or install gcc)")
    isa = isa or best_buildable(compiler, runnable)
    path = _library_path(compiler, isa)
    try:
        if not path.exists():
            _build(compiler, isa, path)
        return Loaded(_declare(ctypes.CDLL(str(path))), isa=isa)
    except subprocess.CalledProcessError as e:
        return Loaded(None, f"{compiler} failed on {', '.join(s.name for s in SOURCES)}: {e.stderr.strip()[-300:]}")
    except OSError as e:
        return Loaded(None, f"could not build or load {path}: {e}")
