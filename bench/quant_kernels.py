"""One expert (gate_up, SwiGLU, down) on this CPU at each precision and batch size, by every path there is:
bf16 through the engine's kernels (native where they build) and through torch; int8 through torch's
`_weight_int8pack_mm`; int4 through torch's `_weight_int4pack_mm_for_cpu` (plus the cost of packing our codes
into its layout, which a load would pay); int2, which has no kernel, as dequantize-then-bf16. Each path's output is
checked against the dequantized weights in fp32 before it is timed. And ours: int8/int4/int2 computed from the
store's codes by `moetier.model.expert_kernels` (csrc/q_rows.c up to 4 tokens, dequantize-to-bf16 beyond). And
GGML's block formats as a GGUF holds them (q8_0, q6_k, q4_k: llama.cpp's Q8_0, Q6_K and Q4_K blocks, fitted as
llama-quantize fits them), computed by `GgmlExpert` — csrc/q_ggml.c's integer dot products up to 4 tokens — the
kernels a `--model FILE.gguf` decode spends its time in.
One expert called repeatedly stays in the CPU's caches: these are compute costs, not memory-bound ones. With
`--cold N` each call takes the next of N copies of the expert (N x its bytes past the last-level cache), as a
decode step meets its experts: from memory. Only the engine's own paths (bf16 through its kernels, ours from the
codes) run cold; torch's reference paths are left out.

    python bench/quant_kernels.py                          # three expert shapes, batch 1-32; table, JSON, PNG
    python bench/quant_kernels.py --shapes 2048x1408 --tokens 1,4
    python bench/quant_kernels.py --shapes 2048x1024 --tokens 1 --cold 64   # a decode's experts, from memory
    python bench/quant_kernels.py --shapes 2048x1024 --tokens 1,2,4 --only ggml  # a GGUF's block formats alone
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from common import OUT, save_figure  # noqa: E402

from moetier.calibrate import median_time  # noqa: E402

SHAPES = "256x8192,2048x1024,2048x1408"  # hidden x intermediate: demo-*-xl, OLMoE-1B-7B, Qwen1.5-MoE-A2.7B


def swiglu_out(gate_up: torch.Tensor, down_fn):
    gate, up = gate_up.chunk(2, dim=-1)
    return down_fn(F.silu(gate) * up)


def rotating(make, copies: int):
    """fn(x) calling `make(i)(x)` for i = 0, 1, ... copies - 1, 0, ...: each call on another copy's memory."""
    fns = [make(i) for i in range(copies)]
    at = [0]

    def fn(x):
        at[0] = (at[0] + 1) % copies
        return fns[at[0]](x)

    return fn


