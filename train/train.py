"""Train a demo model with transformers' own model classes; resumable; progress shown; exported into models/.

    python -m train.train demo-fine [--threads 1]        # ~1 hour on this 2-core CPU
    python -m train.train demo-coarse [--threads 1]
    python -m train.train demo-deep --threads 2          # ~1.5 hours on both cores

Checkpoints go to ~/.cache/moetier/train/<name>/ckpt.pt ($MOETIER_CACHE/train/... if set) every `checkpoint_every` steps (written to a temporary
file, then renamed); rerunning the same command resumes from there. At the end the model is saved in bf16 with
its tokenizer to models/<name>/ (via a temporary folder, renamed into place), with training.json beside it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

from moetier.atomic import atomic_dir
from moetier.paths import default_cache_dir
from moetier.progress import tqdm
from train import corpus, tokenizer
from train.configs import RECIPES, Recipe

ROOT = Path(__file__).resolve().parents[1]
WORK = default_cache_dir() / "train"


def token_arrays(tok_dir: Path) -> dict[str, np.ndarray]:
    """The corpus encoded once with the demo tokenizer, cached as uint16 arrays."""
    from tokenizers import Tokenizer

    cache = WORK / "tokens"
    if not (cache / "done").exists():
        tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
        cache.mkdir(parents=True, exist_ok=True)
        for name, text in corpus.load().items():
            docs = text.split(corpus.SEPARATOR)
            ids = [i for enc in tok.encode_batch(docs) for i in enc.ids + [0]]  # EOS between documents
            np.save(cache / f"{name}.npy", np.asarray(ids, dtype=np.uint16))
        (cache / "done").write_text("ok")
    return {p.stem: np.load(p) for p in cache.glob("*.npy")}


def batch(tokens: dict[str, np.ndarray], recipe: Recipe, step: int, split: str = "train") -> torch.Tensor:
    """Half prose, half code; random windows drawn from a generator seeded by the step (so resuming is exact)."""
    rng = np.random.default_rng([recipe.seed, step])
    rows = []
    for domain in ("prose", "code"):
        data = tokens[f"{domain}_{split}"]
        starts = rng.integers(0, len(data) - recipe.seq_len - 1, recipe.batch_size // 2)
        rows += [data[s:s + recipe.seq_len] for s in starts]
    return torch.from_numpy(np.stack(rows).astype(np.int64))


def lr_at(recipe: Recipe, step: int) -> float:
    if step < recipe.warmup:
        return recipe.lr * (step + 1) / recipe.warmup
    progress = (step - recipe.warmup) / max(1, recipe.steps - recipe.warmup)
    return recipe.lr * (recipe.min_lr_ratio + (1 - recipe.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def build_model(recipe: Recipe):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(recipe.model_type, **recipe.config, output_router_logits=True,
                                  router_aux_loss_coef=recipe.router_aux_loss_coef)
    torch.manual_seed(recipe.seed)
    return AutoModelForCausalLM.from_config(config, experts_implementation="grouped_mm")


def save_atomic(obj, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


@torch.no_grad()
def valid_loss(model, tokens, recipe: Recipe, batches: int = 4) -> dict[str, float]:
    model.eval()
    out = {}
    for domain in ("prose", "code"):
        losses = []
        for i in range(batches):
            x = batch(tokens, recipe, 10**6 + i, "valid")
            x = x[: recipe.batch_size // 2] if domain == "prose" else x[recipe.batch_size // 2:]
            with torch.autocast("cpu", dtype=torch.bfloat16):
                losses.append(model(input_ids=x, labels=x, output_router_logits=False).loss.item())
        out[domain] = float(np.mean(losses))
    model.train()
    return out


def export(model, recipe: Recipe, tok_dir: Path, record: dict, models_dir: Path) -> Path:
    dest = models_dir / recipe.name
    with atomic_dir(dest) as tmp:
        model.config.output_router_logits = False
        model.to(torch.bfloat16).save_pretrained(tmp)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tok_dir / f, tmp / f)
        (tmp / "training.json").write_text(json.dumps(record, indent=1))
    return dest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name", choices=sorted(RECIPES))
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--steps", type=int, help="override the recipe's step count")
    ap.add_argument("--work-dir", type=Path, default=WORK, help="checkpoints (default %(default)s)")
    ap.add_argument("--models-dir", type=Path, default=ROOT / "models", help="where the model is exported")
    args = ap.parse_args()
    recipe = RECIPES[args.name]
    if args.steps:
        from dataclasses import replace
        recipe = replace(recipe, steps=args.steps)
    torch.set_num_threads(args.threads)
    work = args.work_dir / recipe.name
    work.mkdir(parents=True, exist_ok=True)
    tok_dir = tokenizer.load()
    tokens = token_arrays(tok_dir)
    model = build_model(recipe)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": recipe.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=recipe.lr, betas=(0.9, 0.95))
    state = {"step": 0, "elapsed_s": 0.0, "log": []}
    ckpt = work / "ckpt.pt"
    if ckpt.exists():
        saved = torch.load(ckpt, weights_only=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        state = saved["state"]
        print(f"resuming {recipe.name} at step {state['step']}", file=sys.stderr)
    model.train()
    bar = tqdm(total=recipe.steps, initial=state["step"], desc=recipe.name, unit="step")
    start = time.perf_counter() - state["elapsed_s"]
    while state["step"] < recipe.steps:
        step = state["step"]
        for g in opt.param_groups:
            g["lr"] = lr_at(recipe, step)
        x = batch(tokens, recipe, step)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(input_ids=x, labels=x)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        state["step"] += 1
        aux = float(out.aux_loss) if out.aux_loss is not None else 0.0
        state["log"].append((state["step"], float(out.loss) - recipe.router_aux_loss_coef * aux, aux))
        bar.set_postfix(loss=f"{state['log'][-1][1]:.3f}", aux=f"{aux:.3f}")
        bar.update()
        if state["step"] % recipe.checkpoint_every == 0 or state["step"] == recipe.steps:
            state["elapsed_s"] = time.perf_counter() - start
            save_atomic({"model": model.state_dict(), "optimizer": opt.state_dict(), "state": state}, ckpt)
    bar.close()
    elapsed = time.perf_counter() - start
    last = state["log"][-50:]
    record = {
        "command": f"python -m train.train {shlex.join(sys.argv[1:])}",
        "recipe": {k: v for k, v in recipe.__dict__.items()},
        "train_time_s": elapsed,
        "threads": args.threads,
        "tokens_seen": recipe.steps * recipe.batch_size * recipe.seq_len,
        "final_train_loss": float(np.mean([l for _, l, _ in last])),
        "final_aux_loss": float(np.mean([a for _, _, a in last])),
        "final_valid_loss": valid_loss(model, tokens, recipe),
        "loss_curve": state["log"][::10],
        "torch": torch.__version__,
    }
    path = export(model, recipe, tok_dir, record, args.models_dir)
    print(f"wrote {path}: valid loss {record['final_valid_loss']}", file=sys.stderr)


if __name__ == "__main__":
    main()
