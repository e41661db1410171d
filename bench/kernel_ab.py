"""Two builds of the quantized expert kernels (moetier/model/csrc/q_int.c and the header it includes) side by side
in one process: the sources at a git revision or in a folder (`--base`, default HEAD) against the working tree's,
each compiled with the flags moetier builds its library with for this CPU's best instruction set, then timed in
alternation — one expert (`moetier_swiglu_qi`) and a layer's eight at batch 1
(`moetier_swiglu_qi_token`, a decode step's path), each call taking the next of `--copies` random experts so they
come from memory as a decode's do. The outputs of the two builds are compared bit for bit first (said in the
table). What a change to csrc/ gains, measured apart from the machine's drift between runs: on these 2-core
machines one kernel's time moved by half between runs a minute apart (docs/performance.md), more than most
changes gain.

    python bench/kernel_ab.py                        # HEAD against the working tree, int8/int4/int2
    python bench/kernel_ab.py --base 2e3e51d --bits 4 --rounds 20
    python bench/kernel_ab.py --base /tmp/my-csrc    # a folder holding q_int.c and bf16.h
    python bench/kernel_ab.py --emulate-avx512 --rounds 2 --calls 8   # the AVX-512 branch's outputs, on AVX2
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from common import OUT, cpu_description, save_figure  # noqa: E402

LAYER = 8  # experts a layer computes for one token (OLMoE's top-8)
SOURCES = ("q_int.c", "bf16.h")  # the kernels' file and what it includes (it links alone)


def build(sources: dict[str, bytes], emulate_avx512: bool = False) -> Path:
    """The sources (file name -> text) compiled with moetier.model.native's flags into a library named by what went
    into it, in the kernels' cache (a build of the same sources is made once). `emulate_avx512`: the AVX-512
    branch built for AVX2, SIMDe emulating it (tests/emulate_avx512.py): its outputs a real AVX-512 CPU's, its times
    nothing."""
    from moetier.model import native
    from moetier.paths import default_cache_dir

    compiler, isa = native._compiler(), native.runnable_isas()[-1]
    flags = native._flags(isa)
    if emulate_avx512:
        import simde_py

        from tests.emulate_avx512 import emulated

        isa = "avx512-emulated"
        flags = (*native.FLAGS, *emulated(next(i for i in native.ISAS if i.name == "avx512"),
                                          simde_py.get_include()).flags)
    key = hashlib.sha256(b"".join(name.encode() + text for name, text in sorted(sources.items()))
                         + " ".join((compiler, *flags)).encode()).hexdigest()[:16]
    lib = default_cache_dir() / "kernels" / f"kernel-ab-{isa}-{key}.so"
    if not lib.exists():
        lib.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".kernel-ab-", dir=lib.parent) as tmp:
            for name, text in sources.items():
                (Path(tmp) / name).write_bytes(text)
            subprocess.run([compiler, *flags, str(Path(tmp) / "q_int.c"), "-o", str(Path(tmp) / lib.name), "-lm"],
                           check=True, capture_output=True, text=True)
            os.replace(Path(tmp) / lib.name, lib)  # (whole or not at all)
    return lib


def sources_at(base: str | None) -> dict[str, bytes]:
    """The kernels' sources in folder `base`, at git revision `base`, or the working tree's (None)."""
    csrc = ROOT / "moetier" / "model" / "csrc"
    if base is None:
        return {name: (csrc / name).read_bytes() for name in SOURCES}
    if Path(base).is_dir():
        return {name: (Path(base) / name).read_bytes() for name in SOURCES}
    rel = csrc.relative_to(ROOT).as_posix()
    return {name: subprocess.run(["git", "show", f"{base}:{rel}/{name}"], cwd=ROOT, check=True,
                                 capture_output=True).stdout for name in SOURCES}


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, n, i = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
    lib.moetier_swiglu_qi_scratch.argtypes, lib.moetier_swiglu_qi_scratch.restype = [i, n, n, n, n, i], n
    lib.moetier_swiglu_qi.argtypes = [i, p, p, p, n, p, p, p, n, p, p, p, n, n, i, p]
    lib.moetier_swiglu_qi_token_scratch.argtypes, lib.moetier_swiglu_qi_token_scratch.restype = [i, n, n, n, n, n], n
    lib.moetier_swiglu_qi_token.argtypes = [i, n, p, p, p, n, p, p, p, n, p, p, p, n, n, p]
    return lib


def bf16(a) -> np.ndarray:
    return (np.asarray(a, np.float32).view(np.uint32) >> 16).astype(np.uint16)


def random_expert(rng, bits: int, hidden: int, inter: int, group: int) -> dict:
    """Codes, scales and zeros of a random SwiGLU expert as a store holds them (moetier/quant/codes.py)."""
    def matrix(n, k):
        if bits == 8:
            return (rng.integers(-127, 128, (n, k), dtype=np.int8).view(np.uint8), bf16(rng.uniform(1e-3, 2e-3, n)),
                    None)
        groups = k // group
        return (rng.integers(0, 256, (n, k * bits // 8), dtype=np.uint8),
                bf16(rng.uniform(1e-3, 2e-3, (n, groups))), bf16(rng.uniform(-1e-3, 1e-3, (n, groups))))

    return dict(zip(("gc", "gs", "gz"), matrix(2 * inter, hidden))) | dict(zip(("dc", "ds", "dz"),
                                                                               matrix(hidden, inter)))


class Kernels:
    """One build's two kernels on a fixed set of experts and one token."""

    def __init__(self, lib: ctypes.CDLL, bits: int, experts: list[dict], hidden: int, inter: int, group: int):
        self.lib, self.bits, self.experts, self.h, self.i = lib, bits, experts, hidden, inter
        self.groups = (hidden, inter) if bits == 8 else (group, group)
        ptr = self.ptr
        self.x = bf16(np.random.default_rng(1).standard_normal(hidden))
        self.w = np.full(LAYER, 1 / LAYER, np.float32)
        self.y = np.zeros(hidden, np.uint16)
        self.scratch = np.zeros(lib.moetier_swiglu_qi_scratch(bits, *self.groups, hidden, inter, 1) + 64, np.uint8)
        self.token_scratch = np.zeros(lib.moetier_swiglu_qi_token_scratch(bits, *self.groups, hidden, inter, LAYER)
                                      + 64, np.uint8)
        layers = [experts[j:j + LAYER] for j in range(0, len(experts) - LAYER + 1, LAYER)]
        self.layers = [{k: (ctypes.c_void_p * LAYER)(*[ptr(e[k]) for e in es]) for k in es[0]} for es in layers]

    @staticmethod
    def ptr(a):
        return None if a is None else a.ctypes.data

    def expert(self, j: int) -> np.ndarray:
        e, ptr = self.experts[j % len(self.experts)], self.ptr
        self.lib.moetier_swiglu_qi(self.bits, ptr(e["gc"]), ptr(e["gs"]), ptr(e["gz"]), self.groups[0], ptr(e["dc"]),
                                   ptr(e["ds"]), ptr(e["dz"]), self.groups[1], ptr(self.x), ptr(self.w),
                                   ptr(self.y), self.h, self.i, 1, ptr(self.scratch))
        return self.y

    def layer(self, j: int) -> np.ndarray:
        a, ptr = self.layers[j % len(self.layers)], self.ptr
        self.lib.moetier_swiglu_qi_token(self.bits, LAYER, a["gc"], a["gs"], a["gz"], self.groups[0], a["dc"],
                                         a["ds"], a["dz"], self.groups[1], ptr(self.x), ptr(self.w), ptr(self.y),
                                         self.h, self.i, ptr(self.token_scratch))
        return self.y