def paths(hidden: int, inter: int, cold: int = 0):
    """{name: (precision, make(x) -> out, reference out in fp32 for x)} for one random expert; with `cold` copies,
    the engine's paths only, each call on the next copy."""
    from moetier.calibrate import cpu_kernels
    from moetier.model.expert_kernels import make_expert_kernel
    from moetier.quant.codes import GROUP_SIZE, dequantize, expert_matrices, quantize, quantize_expert, unpack

    g = torch.Generator().manual_seed(0)
    gate_up = (torch.randn(2 * inter, hidden, generator=g) * hidden ** -0.5).to(torch.bfloat16)
    down = (torch.randn(hidden, inter, generator=g) * inter ** -0.5).to(torch.bfloat16)
    kernels = cpu_kernels(torch.bfloat16)
    if cold:
        weights = [(gate_up.clone(), down.clone()) for _ in range(cold)]
        out = {f"bf16 {kernels.name}": ("bf16", rotating(lambda i: lambda x: kernels.swiglu(x, *weights[i]), cold),
                                        (gate_up, down))}
        for precision in ("int8", "int4", "int2"):
            kernel = make_expert_kernel(precision, kernels, torch.bfloat16)
            w = quantize_expert({"gate_up_proj": gate_up, "down_proj": down}, precision)
            ws = [{k: v.clone() for k, v in w.items()} for _ in range(cold)]
            q = expert_matrices(w, precision)
            out[f"{precision} moetier"] = (precision, rotating(lambda i, k=kernel, ws=ws: lambda x: _run(k, x, ws[i]),
                                                               cold),
                                           (dequantize(q["gate_up_proj"]), dequantize(q["down_proj"])))
        return out | ggml_paths(gate_up, down, cold), {}
    out = {f"bf16 {kernels.name}": ("bf16", lambda x: kernels.swiglu(x, gate_up, down), (gate_up, down))}
    if kernels.name != "torch":
        out["bf16 torch"] = ("bf16", lambda x: swiglu_out(F.linear(x, gate_up), lambda h: F.linear(h, down)),
                             (gate_up, down))
    q8 = [quantize(w, "int8") for w in (gate_up, down)]
    out["int8 torch"] = ("int8", lambda x: swiglu_out(torch.ops.aten._weight_int8pack_mm(x, q8[0].codes, q8[0].scales),
                                                      lambda h: torch.ops.aten._weight_int8pack_mm(h, q8[1].codes,
                                                                                                   q8[1].scales)),
                         tuple(dequantize(q) for q in q8))
    q4 = [quantize(w, "int4") for w in (gate_up, down)]
    pack4 = lambda q: torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpack(q.codes, 4).to(torch.int32), 1)  # noqa: E731
    packed = [pack4(q) for q in q4]
    sz = [torch.stack([q.scales, q.zeros], dim=-1).transpose(0, 1).contiguous() for q in q4]
    mm4 = lambda x, i: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed[i], GROUP_SIZE["int4"], sz[i])  # noqa: E731
    out["int4 torch"] = ("int4", lambda x: swiglu_out(mm4(x, 0), lambda h: mm4(h, 1)), tuple(dequantize(q) for q in q4))
    q2 = [quantize(w, "int2") for w in (gate_up, down)]
    out["int2 dequantize"] = ("int2", lambda x: kernels.swiglu(x, dequantize(q2[0]), dequantize(q2[1])),
                              tuple(dequantize(q) for q in q2))
    for precision in ("int8", "int4", "int2"):  # ours: straight from the store's codes, nothing made at load
        kernel = make_expert_kernel(precision, kernels, torch.bfloat16)
        w = quantize_expert({"gate_up_proj": gate_up, "down_proj": down}, precision)
        q = expert_matrices(w, precision)
        out[f"{precision} moetier"] = (precision, lambda x, kernel=kernel, w=w: _run(kernel, x, w),
                                       (dequantize(q["gate_up_proj"]), dequantize(q["down_proj"])))
    load_costs = {"int4 torch": lambda: [pack4(q) for q in q4]}
    return out | ggml_paths(gate_up, down, cold), load_costs


GGML = ("q8_0", "q6_k", "q4_k")  # a Q8_0 file's experts; a Q4_K_M file's (gate_up Q4_K, down Q4_K or Q6_K)


def ggml_paths(gate_up: torch.Tensor, down: torch.Tensor, cold: int) -> dict:
    """The block formats through GgmlExpert with the native kernels (none where they do not build), each against
    its own blocks dequantized; with `cold` copies, each call on the next."""
    from moetier.model import native
    from moetier.model.ggml_experts import GgmlExpert
    from moetier.quant.ggml_blocks import dequantize
    from moetier.quant.precisions import matrix_format, quantize_expert

    lib = native.load().lib
    if lib is None:
        return {}
    out = {}
    for fmt in GGML:
        expert = GgmlExpert(fmt, torch.bfloat16, lib)
        w = quantize_expert({"gate_up_proj": gate_up, "down_proj": down}, fmt)
        ref = tuple(dequantize(w[name], matrix_format(fmt, m.shape[1])).to(torch.bfloat16)
                    for name, m in (("gate_up_proj", gate_up), ("down_proj", down)))
        ws = [{k: v.clone() for k, v in w.items()} for _ in range(cold)] if cold else [w]
        out[f"{fmt} moetier"] = (fmt, rotating(lambda i, e=expert, ws=ws: lambda x: _run(e, x, ws[i]), len(ws)), ref)
    return out


