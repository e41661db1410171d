"""Resident decoding side by side with llama.cpp on the same weights: the OLMoE-shaped synthetic model, bf16, every
expert in memory, 2 threads, 32 generated tokens, alternating runs of the two (the machine's memory bandwidth drifts
between minutes, so only runs measured next to each other compare).

llama.cpp is not a dependency: point --llama-cpp at a llama.cpp source tree with `llama-bench` built in it. Its
Python package's source distribution carries one (~10 minutes on two cores):

    pip download llama-cpp-python --no-deps --no-binary :all: -d /tmp/llama && tar xzf /tmp/llama/*.tar.gz -C /tmp/llama
    cd /tmp/llama/llama_cpp_python-*/vendor/llama.cpp && cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \\
        && cmake --build build -j2 --target llama-bench
    python bench/vs_llamacpp.py --llama-cpp /tmp/llama/llama_cpp_python-*/vendor/llama.cpp

The same weights for both: the synthetic store (written on first use, as bench_offload does) is exported to a
Hugging Face OLMoE checkpoint and converted with llama.cpp's own `convert_hf_to_gguf.py` (bf16), once, into
bench/out/llamacpp/ (13 GB; the checkpoint in between is removed). The synthetic tokenizer has no BPE merges and
llama.cpp refuses a BPE vocabulary without any, so the conversion adds one unused merge; llama-bench generates
from random token ids either way. llama.cpp loads the whole model into memory up front (`-lm none`): with mmap,
every expert first touched during the measured tokens would be faulted in from disk.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from bench_offload import SYNTH, store_of  # noqa: E402
from common import OUT, run_child  # noqa: E402

HF_NAMES = {"input_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm", "router": "mlp.gate",
            **{n: f"self_attn.{n}" for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")}}

# Run by the converter's interpreter: llama.cpp's converter with the two allowances the synthetic tokenizer needs.
CONVERT = """
import sys
tree, src, out = sys.argv[1:4]
sys.path[:0] = [tree + "/gguf-py", tree]
import gguf, convert_hf_to_gguf, conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"  # an unknown pre-tokenizer hash
add = gguf.SpecialVocab.add_to_gguf
def add_with_a_merge(self, gw, quiet=False):
    self.merges = self.merges or ["a b"]  # llama.cpp will not load a BPE vocabulary without merges
    return add(self, gw, quiet)
gguf.SpecialVocab.add_to_gguf = add_with_a_merge
sys.argv = ["convert_hf_to_gguf.py", src, "--outtype", "bf16", "--outfile", out]
convert_hf_to_gguf.main()
"""


def export_hf(store_dir: Path, out: Path) -> None:
    """The store as a Hugging Face OLMoE checkpoint: one safetensors file per layer, experts split back into
    gate_proj, up_proj and down_proj."""
    import numpy as np
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file
    from tqdm import tqdm

    from moetier.store.store import Store

    store = Store(store_dir)
    manifest, spec = store.manifest, store.spec
    if spec.family != "olmoe":
        raise SystemExit(f"{store_dir} is a {spec.family} store; this export writes OLMoE checkpoints only")
    config = {k: v for k, v in manifest.config.items() if k != "moetier_synthetic"}
    layout, inter = store.native_layout, spec.moe_intermediate_size
    out.mkdir(parents=True)
    weight_map = {}

    def save(name: str, tensors: dict) -> None:
        save_file(tensors, out / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))

    with safe_open(store_dir / "dense.safetensors", "pt") as dense:
        save("top.safetensors", {"model.embed_tokens.weight": dense.get_tensor("embed_tokens"),
                                 "model.norm.weight": dense.get_tensor("norm"),
                                 "lm_head.weight": dense.get_tensor("lm_head")})
        for layer in tqdm(range(spec.num_layers), desc="export to HF", unit="layer"):
            prefix = f"layers.{layer}."
            tensors = {f"model.layers.{layer}.{HF_NAMES[k.removeprefix(prefix)]}.weight": dense.get_tensor(k)
                       for k in dense.keys() if k.startswith(prefix)}
            for e in range(spec.num_experts):
                blob = manifest.blob(layer, e)
                raw = np.fromfile(store_dir / blob.file, dtype=np.uint8, count=blob.length, offset=blob.offset)
                w = layout.views(torch.from_numpy(raw))
                name = f"model.layers.{layer}.mlp.experts.{e}."
                tensors[name + "gate_proj.weight"] = w["gate_up_proj"][:inter].clone()
                tensors[name + "up_proj.weight"] = w["gate_up_proj"][inter:].clone()
                tensors[name + "down_proj.weight"] = w["down_proj"].clone()
            save(f"layer{layer:03d}.safetensors", tensors)
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(config))
    shutil.copy(store_dir / "tokenizer.json", out / "tokenizer.json")


def gguf_of(store_dir: Path, tree: Path, work: Path) -> Path:
    """The store converted to a bf16 GGUF by llama.cpp's converter, once (written under a temporary name)."""
    gguf = work / f"{SYNTH}-bf16.gguf"
    if gguf.exists():
        return gguf
    work.mkdir(parents=True, exist_ok=True)
    hf, tmp = work / "hf.tmp", work / f"{gguf.name}.tmp"
    shutil.rmtree(hf, ignore_errors=True)  # a folder this script made and did not finish
    try:
        export_hf(store_dir, hf)
        subprocess.run([sys.executable, "-c", CONVERT, str(tree), str(hf), str(tmp)], check=True)
        tmp.rename(gguf)
    finally:
        shutil.rmtree(hf, ignore_errors=True)
        tmp.unlink(missing_ok=True)
    return gguf


