"""Expert predictors on held-out text of the three demo models: record a trace with gate inputs per model on the
books the demo models never trained on (train/corpus.py holds them out), then `moetier predict-bench` on them.
Then, in the engine on the same prompts, each predictor scored live one MoE layer ahead — the only place
`smoe-lookahead` can run (it runs the model's next attention layer) — with what it adds to the time per token.

    python bench/bench_predict.py                 # traces in bench/out/traces/, table + JSON + PNG in bench/out/
    python bench/bench_predict.py --prompts 8 --max-tokens 32
    python bench/bench_predict.py --live-only      # the engine's live scores alone
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))
from train.corpus import VALID_BOOKS, prompt_lines  # noqa: E402

MODELS = ("demo-deep", "demo-fine", "demo-coarse")
LIVE = ("none", "stacked-gates", "smoe-lookahead", "llapor", "comoe-mlp")


def live(models: list[str], prompts: list[str], max_tokens: int, out: Path) -> None:
    """Each predictor in the engine, every expert resident (so only the predictor's own time differs): decode
    recall one MoE layer ahead, and TPOT against none's in the same run."""
    from moetier import Engine
    from moetier.atomic import atomic_write_json
    from moetier.progress import tqdm

    rows = []
    bar = tqdm(total=len(models) * len(LIVE), desc="live", unit="run")
    for model in models:
        tpot = {}
        for name in LIVE:
            with Engine.from_pretrained(model, expert_memory="100%", predictor=name, progress=False) as engine:
                engine.generate(prompts[:1], max_new_tokens=4, ignore_eos=True)  # warm-up
                stats = [engine.generate([p], max_new_tokens=max_tokens, ignore_eos=True).stats for p in prompts]
            right = sum(s["decode"]["predicted_right"] for s in stats)
            total = sum(s["decode"]["predicted"] for s in stats)
            tpot[name] = sum(s["tpot_s"] for s in stats) / len(stats)
            rows.append({"model": model, "predictor": name, "recall": right / total if total else None,
                         "tpot_ms": tpot[name] * 1e3, "added_ms": (tpot[name] - tpot["none"]) * 1e3,
                         "pairs": total})
            bar.update()
    bar.close()
    print(f"{'model':>12} {'predictor':>15} {'recall d1':>9} {'TPOT ms':>8} {'added ms':>8}")
    for r in rows:
        recall = "" if r["recall"] is None else f"{r['recall']:.1%}"
        print(f"{r['model']:>12} {r['predictor']:>15} {recall:>9} {r['tpot_ms']:>8.1f} {r['added_ms']:>8.1f}")
    atomic_write_json(out / "predict-live.json", rows)
    print(f"wrote {out / 'predict-live.json'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, default=ROOT / "out")
    ap.add_argument("--predictor", default="stacked-gates,llapor,comoe-mlp,hot")
    ap.add_argument("--live-prompts", type=int, default=8, help="held-out prompts for the engine's live scores")
    ap.add_argument("--live-only", action="store_true", help="only the engine's live scores (no traces)")
    args = ap.parse_args()
    lines = prompt_lines(list(VALID_BOOKS), args.prompts)
    if args.live_only:
        return live(args.models.split(","), lines[:args.live_prompts], args.max_tokens, args.out)
    traces = args.out / "traces"
    traces.mkdir(parents=True, exist_ok=True)
    prompt_file = traces / "held-out-prompts.txt"
    prompt_file.write_text("\n".join(lines) + "\n")
    paths = []
    for model in args.models.split(","):
        path = traces / f"{model}-held-out"
        subprocess.run(["moetier", "trace", "record", "--model", model, "--prompts", str(prompt_file), "--out",
                        str(path), "--max-tokens", str(args.max_tokens), "--gate-inputs", "--expert-memory", "100%",
                        "--force"], check=True)
        paths.append(str(path))
    subprocess.run(["moetier", "predict-bench", "--trace", *paths, "--predictor", args.predictor, "--out",
                    str(args.out / "predict-bench")], check=True)
    live(args.models.split(","), lines[:args.live_prompts], args.max_tokens, args.out)


if __name__ == "__main__":
    main()
