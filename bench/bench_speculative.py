"""Speculative decoding by prompt lookup under offloading (moetier/engine/speculative.py): decode tokens/s and expert
bytes read a token with and without `--speculate`, the two alternated in each round, each run a fresh engine (an
empty expert cache), greedy, on two workloads —

  code-editing  prompts that repeat their context: code whose continuation repeats what came before (a block
                written again, a list that goes on)
  summarising   prose followed by a request to sum it up: a continuation that does not repeat the prompt

— at each expert budget. Greedy outputs are compared token for token (speculation must not change them).

    python bench/bench_speculative.py                      # ~15 min on 2 cores; JSON and plot in bench/out/speculative/
    python bench/bench_speculative.py --budgets 25% --rounds 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.common import OUT, cpu_description  # noqa: E402

FUNCTION = "def add(a, b):\n    return a + b\n\n"
WORKLOADS = {
    "code-editing": [
        FUNCTION * 2 + "def add(a, b):\n",
        "x = [1, 2, 3]\ny = [1, 2, 3]\nz = [1, 2, 3]\nw = [1, 2",
        "for i in range(10):\n    print(i)\nfor i in range(10):\n    print(i)\nfor i in range(10):\n",
    ],
    "summarising": [
        "The river ran past the old mill and the children played by its banks all summer long. In short,",
        "The king called his council together and asked what should be done about the winter. In short,",
        "She packed her bag, locked the door and walked to the station before the sun came up. In short,",
    ],
}


def run(model: str, budget: str, prompts: list[str], tokens: int, speculate: int) -> dict:
    from moetier import Engine
    from moetier.engine.speculative import Speculation

    spec = Speculation(tokens=speculate) if speculate else None
    with Engine.from_pretrained(model, expert_memory=budget, progress=False, speculation=spec) as engine:
        out = [engine.generate([p], max_new_tokens=tokens) for p in prompts]  # one request at a time (batch 1)
    made = [o.stats["new_tokens"] - 1 for o in out]  # decode steps' tokens (the first comes from the prefill)
    decode_s = sum(n / o.stats["decode_tokens_per_s"] for n, o in zip(made, out) if o.stats["decode_tokens_per_s"])
    decode_tokens = sum(made)
    read = sum((o.stats["expert_bytes_per_token"] or 0) * n for n, o in zip(made, out))
    spec_stats = [o.stats["speculation"] for o in out]
    drafted = sum(s["drafted"] for s in spec_stats)
    return {"decode_tokens_per_s": decode_tokens / decode_s, "expert_bytes_per_token": read / decode_tokens,
            "drafted": drafted, "accepted": sum(s["accepted"] for s in spec_stats),
            "verify_steps": sum(s["verify_steps"] for s in spec_stats), "token_ids": [o.token_ids[0] for o in out]}


def measure(args) -> list[dict]:
    from moetier.progress import tqdm

    rows = []
    cells = [(b, w) for b in args.budgets.split(",") for w in WORKLOADS]
    for budget, workload in tqdm(cells, desc="speculation", unit="cell"):
        runs = {"plain": [], "speculative": []}
        for _ in range(args.rounds):
            for mode, k in (("plain", 0), ("speculative", args.speculate)):
                runs[mode].append(run(args.model, budget, WORKLOADS[workload], args.tokens, k))
        plain, spec = runs["plain"], runs["speculative"]
        median = lambda rs, key: statistics.median(r[key] for r in rs)  # noqa: E731
        rows.append({
            "budget": budget, "workload": workload,
            "plain_tokens_per_s": median(plain, "decode_tokens_per_s"),
            "speculative_tokens_per_s": median(spec, "decode_tokens_per_s"),
            "speedup": median(spec, "decode_tokens_per_s") / median(plain, "decode_tokens_per_s"),
            "plain_bytes_per_token": median(plain, "expert_bytes_per_token"),
            "speculative_bytes_per_token": median(spec, "expert_bytes_per_token"),
            "acceptance": spec[0]["accepted"] / spec[0]["drafted"] if spec[0]["drafted"] else None,
            "verify_steps": spec[0]["verify_steps"],
            "greedy_identical": all(r["token_ids"] == plain[0]["token_ids"] for r in plain + spec),
            "rounds": {m: [{k: v for k, v in r.items() if k != "token_ids"} for r in rs] for m, rs in runs.items()}})
    return rows


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.8))
    labels = [f"{r['workload']}\n{r['budget']}" for r in rows]
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["plain_tokens_per_s"] for r in rows], 0.4, label="plain")
    ax.bar([i + 0.2 for i in x], [r["speculative_tokens_per_s"] for r in rows], 0.4, label="--speculate")
    for i, r in zip(x, rows):
        ax.annotate(f"{r['speedup']:.2f}×", (i + 0.2, r["speculative_tokens_per_s"]), ha="center", va="bottom",
                    fontsize=8)
    ax.set(xticks=list(x), xticklabels=labels, ylabel="decode tokens/s (median)", title=title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo-deep-xl")
    ap.add_argument("--budgets", default="25%,100%")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--speculate", type=int, default=4)
    ap.add_argument("--out", type=Path, default=OUT / "speculative")
    args = ap.parse_args()
    if args.rounds < 1 or args.tokens < 8 or args.speculate < 1:
        ap.error("--rounds at least 1, --tokens at least 8, --speculate at least 1")
    rows = measure(args)
    args.out.mkdir(parents=True, exist_ok=True)
    tmp = args.out / "speculative.json.tmp"
    tmp.write_text(json.dumps({"cpu": cpu_description(), "args": {k: str(v) for k, v in vars(args).items()},
                               "rows": rows}, indent=1))
    tmp.replace(args.out / "speculative.json")
    plot(rows, args.out / "speculative.png", f"prompt-lookup speculation, {args.model}, batch 1")
    print("| workload | budget | plain tok/s | --speculate tok/s | speed-up | MB read a token, plain → speculative "
          "| acceptance | verify steps | greedy identical |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        acc = "—" if r["acceptance"] is None else f"{r['acceptance']:.0%}"
        print(f"| {r['workload']} | {r['budget']} | {r['plain_tokens_per_s']:.2f} | "
              f"{r['speculative_tokens_per_s']:.2f} | {r['speedup']:.2f}× | {r['plain_bytes_per_token'] / 1e6:.0f} → "
              f"{r['speculative_bytes_per_token'] / 1e6:.0f} | {acc} | {r['verify_steps']} | "
              f"{'yes' if r['greedy_identical'] else 'NO'} |")
    print(f"wrote {args.out / 'speculative.json'}, {args.out / 'speculative.png'}")


if __name__ == "__main__":
    main()
