"""The native kernels — bf16 rows (`csrc/bf16_rows.c`) and quantized experts (`csrc/q_rows.c`): compiled on first use with the machine's C compiler into
moetier's cache, then loaded with ctypes. Nothing to build at install time, no torch headers (it compiles in
under a second); where there is no compiler or no AVX2, `load()` says why and the torch kernels run instead."""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch

from moetier.paths import default_cache_dir

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = tuple(CSRC / name for name in ("bf16_rows.c", "q_rows.c"))
HEADERS = (CSRC / "bf16.h",)
FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC")
VECTOR_CAPABILITIES = ("AVX2", "AVX512")  # what torch.backends.cpu.get_cpu_capability() calls AVX2 or better


@dataclass(frozen=True)
class Loaded:
    """The library, or why there is none."""

    lib: ctypes.CDLL | None
    reason: str = ""


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _library_path(compiler: str) -> Path:
    """Named by what went into it, so a changed source or compiler builds anew beside the old one."""
    key = hashlib.sha256(b"".join(s.read_bytes() for s in SOURCES + HEADERS) + " ".join((compiler, *FLAGS)).encode())
    return default_cache_dir() / "kernels" / f"moetier-kernels-{key.hexdigest()[:16]}.so"


def _build(compiler: str, path: Path) -> None:
    """Compile to a temporary name beside `path` and rename into place (two processes building at once both
    succeed; nothing half-written is ever loaded)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        subprocess.run([compiler, *FLAGS, *map(str, SOURCES), "-o", str(tmp), "-lm"], check=True, capture_output=True,
                       text=True)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, n = ctypes.c_void_p, ctypes.c_long
    lib.moetier_linear_bf16.argtypes = [p, p, p, p, n, n, p]
    lib.moetier_linear_bf16.restype = None
    lib.moetier_swiglu_bf16.argtypes = [p, p, p, ctypes.c_float, p, n, n, p]
    lib.moetier_swiglu_bf16.restype = None
    lib.moetier_rms_norm_bf16.argtypes = [p, p, p, n, n, ctypes.c_float]
    lib.moetier_rms_norm_bf16.restype = None
    lib.moetier_rope_bf16.argtypes = [p, p, p, p, n, n]
    lib.moetier_rope_bf16.restype = None
    lib.moetier_decode_attention_bf16.argtypes = [p, p, p, p, n, n, n, n, n, n, ctypes.c_float, p]
    lib.moetier_decode_attention_bf16.restype = None
    i = ctypes.c_int
    lib.moetier_swiglu_q.argtypes = [i, p, p, p, n, p, p, p, n, p, p, p, n, n, i, p]
    lib.moetier_swiglu_q.restype = None
    lib.moetier_dequant_q.argtypes = [i, p, p, p, n, n, n, p]
    lib.moetier_dequant_q.restype = None
    return lib


def load() -> Loaded:
    """Build (once per machine and source) and load the kernels."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in VECTOR_CAPABILITIES:
        return Loaded(None, f"this CPU has no AVX2 (torch reports {capability})")
    compiler = _compiler()
    if compiler is None:
        return Loaded(None, "no C compiler found (set CC, or install gcc)")
    path = _library_path(compiler)
    try:
        if not path.exists():
            _build(compiler, path)
        return Loaded(_declare(ctypes.CDLL(str(path))))
    except subprocess.CalledProcessError as e:
        return Loaded(None, f"{compiler} failed on {', '.join(s.name for s in SOURCES)}: {e.stderr.strip()[-300:]}")
    except OSError as e:
        return Loaded(None, f"could not build or load {path}: {e}")