def compare(builds: dict[str, ctypes.CDLL], bits: int, args) -> list[dict]:
    """Each kernel's rows for `bits`: both builds' times over the rounds, alternated, and whether they agree."""
    from moetier.quant.formats import GROUP_SIZE

    group = GROUP_SIZE.get(f"int{bits}", args.hidden)
    rng = np.random.default_rng(0)
    experts = [random_expert(rng, bits, args.hidden, args.inter, group) for _ in range(args.copies)]
    kernels = {name: Kernels(lib, bits, experts, args.hidden, args.inter, group) for name, lib in builds.items()}
    rows = []
    for kind, calls in (("expert", args.calls), ("layer", max(1, args.calls // LAYER))):
        same = len({getattr(k, kind)(0).tobytes() for k in kernels.values()}) == 1
        times: dict[str, list[float]] = {name: [] for name in kernels}
        for r in range(args.rounds):
            for name in (list(kernels) if r % 2 == 0 else list(kernels)[::-1]):  # (each build first in turn)
                run = getattr(kernels[name], kind)
                start = time.perf_counter()
                for j in range(calls):
                    run(j)
                times[name].append((time.perf_counter() - start) / calls)
        base, head = (statistics.median(t) for t in times.values())
        rows.append({"bits": bits, "kernel": kind, "same_outputs": same, "base_ms": base * 1e3, "head_ms": head * 1e3,
                     "head_over_base": head / base, "rounds_ms": {n: [t * 1e3 for t in ts] for n, ts in times.items()},
                     "head_faster_rounds": sum(h < b for b, h in zip(*times.values()))})
    return rows


def plot(rows: list[dict], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1.4 + 1.3 * len(rows), 3.6))
    for i, row in enumerate(rows):
        for j, (name, color) in enumerate((("base", "#999999"), ("head", "#1f77b4"))):
            ts = list(row["rounds_ms"].values())[j]
            med = statistics.median(ts)
            ax.bar(i + (j - 0.5) * 0.38, med, 0.36, color=color, label=name if i == 0 else None,
                   yerr=[[med - min(ts)], [max(ts) - med]], capsize=3)
    ax.set_xticks(range(len(rows)), [f"int{r['bits']}\n{r['kernel']}" for r in rows])
    ax.set_ylabel("ms a call (median, range over rounds)")
    ax.legend()
    save_figure(fig, title, path)


def refuse(message: str) -> None:
    raise SystemExit(f"kernel_ab: error: {message}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="HEAD", help="the git revision, or a folder holding q_int.c and bf16.h, whose "
                                                   "kernels are the base")
    ap.add_argument("--bits", default="8,4,2", help="code widths, comma-separated")
    ap.add_argument("--shape", default="2048x1024", help="HIDDENxINTERMEDIATE (OLMoE-1B-7B's by default)")
    ap.add_argument("--copies", type=int, default=64, help="random experts cycled through (64: from memory)")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--calls", type=int, default=64, help="calls a round (a layer's: an eighth as many)")
    ap.add_argument("--emulate-avx512", action="store_true",
                    help="both builds' AVX-512 branch on this AVX2 CPU, SIMDe emulating it (needs simde-py, the test "
                         "extra): whether a change keeps a Zen 4's or a Xeon's outputs bit for bit; its times mean "
                         "nothing")
    ap.add_argument("--out", type=Path, default=OUT / "kernel-ab")
    args = ap.parse_args()
    try:
        bits = [int(b) for b in args.bits.split(",")]
        args.hidden, args.inter = (int(v) for v in args.shape.lower().split("x"))
    except ValueError:
        refuse(f"--bits takes widths like 8,4,2 and --shape HIDDENxINTERMEDIATE; got {args.bits!r}, {args.shape!r}")
    if any(b not in (8, 4, 2) for b in bits) or args.copies < 8 or args.rounds < 2 or args.calls < 8:
        refuse("--bits from 8, 4, 2; --copies at least 8 (a layer's); --rounds at least 2; --calls at least 8")
    if args.hidden <= 0 or args.inter <= 0 or args.hidden % 128 or args.inter % 128:
        refuse(f"--shape needs widths in whole groups of 128; got {args.shape}")
    if args.emulate_avx512:
        try:
            import simde_py  # noqa: F401
        except ImportError:
            refuse("--emulate-avx512 needs SIMDe's headers: pip install simde-py (in moetier's test extra)")
    try:
        base_sources = sources_at(args.base)
    except (subprocess.CalledProcessError, OSError):
        refuse(f"--base {args.base!r} is neither a folder holding {' and '.join(SOURCES)} nor a revision of this "
               f"repository whose kernels git can show")
    builds = {}
    for name, sources in (("base", base_sources), ("head", sources_at(None))):
        try:
            builds[name] = declare(ctypes.CDLL(str(build(sources, args.emulate_avx512))))
        except subprocess.CalledProcessError as e:
            first = next((line for line in e.stderr.splitlines() if "error" in line), e.stderr.strip()[:200])
            refuse(f"the {name}'s kernels do not compile: {first}")
    rows = [row for b in bits for row in compare(builds, b, args)]
    print(f"{'kernel':>12} {'base ms':>8} {'head ms':>8} {'head/base':>9} {'head faster':>11}  outputs")
    for r in rows:
        print(f"{'int%d %s' % (r['bits'], r['kernel']):>12} {r['base_ms']:8.3f} {r['head_ms']:8.3f} "
              f"{r['head_over_base']:9.2f} {r['head_faster_rounds']:>5} of {args.rounds:<3}  "
              f"{'bit for bit' if r['same_outputs'] else 'DIFFER'}")
    args.out.mkdir(parents=True, exist_ok=True)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    if args.emulate_avx512:
        print("(the AVX-512 branch emulated on AVX2: the outputs are what an AVX-512 CPU computes, the times are not)")
    body = {"base": args.base, "head": f"working tree on {head.strip()}", "shape": args.shape, "copies": args.copies,
            "rounds": args.rounds, "cpu": cpu_description(), "emulated_avx512": args.emulate_avx512, "rows": rows}
    (args.out / "kernel-ab.json").write_text(json.dumps(body, indent=1))
    plot(rows, f"kernels at {args.base} (base) against the working tree (head), {args.shape}, batch 1",
         args.out / "kernel-ab.png")
    print(f"wrote {args.out / 'kernel-ab.json'} and {args.out / 'kernel-ab.png'}")


if __name__ == "__main__":
    main()