def _run(kernel, x: torch.Tensor, w: dict) -> torch.Tensor:
    out = torch.empty_like(x)
    kernel(out, x, w, torch.ones(x.shape[0], dtype=torch.bfloat16))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=SHAPES, help="HIDDENxINTERMEDIATE, comma-separated")
    ap.add_argument("--tokens", default="1,2,4,8,16,32")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--cold", type=int, default=0, help="copies of the expert to cycle through (0: one, warm)")
    ap.add_argument("--only", default="", help="only the paths whose name contains this (e.g. ggml's: q4_k, or "
                    "`ggml` for all three)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    from moetier.progress import tqdm

    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    tokens = [int(t) for t in args.tokens.split(",")]
    rows = []
    for hidden, inter in tqdm(shapes, desc="shapes"):
        found, load_costs = paths(hidden, inter, args.cold)
        for name, (precision, fn, (gate_up, down)) in found.items():
            if args.only and not (args.only in name or (args.only == "ggml" and precision in GGML)):
                continue
            x = torch.randn(max(tokens), hidden).to(torch.bfloat16)
            ref = swiglu_out(x.float() @ gate_up.float().t(), lambda h, down=down: h @ down.float().t())
            error = ((fn(x[:1]).float() - ref[:1]).norm() / ref[:1].norm()).item()
            # against its own dequantized weights: bf16 rounding only; our integer path (one token: csrc/q_int.c)
            # also rounds the activations to int8 per 32 (1-2%, more for int2's coarse h)
            if error > (0.05 if name.endswith("moetier") else 0.02):
                raise SystemExit(f"{name} on {hidden}x{inter} computes something else: relative error {error:.3g}")
            load = median_time(load_costs[name], 5) if name in load_costs else 0.0
            for t in tokens:
                xt = x[:t].contiguous()
                rows.append({"shape": f"{hidden}x{inter}", "path": name, "precision": precision, "tokens": t,
                             "cold_copies": args.cold,
                             "ms": median_time(lambda xt=xt, fn=fn: fn(xt), args.repeats) * 1e3, "load_ms": load * 1e3,
                             "error": error})
    if not rows:
        raise SystemExit(f"quant_kernels: error: --only {args.only!r} names no path on this machine (the paths: "
                         f"{', '.join(found)})")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "quant_kernels.json").write_text(json.dumps({"args": vars(args) | {"out": str(args.out)},
                                                             "torch": torch.__version__, "rows": rows}, indent=1))
    print(f"{'shape':>10} {'path':>16} " + " ".join(f"{'T=' + str(t):>8}" for t in tokens) + f" {'load ms':>8}")
    for shape in dict.fromkeys(r["shape"] for r in rows):
        for name in dict.fromkeys(r["path"] for r in rows if r["shape"] == shape):
            mine = [r for r in rows if (r["shape"], r["path"]) == (shape, name)]
            print(f"{shape:>10} {name:>16} " + " ".join(f"{r['ms']:8.3f}" for r in mine) + f" {mine[0]['load_ms']:8.2f}")
    plot(rows, args.out / "quant_kernels.png")
    print(f"json: {args.out / 'quant_kernels.json'}; plot: {args.out / 'quant_kernels.png'}")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    fig, axes = plt.subplots(1, len(shapes), figsize=(4.5 * len(shapes), 4), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        for name in dict.fromkeys(r["path"] for r in rows if r["shape"] == shape):
            mine = [r for r in rows if (r["shape"], r["path"]) == (shape, name)]
            ax.plot([r["tokens"] for r in mine], [r["ms"] for r in mine], marker="o", label=name)
        ax.set(xscale="log", yscale="log", xlabel="tokens", ylabel="ms per expert", title=f"expert {shape}")
        ax.legend(fontsize=7)
    cold = rows[0].get("cold_copies", 0)
    save_figure(fig, "one expert per precision and path on this CPU (median)" +
                (f", each call on the next of {cold} copies (from memory)" if cold else ""), path)


if __name__ == "__main__":
    main()
