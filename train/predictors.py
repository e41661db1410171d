"""The demo models' trained expert predictors (`llapor`, `comoe-mlp`), written into `models/<name>/predictors/`,
and their learned cache policies (`flashmoe-ml`, `static-hot`, `hobbit` at 25%), HOBBIT thresholds
(`thresholds.json`) and expert similarities (`similarity.json`, for `--substitute similar`) into
`models/<name>/policies/`:
record a trace with gate inputs on the training books (train/corpus.py holds the validation books out, and the
predictor benchmark scores on those), then `moetier train predictor` / `moetier train cache-policy` on it.

    python -m train.predictors [--models demo-deep,demo-fine,demo-coarse] [--prompts 96] [--max-tokens 64]
    python -m train.predictors --predictors "" --policies flashmoe-ml      # one policy again, no predictor
    python -m train.predictors --predictors "" --policies hobbit --no-thresholds   # HOBBIT's weights and the
                                                                                    # similarities again
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
from pathlib import Path

from moetier.paths import default_cache_dir
from train.corpus import VALID_BOOKS, book_names, prompt_lines

MODELS = ("demo-deep", "demo-fine", "demo-coarse")
ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--prompts", type=int, default=96)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--predictors", default="llapor,comoe-mlp", help="comma-separated; empty for none")
    ap.add_argument("--policies", default="flashmoe-ml,static-hot,hobbit", help="comma-separated; empty for none")
    ap.add_argument("--thresholds", action=argparse.BooleanOptionalAction, default=True,
                    help="fit HOBBIT's T1/T2 to the model's routing (`moetier train thresholds`)")
    ap.add_argument("--similarity", action=argparse.BooleanOptionalAction, default=True,
                    help="compute the expert similarities (`moetier train similarity`)")
    ap.add_argument("--traces", type=Path, default=default_cache_dir() / "predictor-traces")
    args = ap.parse_args()
    args.traces.mkdir(parents=True, exist_ok=True)
    prompts = args.traces / "training-prompts.txt"
    books = [name for name in book_names() if name not in VALID_BOOKS]
    prompts.write_text("\n".join(prompt_lines(books, args.prompts)) + "\n")
    for model in args.models.split(","):
        trace = args.traces / f"{model}-train"
        subprocess.run(["moetier", "trace", "record", "--model", model, "--prompts", str(prompts), "--out",
                        str(trace), "--max-tokens", str(args.max_tokens), "--gate-inputs", "--expert-memory", "100%",
                        "--force"], check=True)
        made = args.traces / f"{model}-trained"  # (moetier never writes a shipped model's files: copied below)
        made.mkdir(exist_ok=True)
        outputs = []
        for name in filter(None, args.predictors.split(",")):
            outputs.append(("predictors", f"{name}.safetensors"))
            subprocess.run(["moetier", "train", "predictor", "--predictor", name, "--trace", str(trace), "--model",
                            model, "--out", str(made / outputs[-1][1])], check=True)
        for name in filter(None, args.policies.split(",")):
            outputs.append(("policies", f"{name}.json"))
            subprocess.run(["moetier", "train", "cache-policy", "--policy", name, "--trace", str(trace), "--model",
                            model, "--out", str(made / outputs[-1][1]), "--expert-memory", "25%"], check=True)
        if args.thresholds:
            outputs.append(("policies", "thresholds.json"))
            subprocess.run(["moetier", "train", "thresholds", "--trace", str(trace), "--model", model, "--out",
                            str(made / outputs[-1][1])], check=True)
        if args.similarity:
            outputs.append(("policies", "similarity.json"))
            subprocess.run(["moetier", "train", "similarity", "--trace", str(trace), "--model", model, "--out",
                            str(made / outputs[-1][1])], check=True)
        for folder, name in outputs:
            (ROOT / "models" / model / folder).mkdir(exist_ok=True)
            shutil.copyfile(made / name, ROOT / "models" / model / folder / name)

if __name__ == "__main__":
    main()
