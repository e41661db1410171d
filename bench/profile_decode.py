"""Where a resident batch-1 decode step's time goes, part by part (ms per token), for each kernel set.

With every expert resident (this script's budget) a layer is not planned (moetier.engine.resident_layers): the
layer step's parts are called only where planning runs, e.g. with a prefetch or substitution stage; a decode
step at batch 1 computes its token's experts in one call (`token`, or `token_routed` from a layer's table of addresses:
no grouping, no combine); and on the native kernels each layer's attention block is one native call
(moetier.model.decode_block), so the attention's own parts are timed only where that does not apply; and where
every expert is resident the whole step is one native call (moetier.model.resident_step: no part of it is called
from Python — `--layer-by-layer` runs the layers one by one to time them).

Each part is timed by wrapping the function that does it (inclusive times: `attention` contains its
projections, `moe` contains everything the expert executor does); the wrappers cost ~1 us a call, a few
hundred calls a token. Only calls made during decode steps count (a step hook says which step runs).

    python bench/profile_decode.py --model demo-deep-xl
    python bench/profile_decode.py --model ~/.cache/moetier/bench/olmoe-1b-7b-synth --kernels native
    python bench/profile_decode.py --model ~/.cache/moetier/bench/olmoe-1b-7b-synth --kernels native --layer-by-layer
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from common import OUT, run_child  # noqa: E402

# (label, module, class or None, attribute): what is timed. Indented labels are parts of the one above.
PARTS = (
    ("whole step (one native call)", "moetier.model.resident_step", "ResidentStep", "__call__"),
    ("attention block (one native call)", "moetier.model.decode_block", "DecodeBlocks", "__call__"),
    ("attention (all of it)", "moetier.model.attention", "Attention", "__call__"),
    ("  decode attention", "moetier.model.kernels", "{kernels}", "decode_attention"),
    ("  rope", "moetier.model.kernels", "{kernels}", "rope"),
    ("  kv write", "moetier.model.kernels", "{kernels}", "kv_write"),
    ("rms_norm (every norm)", "moetier.model.kernels", "{kernels}", "rms_norm"),
    ("linear (attention, lm_head)", "{linear_module}", "{linear_owner}", "linear"),
    ("router", "moetier.model.router", "{router}", "{router_call}"),
    ("moe: the executor (all of it)", "moetier.engine.expert_executor", "ExpertExecutor", "__call__"),
    ("  resident layer (no plan)", "moetier.engine.resident_layers", "ResidentLayers", "__call__"),
    ("  layer step: begin (plan)", "moetier.plan.step", "LayerStep", "begin"),
    ("  grouping", "moetier.engine.grouping", "ExpertGroups", "__init__"),
    ("  expert matmuls (one by one)", "moetier.engine.grouping", "ExpertGroups", "compute"),
    ("  expert matmuls (a layer's)", "moetier.engine.grouping", "ExpertGroups", "compute_layer"),
    ("  expert matmuls (one token's)", "{expert_module}", "{expert}", "token"),
    ("  expert matmuls (one token's, table)", "{expert_module}", "{expert}", "token_routed"),
    ("  combine", "moetier.engine.grouping", "ExpertGroups", "combine"),
    ("  layer step: end (accesses)", "moetier.plan.step", "LayerStep", "end"),
    ("sampling", "moetier.engine.scheduler", None, "sample"),
)


def child(cfg: dict) -> dict:
    import importlib

    from moetier import Engine
    from moetier.model.router import SoftmaxRouter
    from moetier.plan.precision import MixedPrecision
    from moetier.plan.route import DECODE

    engine = Engine.from_pretrained(cfg["model"], expert_memory="100%", progress=False, kernels=cfg["kernels"],
                                    precision=MixedPrecision(cfg.get("precision", "native")),
                                    dense_precision=cfg.get("dense_precision", "native"))
    totals: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()
    phase = [None]  # the step running now, as the engine's step hook hears it before each forward
    engine.step_hooks.append(lambda batch, p: phase.__setitem__(0, p))
    linear = type(engine.model.kernels)  # the model's: QuantizedDenseKernels with --dense-precision
    expert = type(engine.executor.expert_kernels[engine.executor.precision])  # QuantizedExpert, DenseExpert, ...
    router = type(engine.model.router)
    names = {"kernels": type(engine.kernels).__name__, "router": router.__name__,
             # (a softmax router's `route` is what both the layers and the decode blocks call)
             "router_call": "route" if router.__call__ is SoftmaxRouter.__call__ else "__call__",
             "expert": expert.__name__, "expert_module": expert.__module__,  # (a GGUF's: ggml_experts)
             "linear_module": linear.__module__, "linear_owner": linear.__name__}

    def timed(label, fn):
        def wrapper(*args, **kw):
            start = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                if phase[0] == DECODE:  # decode steps only: a prefill's calls are not counted
                    totals[label] += time.perf_counter() - start
                    calls[label] += 1
        return wrapper

    for label, module, owner, attr in PARTS:
        target = importlib.import_module(module.format(**names))
        if owner is not None:
            target = getattr(target, owner.format(**names))
        attr = attr.format(**names)
        setattr(target, attr, timed(label, getattr(target, attr)))
    model_kernels = engine.model.kernels
    if model_kernels is not engine.kernels:  # QuantizedDenseKernels bound its base's methods when it was made
        for attr in ("swiglu", "expert", "expert_layer", "rms_norm", "rope", "decode_attention", "kv_write"):
            setattr(model_kernels, attr, getattr(model_kernels.base, attr))
    if cfg.get("layer_by_layer"):
        engine.model.resident_step = None
    engine.preload()
    rng = random.Random(0)
    prompt = [rng.randrange(engine.spec.vocab_size) for _ in range(cfg["prompt_len"])]
    with engine:
        engine.generate([prompt], max_new_tokens=8, ignore_eos=True)  # warm-up
        totals.clear(), calls.clear()
        stats = engine.generate([prompt], max_new_tokens=cfg["tokens"] + 1, ignore_eos=True).stats
    steps = cfg["tokens"]
    parts = {label: totals[label] / steps for label, *_ in PARTS}
    per_step_calls = {label: calls[label] / steps for label, *_ in PARTS}
    return dict(kernels=engine.kernels.name, tpot_s=stats["tpot_s"], parts=parts, calls=per_step_calls)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--model", default="demo-deep-xl")
    ap.add_argument("--kernels", default="torch,native", help="comma-separated kernel sets, each in its own process")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--precision", default="native", help="the experts' precision mode (native, int8, int4, ...)")
    ap.add_argument("--dense-precision", default="native", help="the attention projections' and head's (int8, int4)")
    ap.add_argument("--layer-by-layer", action="store_true",
                    help="the layers one by one where the whole step would be one native call (to time its parts)")
    ap.add_argument("--out", type=Path, default=OUT, help="folder for profile_decode.json")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    runs = [run_child(__file__, dict(model=args.model, kernels=k, tokens=args.tokens, prompt_len=args.prompt_len,
                                     precision=args.precision, dense_precision=args.dense_precision,
                                     layer_by_layer=args.layer_by_layer))
            for k in args.kernels.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "profile_decode.json").write_text(json.dumps({"model": args.model, "runs": runs}, indent=1))
    print(f"{args.model}, {args.precision} (dense {args.dense_precision}), resident, batch 1: ms per decode step "
          f"(calls per step)")
    print(f"{'':34}" + "".join(f"{r['kernels']:>18}" for r in runs))
    print(f"{'TPOT':34}" + "".join(f"{r['tpot_s'] * 1e3:18.2f}" for r in runs))
    for label, *_ in PARTS:
        print(f"{label:34}" + "".join(f"{r['parts'][label] * 1e3:11.2f} ({r['calls'][label]:4.0f})" for r in runs))


if __name__ == "__main__":
    main()
