"""llama.cpp as a peer: built from the llama.cpp tree vendored in llama-cpp-python's source distribution on PyPI
(the only way to it from a machine that reaches PyPI alone), once per version into moetier's cache; the same
weights converted with its own `convert_hf_to_gguf.py` and quantized with `llama-quantize`; decoding timed with
`llama-bench`, quality with `llama-perplexity`.

Nothing here is a dependency of moetier: the peer comparison (bench/peers/compare.py) builds it on first use
(~10 minutes on two cores) and says so."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

VERSION = "0.3.36"  # llama-cpp-python's; its vendor/llama.cpp is the tree built
TARGETS = ("llama-bench", "llama-perplexity", "llama-quantize", "llama-batched-bench")
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_CURL=OFF",
               "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF")
# The instruction sets a build may use: `native`, what this CPU has (its default); `avx2`, ggml's AVX2 kernels alone
# on a CPU with more — the peer of `moetier --kernels avx2`, so an AVX2 machine's row can be measured on any machine.
ISAS = {
    "native": ("-DGGML_NATIVE=ON",),
    "avx2": ("-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
             "-DGGML_BMI2=ON", "-DGGML_AVX_VNNI=OFF", "-DGGML_AVX512=OFF", "-DGGML_AVX512_VBMI=OFF",
             "-DGGML_AVX512_VNNI=OFF", "-DGGML_AVX512_BF16=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF",
             "-DGGML_AMX_BF16=OFF"),
}
GGUF_TYPES = {"bf16": "BF16", "q8_0": "Q8_0", "q4_k_m": "Q4_K_M", "mxfp4_moe": "MXFP4_MOE"}  # ours -> llama-quantize's

# Run by the converter's interpreter: llama.cpp's converter with the allowances our tokenizers need. Both are
# byte-level BPE with GPT-2's pre-tokenizer regex, which the converter knows only by the hashes of tokenizers
# it has seen; and the synthetic model's has no merges, without which llama.cpp will not load a BPE vocabulary.
CONVERT = """
import sys
tree, src, out = sys.argv[1:4]
sys.path[:0] = [tree + "/gguf-py", tree]
import gguf, convert_hf_to_gguf, conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
add = gguf.SpecialVocab.add_to_gguf
def add_with_a_merge(self, gw, quiet=False):
    self.merges = self.merges or ["a b"]
    return add(self, gw, quiet)
