"""A feature of the decode step (batch 1 unless `--batch`) on and off, alternated every step within one
generation: the median step with and without it, and each adjacent pair's ratio.

Why: on a host whose memory rate moves by half from one minute (or process) to the next, two runs measured one
after the other compare the minutes more than the code; two neighbouring steps of one run meet the same memory.
Both variants compute the same tokens (each feature is held bit for bit by its tests), so the generation itself
does not change.

    python bench/alternate_steps.py --model ~/.cache/moetier/bench/olmoe-1b-7b-synth --feature blocks
    python bench/alternate_steps.py --model ... --precision int4 --dense-precision int4 --feature tables --tokens 300
    python bench/alternate_steps.py --model demo-deep --feature one-token --expert-memory 75%

Features: `blocks` — each layer's attention block in one native call (moetier/model/decode_block.py) against the
layer-by-layer forward; `tables` — a resident layer's experts from its table of addresses
(ResidentLayers._token_routed) against the kernel's `token` on the slots' tensors; `router` — the softmax router's
choice in one native call (NativeSoftmaxRouter) against torch's ops; `step` — the whole step in one native call
(ResidentStep) against its layers one by one; `one-token` — a planned layer whose experts all hit through the
kernels' one-token call (moetier/engine/one_token.py) against grouping its pairs (ExpertGroups), every layer planned
on both sides; `hit-layer` — such a layer computed with no plan (moetier/engine/hit_layer.py) against planning it
(then the one-token call; with `--batch` above 1, the pairs grouped either way); `all-hit` — both against neither
(every layer planned, its pairs grouped). The last three at an `--expert-memory` below 100% (every other feature
at 100%, the model preloaded). The first three are measured with the layers one by one."""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from common import OUT  # noqa: E402

FEATURES = ("blocks", "tables", "router", "step", "one-token", "hit-layer", "all-hit")
PLANNED = ("one-token", "hit-layer", "all-hit")  # features of planned layers: measured below 100%


def switch(engine, feature: str):
    """A function turning `feature` on or off for the next step. A feature other than `step` is measured with the
    layers one by one (the one-call step would run in its place on both sides)."""
    from moetier.model.router import SoftmaxRouter
    from moetier.plan.layer_plan import LayerPlan

    blocks, router, whole = engine.model.blocks, engine.model.router, engine.model.resident_step
    if feature != "step":
        engine.model.resident_step = None
    plain = SoftmaxRouter(router.spec, router.top_k, router.linear)  # (`router`: torch's ops for the same routing)
    one_token = LayerPlan.__dict__["one_token_order"]
    hit = engine.executor._hit  # (its HitLayer, where the executor has one)

    def set_on(on: bool) -> None:
        if feature == "blocks":
            engine.model.blocks = blocks if on else None
            return
        if feature == "router":
            engine.model.router = router if on else plain
            return
        if feature == "step":
            engine.model.resident_step = whole if on else None
            return
        if feature == "one-token":  # (off: no plan is one token's, so every plan is grouped)
            engine.executor.hit_layer = None  # (this step's: every layer planned)
            LayerPlan.one_token_order = one_token if on else _grouped
            return
        if feature == "hit-layer":
            engine.executor.hit_layer = hit if on else None
            return
        if feature == "all-hit":  # (both above together, against every layer planned and grouped)
            engine.executor.hit_layer = hit if on else None
            LayerPlan.one_token_order = one_token if on else _grouped
            return
        resident = engine.executor.resident_layers  # (this step's: begin_step ran before the step hooks)
        if resident is not None and resident.tables is not None:
            resident._one_token = type(resident)._token_routed if on else type(resident)._token
    return set_on


def _grouped(plan) -> None:
    return None