def llama_bench(binary: Path, gguf: Path, tokens: int, threads: int, repeats: int) -> dict:
    out = subprocess.run([str(binary), "-m", str(gguf), "-p", "0", "-n", str(tokens), "-t", str(threads),
                          "-r", str(repeats), "-lm", "none", "-o", "json"], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"llama-bench failed:\n{out.stderr[-2000:]}")
    row = json.loads(out.stdout)[0]
    return dict(tok_s=row["avg_ts"], tok_s_stddev=row["stddev_ts"], build=row.get("build_commit"))


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    x = range(len(runs))
    ax.bar([i - 0.2 for i in x], [r["llama_cpp_tok_s"] for r in runs], 0.4, label="llama.cpp")
    ax.bar([i + 0.2 for i in x], [r["moetier_tok_s"] for r in runs], 0.4, label="moetier (native kernels)")
    ax.set_xticks(list(x), [f"round {i + 1}" for i in x])
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"{SYNTH}, bf16, every expert resident, 2 threads")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-cpp", type=Path, required=True, help="a llama.cpp source tree with build/bin/llama-bench")
    ap.add_argument("--rounds", type=int, default=2, help="alternating runs of each")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    binary = args.llama_cpp / "build" / "bin" / "llama-bench"
    if not binary.exists() or not (args.llama_cpp / "convert_hf_to_gguf.py").exists():
        raise SystemExit(f"{args.llama_cpp} is not a llama.cpp tree with llama-bench built (see --help)")
    store = store_of(SYNTH)
    gguf = gguf_of(store, args.llama_cpp, args.out / "llamacpp")
    cfg = dict(store=str(store), tokens=args.tokens, warmup_tokens=16, prompt_len=16, seed=0, random_prompts=True,
               budget="100%", kernels="native")
    runs = []
    for i in range(args.rounds):
        theirs = llama_bench(binary, gguf, args.tokens, args.threads, repeats=3)
        ours = run_child(str(ROOT / "bench_roofline.py"), cfg)
        tpot = ours["steady"]["tpot_s"]
        roofline = ours["step_bytes"]["total"] / ours["memory_bandwidth"]
        runs.append(dict(llama_cpp_tok_s=theirs["tok_s"], llama_cpp_tok_s_stddev=theirs["tok_s_stddev"],
                         llama_cpp_build=theirs["build"], moetier_tok_s=1 / tpot, moetier_tpot_s=tpot,
                         roofline_s=roofline, memory_bandwidth=ours["memory_bandwidth"],
                         ratio=(1 / tpot) / theirs["tok_s"]))
        r = runs[-1]
        print(f"round {i + 1}: llama.cpp {r['llama_cpp_tok_s']:.2f} ± {r['llama_cpp_tok_s_stddev']:.2f} tok/s "
              f"({1e3 / r['llama_cpp_tok_s']:.1f} ms, {1 / r['llama_cpp_tok_s'] / roofline:.2f} of the roofline), "
              f"moetier {r['moetier_tok_s']:.2f} tok/s ({tpot * 1e3:.1f} ms, {tpot / roofline:.2f}); "
              f"moetier / llama.cpp = {r['ratio']:.2f}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "vs_llamacpp.json").write_text(json.dumps(dict(model=SYNTH, tokens=args.tokens, threads=args.threads,
                                                               runs=runs), indent=1))
    plot(runs, args.out / "vs_llamacpp.png")
    print(f"wrote {args.out / 'vs_llamacpp.json'} and {args.out / 'vs_llamacpp.png'}")


if __name__ == "__main__":
    main()