gguf.SpecialVocab.add_to_gguf = add_with_a_merge
sys.argv = ["convert_hf_to_gguf.py", src, "--outtype", "bf16", "--outfile", out]
convert_hf_to_gguf.main()
"""


@dataclass(frozen=True)
class LlamaCpp:
    tree: Path  # the source tree (its converter and gguf-py)
    isa: str = "native"  # which build (ISAS) runs

    def __post_init__(self):
        if self.isa not in ISAS:
            raise ValueError(f"unknown llama.cpp build {self.isa!r}; known: {', '.join(ISAS)}")

    @property
    def bin(self) -> Path:
        return self.tree / build_dir(self.isa) / "bin"

    def version(self) -> str:
        """What llama-bench says it is (a source distribution carries no commit: the PyPI version names it)."""
        out = subprocess.run([str(self.bin / "llama-bench"), "--version"], capture_output=True, text=True)
        line = next((ln for ln in (out.stdout + out.stderr).splitlines() if ln.startswith("version")), "")
        return f"llama-cpp-python {VERSION}'s llama.cpp, {line.removeprefix('version: ')}"

    def convert(self, hf_dir: Path, gguf: Path) -> Path:
        """A Hugging Face folder -> a bf16 GGUF (written under a temporary name, renamed when whole)."""
        if gguf.exists():
            return gguf
        tmp = gguf.with_name(gguf.name + ".tmp")
        try:
            subprocess.run([sys.executable, "-c", CONVERT, str(self.tree), str(hf_dir), str(tmp)], check=True,
                           capture_output=True, text=True)
            tmp.rename(gguf)
        except subprocess.CalledProcessError as e:
            raise RuntimeError(f"convert_hf_to_gguf.py failed on {hf_dir}:\n{e.stderr[-3000:]}") from None
        finally:
            tmp.unlink(missing_ok=True)
        return gguf

    def quantize(self, bf16: Path, gguf: Path, kind: str, threads: int = 2) -> Path:
        if gguf.exists():
            return gguf
        tmp = gguf.with_name(gguf.name + ".tmp")
        try:
            subprocess.run([str(self.bin / "llama-quantize"), str(bf16), str(tmp), GGUF_TYPES[kind], str(threads)],
                           check=True, capture_output=True, text=True)
            tmp.rename(gguf)
        except subprocess.CalledProcessError as e:
            raise RuntimeError(f"llama-quantize {kind} failed:\n{e.stderr[-3000:]}") from None
        finally:
            tmp.unlink(missing_ok=True)
        return gguf

    def bench_argv(self, gguf: Path, tokens: int, threads: int, repetitions: int, load: str,
                   prompt: int = 0) -> list[str]:
        """llama-bench decoding `tokens` from an empty context, `repetitions` times after its warm-up token — or,
        with `prompt` (and `tokens` 0), processing a `prompt`-token prompt in one batch (its pp test: prompt
        tokens/s); `load`: "none" (read into memory up front, weights repacked for its fastest kernels) or "mmap"
        (what a user with too little memory runs: mapped, and not repacked — repacking copies every weight into
        memory, and under a cap below the model's size that is an out-of-memory kill)."""
        argv = [str(self.bin / "llama-bench"), "-m", str(gguf), "-p", str(prompt), "-n", str(tokens), "-t",
                str(threads), "-r", str(repetitions), "-lm", load, "-o", "json"]
        return argv + (["--repack", "0"] if load == "mmap" else [])

    def batched_argv(self, gguf: Path, sequences: int, tokens: int, threads: int, prompt: int = 16) -> list[str]:
        """llama-batched-bench decoding `sequences` sequences together (each its own `prompt` random tokens, then
        `tokens` steps of one token each: what a server's parallel slots decode), everything loaded up front
        (`-lm none`, weights repacked as llama-bench's resident runs have them); JSON lines out."""
        ctx = sequences * (prompt + tokens) + 16
        return [str(self.bin / "llama-batched-bench"), "-m", str(gguf), "-c", str(ctx), "-b", "512", "-ub", "512",
                "-npp", str(prompt), "-ntg", str(tokens), "-npl", str(sequences), "-t", str(threads), "-lm", "none",
                "--output-format", "jsonl"]

    def perplexity_argv(self, gguf: Path, text: Path, ctx: int, chunks: int, threads: int,
                        kl_base: Path | None = None, kl: bool = False) -> list[str]:
        argv = [str(self.bin / "llama-perplexity"), "-m", str(gguf), "-f", str(text), "-c", str(ctx),
                "--chunks", str(chunks), "-t", str(threads), "-b", str(ctx)]
        if kl_base is not None:
            argv += ["--kl-divergence-base", str(kl_base)] + (["--kl-divergence"] if kl else [])
        return argv


def parse_bench(stdout: str) -> dict:
    """llama-bench's JSON: tokens/s of each repetition, and their mean."""
    row = json.loads(stdout)[0]
    return dict(tok_s=row["avg_ts"], samples_tok_s=row.get("samples_ts", [row["avg_ts"]]),
                build=row.get("build_commit"), cpu=row.get("cpu_info"), model_bytes=row.get("model_size"))


def parse_batched(stdout: str) -> dict:
    """llama-batched-bench's JSON line: the decode steps' tokens/s over all the sequences (its S_TG)."""
    row = next(json.loads(line) for line in stdout.splitlines() if line.startswith("{") and '"speed_tg"' in line)
    return dict(tok_s=row["speed_tg"], sequences=row["pl"], tokens=row["tg"], t_tg_s=row["t_tg"])


def home(cache: Path) -> Path:
    return cache / "peers" / f"llama.cpp-{VERSION}"


def build_dir(isa: str) -> str:
    return "build" if isa == "native" else f"build-{isa}"


def build(cache: Path, log=print, isa: str = "native") -> LlamaCpp:
    """llama.cpp built for this CPU (GGML_NATIVE), or for `isa` (ISAS), under `cache`, once; a build that did not
    finish is redone."""
    llama = LlamaCpp(home(cache) / "llama.cpp", isa)
    done = home(cache) / ("built" if isa == "native" else f"built-{isa}")
    if done.exists() and all((llama.bin / t).exists() for t in TARGETS):
        return llama
    if done.exists():  # built before a target was added here: that target alone (seconds: the libraries are built)
        compile_tree(llama.tree, isa, log, added=True)
        return llama
    if not (home(cache) / "built").exists():  # the source tree comes with the native build
        fetch_source(cache, log)
        compile_tree(llama.tree, "native", log)
        (home(cache) / "built").write_text(VERSION)
    if isa != "native":
        compile_tree(llama.tree, isa, log)
        done.write_text(VERSION)
    return llama


def fetch_source(cache: Path, log=print) -> None:
    """llama-cpp-python's source distribution from PyPI, its vendored llama.cpp kept as `home/llama.cpp`."""
    root = home(cache)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    log(f"building llama.cpp (llama-cpp-python {VERSION}'s) into {root}: about 10 minutes on two cores, once")
    subprocess.run([sys.executable, "-m", "pip", "download", f"llama-cpp-python=={VERSION}", "--no-deps",
                    "--no-binary", ":all:", "-d", str(root), "--quiet"], check=True)
    sdist = next(root.glob("llama_cpp_python-*.tar.gz"))
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name]
        tar.extractall(root, members=members, filter="data")
    vendored = next(root.glob("llama_cpp_python-*/vendor/llama.cpp"))
    vendored.rename(root / "llama.cpp")
    shutil.rmtree(next(root.glob("llama_cpp_python-*")), ignore_errors=True)
    sdist.unlink()


def compile_tree(tree: Path, isa: str, log=print, added: bool = False) -> None:
    """cmake's build of TARGETS for `isa` (`added`: into a finished build, for a target it lacks)."""
    if added:
        log(f"building the llama.cpp tools this comparison lacks into {tree / build_dir(isa)} (the libraries are there)")
    elif isa != "native":
        log(f"building llama.cpp's {isa} variant into {tree / build_dir(isa)}: about 10 minutes on two cores, once")
    out = tree / build_dir(isa)
    subprocess.run(["cmake", "-S", str(tree), "-B", str(out), *CMAKE_FLAGS, *ISAS[isa]], check=True,
                   capture_output=True)
    subprocess.run(["cmake", "--build", str(out), "-j", "2", "--target", *TARGETS], check=True,
                   capture_output=True)