def measure(engine, feature: str, tokens: int, prompt_len: int, batch: int = 1) -> dict:
    from moetier.plan.route import DECODE

    set_on = switch(engine, feature)
    marks: list[tuple[float, bool]] = []  # (when a decode step starts, whether the feature is on in it)

    def hook(batch, phase) -> None:
        if phase == DECODE:
            on = len(marks) % 2 == 1
            set_on(on)
            marks.append((time.perf_counter(), on))

    rng = random.Random(0)
    prompts = [[rng.randrange(engine.spec.vocab_size) for _ in range(prompt_len)] for _ in range(batch)]
    engine.generate(prompts, max_new_tokens=8, ignore_eos=True)  # warm-up
    engine.step_hooks.append(hook)
    try:
        out = engine.generate(prompts, max_new_tokens=tokens, ignore_eos=True)
    finally:
        engine.step_hooks.remove(hook)
        set_on(True)
    steps = [(b - a, on) for (a, on), (b, _) in zip(marks, marks[1:])][2:]  # (the first two: still settling)
    steps = steps[:len(steps) // 2 * 2]
    pairs = [(on_t if on else off_t) / (off_t if on else on_t)
             for (on_t, on), (off_t, _) in zip(steps[0::2], steps[1::2])]  # on / off, neighbours
    on_s = [t for t, on in steps if on]
    off_s = [t for t, on in steps if not on]
    return dict(feature=feature, steps=len(steps), on_ms=statistics.median(on_s) * 1e3,
                off_ms=statistics.median(off_s) * 1e3, ratio=statistics.median(pairs),
                faster=sum(p < 1 for p in pairs), pairs=len(pairs), hit_rate=out.stats["decode_hit_rate"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo-deep-xl")
    ap.add_argument("--feature", choices=FEATURES, default="blocks")
    ap.add_argument("--precision", default="native")
    ap.add_argument("--dense-precision", default="native")
    ap.add_argument("--expert-memory", default=None,
                    help="the expert cache (default 100%%, the model preloaded; `one-token` needs less: default 75%%)")
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--batch", type=int, default=1, help="sequences decoded together (a server's batch; default 1)")
    ap.add_argument("--out", type=Path, default=OUT, help="folder for alternate_steps.json")
    args = ap.parse_args()
    memory = args.expert_memory or ("75%" if args.feature in PLANNED else "100%")
    if args.feature in PLANNED and memory.strip() == "100%":
        sys.exit(f"moetier: error: at 100% every layer skips planning (ResidentLayers), so --feature {args.feature} "
                 "changes nothing; give --expert-memory below 100%, e.g. 75%")

    from moetier import Engine
    from moetier.model.router import NativeSoftmaxRouter
    from moetier.plan.precision import MixedPrecision

    engine = Engine.from_pretrained(args.model, expert_memory=memory, progress=False,
                                    precision=MixedPrecision(args.precision), dense_precision=args.dense_precision)
    with engine:
        engine.preload()
        if args.feature == "blocks" and engine.model.blocks is None:
            sys.exit("moetier: error: this model and kernel set have no decode blocks to turn off")
        if args.feature == "router" and not isinstance(engine.model.router, NativeSoftmaxRouter):
            sys.exit("moetier: error: this model and kernel set have no native router to turn off")
        if args.feature == "step" and engine.model.resident_step is None:
            sys.exit("moetier: error: this model and kernel set have no one-call step to turn off")
        if args.feature in ("hit-layer", "all-hit") and engine.executor._hit is None:
            sys.exit("moetier: error: this configuration plans every layer (a stage beyond on-demand, a predictor or "
                     "two precisions): no layer skips planning to turn off")
        result = measure(engine, args.feature, args.tokens, args.prompt_len, args.batch)
    result.update(model=args.model, precision=args.precision, dense_precision=args.dense_precision,
                  expert_memory=memory, batch=args.batch)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "alternate_steps.json").write_text(json.dumps(result, indent=1))
    print(f"{args.feature}: on {result['on_ms']:.2f} ms, off {result['off_ms']:.2f} ms a step; on/off of neighbouring "
          f"steps {result['ratio']:.3f} (median of {result['pairs']}, {result['faster']} faster on)")


if __name__ == "__main__":
    main()
