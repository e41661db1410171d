"""llama.cpp built with CUDA on the GPU machine — issue 52's peer for a GPU holding a share of the experts (item 7b):
its `--n-cpu-moe N` keeps the experts of the first N layers in host memory and computes them on the host's CPU,
the rest of the model on the GPU. Built there from a source tree carried with the check (the machine has nvcc,
CMake and ninja, and no network); the benchmark's synthetic OLMoE converted to a bf16 GGUF by llama.cpp's own
converter from the Hugging Face copy bench_gpu.py's accelerate rows read (the same weights as moetier's rows);
decoding timed by llama-bench at GPU expert budgets given as layers: a budget b keeps round(b·L) layers' experts on
the GPU (`--n-cpu-moe` L − round(b·L); 0%: every expert on the CPU, llama.cpp's `-ot exps=CPU`). `--type q4_k_m`
quantizes that bf16 file with llama.cpp's own llama-quantize first (the file a user downloads) and times it; its
path is printed, so moetier's rows run the same file (run.sh's `bench-q4km` stage).

    python bench/gpu/llamacpp_cuda.py pack              # here: .whl/llama/llama.cpp-src.tar.xz (~3 MB)
    python bench/gpu/llamacpp_cuda.py build --src .whl/llama/llama.cpp-src.tar.xz --tree /tmp/llama.cpp-cuda
    python bench/gpu/llamacpp_cuda.py bench --tree /tmp/llama.cpp-cuda --hf DIR --out bench-llamacpp.json

`pack` trims bench/peers' llama.cpp tree (llama-cpp-python 0.3.36's, fetched from PyPI on first use) to what
llama-bench, llama-quantize and the converter need, its tools list cut to those two. `build --cpu-only` builds the
same tree without CUDA (to try the packed tree out on a machine with no GPU)."""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "peers"))
from llamacpp import CMAKE_FLAGS, GGUF_TYPES, VERSION, LlamaCpp, fetch_source, home, parse_bench  # noqa: E402

PARTS = ("CMakeLists.txt", "cmake", "common", "src", "include", "vendor", "tools/llama-bench", "tools/quantize",
         "ggml/CMakeLists.txt", "ggml/cmake", "ggml/include", "ggml/src/CMakeLists.txt", "ggml/src/ggml-cpu",
         "ggml/src/ggml-cuda", "convert_hf_to_gguf.py", "conversion", "gguf-py", "LICENSE")
TOOLS = "add_subdirectory(llama-bench)\nadd_subdirectory(quantize)\n"  # tools/CMakeLists.txt: those two alone
TARGETS = ("llama-bench", "llama-quantize")
SRC = ROOT / ".whl" / "llama" / "llama.cpp-src.tar.xz"


def pack(out: Path) -> Path:
    tree = home(Path(os.environ.get("MOETIER_CACHE", Path.home() / ".cache" / "moetier"))) / "llama.cpp"
    if not tree.exists():
        fetch_source(tree.parents[1])
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with tarfile.open(tmp, "w:xz") as tar:
        for part in PARTS:
            tar.add(tree / part, arcname=f"llama.cpp/{part}", filter=_source_only)
        for path in (tree / "ggml" / "src").glob("*.*"):  # ggml's own sources beside the backends' folders
            tar.add(path, arcname=f"llama.cpp/ggml/src/{path.name}")
        info = tarfile.TarInfo("llama.cpp/tools/CMakeLists.txt")
        info.size = len(TOOLS)
        tar.addfile(info, io.BytesIO(TOOLS.encode()))
        info = tarfile.TarInfo("llama.cpp/VERSION")
        info.size = len(VERSION)
        tar.addfile(info, io.BytesIO(VERSION.encode()))
    tmp.rename(out)
    return out


