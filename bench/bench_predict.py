"""Expert predictors on held-out text of the three demo models: record a trace with gate inputs per model on the
books the demo models never trained on (train/corpus.py holds them out), then `moetier predict-bench` on them.

    python bench/bench_predict.py                 # traces in bench/out/traces/, table + JSON + PNG in bench/out/
    python bench/bench_predict.py --prompts 8 --max-tokens 32
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, default=ROOT / "out")
    ap.add_argument("--predictor", default="stacked-gates,llapor,comoe-mlp,hot")
    args = ap.parse_args()
    traces = args.out / "traces"
    traces.mkdir(parents=True, exist_ok=True)
    prompt_file = traces / "held-out-prompts.txt"
    prompt_file.write_text("\n".join(prompt_lines(list(VALID_BOOKS), args.prompts)) + "\n")
    paths = []
    for model in args.models.split(","):
        path = traces / f"{model}-held-out"
        subprocess.run(["moetier", "trace", "record", "--model", model, "--prompts", str(prompt_file), "--out",
                        str(path), "--max-tokens", str(args.max_tokens), "--gate-inputs", "--expert-memory", "100%",
                        "--force"], check=True)
        paths.append(str(path))
    subprocess.run(["moetier", "predict-bench", "--trace", *paths, "--predictor", args.predictor, "--out",
                    str(args.out / "predict-bench")], check=True)


if __name__ == "__main__":
    main()