def _source_only(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
    """Leave out build folders (build, build-avx2, ...) and caches."""
    parts = info.name.split("/")
    build = info.isdir() and (parts[-1] == "build" or parts[-1].startswith("build-"))
    return None if build or "__pycache__" in parts else info


def build(src: Path, tree: Path, cpu_only: bool, jobs: int) -> Path:
    """The tree under `tree` (its llama.cpp/), llama-bench built in build-cuda (or build-cpu); returns the binary."""
    tree.mkdir(parents=True, exist_ok=True)
    with tarfile.open(src) as tar:
        tar.extractall(tree, filter="data")
    source = tree / "llama.cpp"
    out = source / ("build-cpu" if cpu_only else "build-cuda")
    flags = [*CMAKE_FLAGS, "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_TOOLS=ON",
             "-DLLAMA_BUILD_APP=OFF"]
    if not cpu_only:
        import torch

        major, minor = torch.cuda.get_device_capability(0)
        flags += ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={major}{minor}"]
    generator = ["-G", "Ninja"] if _has("ninja") else []
    start = time.perf_counter()
    subprocess.run(["cmake", "-S", str(source), "-B", str(out), *generator, *flags], check=True)
    subprocess.run(["cmake", "--build", str(out), "-j", str(jobs), "--target", *TARGETS], check=True)
    print(f"built {' and '.join(TARGETS)} in {time.perf_counter() - start:.0f} s ({'CPU' if cpu_only else 'CUDA'})",
          flush=True)
    return out / "bin" / "llama-bench"


def _has(program: str) -> bool:
    return subprocess.run(["which", program], capture_output=True).returncode == 0


def layers_on_cpu(budget: str, layers: int) -> int:
    """`--n-cpu-moe` for a GPU expert budget: the layers whose experts stay on the host."""
    share = float(budget.rstrip("%")) / 100
    if not 0 <= share <= 1:
        raise ValueError(f"a budget is a share from 0% to 100%, got {budget}")
    return layers - round(share * layers)


@dataclass(frozen=True)
class Built(LlamaCpp):
    """bench/peers' LlamaCpp (its converter and llama-quantize calls) on this script's build: build-cuda, or
    build-cpu."""

    cpu_only: bool = False

    @property
    def bin(self) -> Path:
        return self.tree / ("build-cpu" if self.cpu_only else "build-cuda") / "bin"


def gguf_of(tree: Path, hf: Path, kind: str, threads: int, cpu_only: bool = False) -> Path:
    """The GGUF file llama.cpp's tools make of the Hugging Face folder `hf`: bf16 by its converter, then `kind`
    (q8_0, q4_k_m) by llama-quantize; beside `hf`, made once."""
    tools = Built(tree / "llama.cpp", cpu_only=cpu_only)
    start = time.perf_counter()
    gguf = tools.convert(hf, hf.with_suffix(".bf16.gguf"))
    if kind != "bf16":
        gguf = tools.quantize(gguf, hf.with_suffix(f".{kind}.gguf"), kind, threads)
    print(f"{gguf} ready in {time.perf_counter() - start:.0f} s", flush=True)
    return gguf


def bench(tree: Path, hf: Path, budgets: list[str], tokens: int, repetitions: int, threads: int,
          model: str, cpu_only: bool = False, kind: str = "bf16") -> dict:
    """`cpu_only`: the build-cpu binary, no layer on a GPU (to try the pipeline out where there is none); `kind`:
    the file's type (bf16 as converted, or quantized by llama-quantize)."""
    binary = tree / "llama.cpp" / ("build-cpu" if cpu_only else "build-cuda") / "bin" / "llama-bench"
    gguf = gguf_of(tree, hf, kind, threads, cpu_only)
    print(f"file: {gguf}", flush=True)
    layers = json.loads((hf / "config.json").read_text())["num_hidden_layers"]
    rows = []
    for budget in budgets:
        n = layers_on_cpu(budget, layers)
        argv = [str(binary), "-m", str(gguf), "-p", "0", "-n", str(tokens), "-r", str(repetitions), "-t",
                str(threads), "-ngl", "0" if cpu_only else "99", "-ncmoe", str(n), "-o", "json"]
        base = {"model": model, "engine": "llama.cpp " + ("CPU" if cpu_only else "CUDA"), "mode": f"--n-cpu-moe {n}",
                "budget": budget, "file": GGUF_TYPES[kind], "batch": 1, "argv": argv[1:]}
        try:
            done = subprocess.run(argv, check=True, capture_output=True, text=True)
            result = parse_bench(done.stdout)
            rows.append({**base, **result, "decode_tokens_per_s": result["tok_s"], "tpot_s": 1 / result["tok_s"]})
        except (subprocess.CalledProcessError, ValueError, KeyError, IndexError) as e:
            stderr = getattr(e, "stderr", "") or ""
            rows.append({**base, "error": f"{type(e).__name__}: {e}", "stderr": stderr[-2000:]})
        print(json.dumps(rows[-1]), flush=True)
    return {"device": _device(), "llama_cpp": f"llama-cpp-python {VERSION}'s", "file": str(gguf), "rows": rows}


def _device() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pack", help="the trimmed source tree, to carry to the GPU machine")
    p.add_argument("--out", type=Path, default=SRC)
    b = sub.add_parser("build", help="llama-bench and llama-quantize from the packed tree")
    b.add_argument("--src", type=Path, default=SRC)
    b.add_argument("--tree", type=Path, default=Path("/tmp/llama.cpp-cuda"))
    b.add_argument("--cpu-only", action="store_true", help="without CUDA (to try the packed tree out)")
    b.add_argument("--jobs", type=int, default=os.cpu_count())
    r = sub.add_parser("bench", help="llama-bench at GPU expert budgets, rows as bench_gpu.py writes them")
    r.add_argument("--tree", type=Path, default=Path("/tmp/llama.cpp-cuda"))
    r.add_argument("--hf", type=Path, required=True, help="the Hugging Face copy of the benchmark's model")
    r.add_argument("--model", default="olmoe-synth")
    r.add_argument("--budgets", default="0%,25%,50%,100%")
    r.add_argument("--tokens", type=int, default=32)
    r.add_argument("--repetitions", type=int, default=3)
    r.add_argument("--threads", type=int, default=os.cpu_count())
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--cpu-only", action="store_true", help="the build-cpu binary (to try the pipeline out)")
    r.add_argument("--type", default="bf16", choices=sorted(GGUF_TYPES), help="the file timed: bf16 as converted, or "
                   "quantized by llama-quantize (q4_k_m: what users download)")
    args = ap.parse_args()
    if args.command == "pack":
        print(pack(args.out))
    elif args.command == "build":
        print(build(args.src, args.tree, args.cpu_only, args.jobs))
    else:
        result = bench(args.tree, args.hf, args.budgets.split(","), args.tokens, args.repetitions, args.threads,
                       args.model, args.cpu_only, args.type)
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
