"""Speculative decoding by prompt lookup under offloading (moetier/engine/speculative.py): decode tokens/s and expert
bytes read a token with and without `--speculate`, the two alternated in each round, each run a fresh engine (an
empty expert cache), greedy, on two workloads —

  code-editing  code whose continuation repeats what came before (a line written again with an edit, a list that
                goes on, imports listed again)
  summarising   prose followed by "In short,": a continuation that does not repeat the prompt

— at each configuration (an expert budget and the cache's partition). Greedy outputs are compared token for token
(speculation must not change them), and each workload's `repeats` says what share of its plain continuation's tokens
prompt lookup guesses (the first draft token right): what makes it a repeating workload or not on this model.

    python bench/bench_speculative.py                      # ~25 min on 2 cores; JSON and plot in bench/out/speculative/
    python bench/bench_speculative.py --configs 25%:per-layer --rounds 2
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

# demo-deep-xl (demo-deep, a small trained model, its experts inflated) does not copy the code it is shown as a code
# model would (after two `def add(a, b): return a + b` it writes a function of its own): these are code prompts whose
# continuation on it does repeat what came before (`repeats` in the output measures it)
WORKLOADS = {
    "code-editing": [
        "x = x + 1\nx = x + 1\nx = x + 1\n",
        "x = [1, 2, 3]\ny = [1, 2, 3]\nz = [1, 2, 3]\nw = [1, 2",
        "import os\nimport sys\nimport json\n\nimport os\nimport sys\n",
    ],
    "summarising": [
        "The river ran past the old mill and the children played by its banks all summer long. In short,",
        "The king called his council together and asked what should be done about the winter. In short,",
        "She packed her bag, locked the door and walked to the station before the sun came up. In short,",
    ],
}


def repeats(prompt_ids: list[int], output: list[int], tokens: int) -> tuple[int, int]:
    """(tokens of `output` whose prompt-lookup draft, made from what came before, begins with them; len(output))."""
    from moetier.engine.speculative import NgramIndex, Speculation

    index, hit = NgramIndex(Speculation(tokens=tokens), prompt_ids), 0
    for t in output:
        draft = index.draft()
        hit += bool(draft.tokens) and draft.tokens[0] == t
        index.extend([t])
    return hit, len(output)


def run(model: str, budget: str, partition: str, prompts: list[str], tokens: int, speculate: int) -> dict:
    from moetier import Engine
    from moetier.engine.speculative import Speculation

    spec = Speculation(tokens=speculate) if speculate else None
    with Engine.from_pretrained(model, expert_memory=budget, cache_partition=partition, progress=False,
                                speculation=spec) as engine:
        out = [engine.generate([p], max_new_tokens=tokens) for p in prompts]  # one request at a time (batch 1)
        guessed = [repeats(engine.tokenizer.encode(p), o.token_ids[0], speculate or 4) for p, o in zip(prompts, out)]
    made = [o.stats["new_tokens"] - 1 for o in out]  # decode steps' tokens (the first comes from the prefill)
    decode_s = sum(n / o.stats["decode_tokens_per_s"] for n, o in zip(made, out) if o.stats["decode_tokens_per_s"])
    decode_tokens = sum(made)
    read = sum((o.stats["expert_bytes_per_token"] or 0) * n for n, o in zip(made, out))
    spec_stats = [o.stats["speculation"] for o in out]
    drafted = sum(s["drafted"] for s in spec_stats)
    return {"decode_tokens_per_s": decode_tokens / decode_s, "expert_bytes_per_token": read / decode_tokens,
            "drafted": drafted, "accepted": sum(s["accepted"] for s in spec_stats),
            "verify_steps": sum(s["verify_steps"] for s in spec_stats),
            "prompt_decode_s": [n / o.stats["decode_tokens_per_s"] for n, o in zip(made, out)],
            "repeats": sum(h for h, _ in guessed) / sum(n for _, n in guessed),
            "token_ids": [o.token_ids[0] for o in out]}


def measure(args, save=lambda rows: None) -> list[dict]:
    """Every cell's row, `save`d as each cell ends (a crash an hour in keeps what was measured)."""
    from moetier.progress import tqdm

    rows = []
    cells = [(c, w) for c in args.configs.split(",") for w in WORKLOADS]
    for config, workload in tqdm(cells, desc="speculation", unit="cell"):
        budget, partition = config.split(":")
        runs = {"plain": [], "speculative": []}
        for _ in range(args.rounds):
            for mode, k in (("plain", 0), ("speculative", args.speculate)):
                runs[mode].append(run(args.model, budget, partition, WORKLOADS[workload], args.tokens, k))
        plain, spec = runs["plain"], runs["speculative"]
        median = lambda rs, key: statistics.median(r[key] for r in rs)  # noqa: E731
        drafted, accepted = sum(r["drafted"] for r in spec), sum(r["accepted"] for r in spec)
        rows.append({
            "budget": budget, "partition": partition, "workload": workload,
            "plain_tokens_per_s": median(plain, "decode_tokens_per_s"),
            "speculative_tokens_per_s": median(spec, "decode_tokens_per_s"),
            "speedup": median(spec, "decode_tokens_per_s") / median(plain, "decode_tokens_per_s"),
            "round_speedups": [s["decode_tokens_per_s"] / p["decode_tokens_per_s"] for p, s in zip(plain, spec)],
            "plain_bytes_per_token": median(plain, "expert_bytes_per_token"),
            "speculative_bytes_per_token": median(spec, "expert_bytes_per_token"),
            "repeats": plain[0]["repeats"],
            "acceptance": accepted / drafted if drafted else None,
            "verify_steps": spec[0]["verify_steps"],
            "greedy_identical": all(r["token_ids"] == plain[0]["token_ids"] for r in plain + spec),
            "rounds": {m: [{k: v for k, v in r.items() if k != "token_ids"} for r in rs] for m, rs in runs.items()}})
        save(rows)
    return rows


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.8))
    labels = [f"{r['workload']}\n{r['budget']} {r['partition']}" for r in rows]
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["plain_tokens_per_s"] for r in rows], 0.4, label="plain")
    ax.bar([i + 0.2 for i in x], [r["speculative_tokens_per_s"] for r in rows], 0.4, label="--speculate")
    for i, r in zip(x, rows):
        ax.annotate(f"{r['speedup']:.2f}×", (i + 0.2, r["speculative_tokens_per_s"]), ha="center", va="bottom",
                    fontsize=8)
    ax.set(xticks=list(x), ylabel="decode tokens/s (median)", title=title)
    ax.set_xticklabels(labels, fontsize=7)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo-deep-xl")
    ap.add_argument("--configs", default="25%:per-layer,25%:global,100%:global",
                    help="BUDGET:PARTITION, comma-separated (the cache's partition: per-layer or global)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--speculate", type=int, default=4)
    ap.add_argument("--out", type=Path, default=OUT / "speculative")
    args = ap.parse_args()
    if args.rounds < 1 or args.tokens < 8 or args.speculate < 1:
        ap.error("--rounds at least 1, --tokens at least 8, --speculate at least 1")
    if any(c.count(":") != 1 or c.split(":")[1] not in ("per-layer", "global") for c in args.configs.split(",")):
        ap.error("--configs takes BUDGET:PARTITION items, e.g. 25%:per-layer,100%:global")
    args.out.mkdir(parents=True, exist_ok=True)

    def save(rows: list[dict]) -> None:
        tmp = args.out / "speculative.json.tmp"
        tmp.write_text(json.dumps({"cpu": cpu_description(), "args": {k: str(v) for k, v in vars(args).items()},
                                   "rows": rows}, indent=1))
        tmp.replace(args.out / "speculative.json")

    rows = measure(args, save)
    plot(rows, args.out / "speculative.png", f"prompt-lookup speculation, {args.model}, batch 1")
    print("| workload | repeats | budget, cache | plain tok/s | --speculate tok/s | speed-up (rounds) | MB read a token, "
          "plain → speculative | drafts kept | greedy identical |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        acc = "—" if r["acceptance"] is None else f"{r['acceptance']:.0%}"
        each = ", ".join(f"{x:.2f}" for x in r["round_speedups"])
        print(f"| {r['workload']} | {r['repeats']:.0%} | {r['budget']}, {r['partition']} | "
              f"{r['plain_tokens_per_s']:.2f} | {r['speculative_tokens_per_s']:.2f} | {r['speedup']:.2f}× ({each}) | "
              f"{r['plain_bytes_per_token'] / 1e6:.0f} → {r['speculative_bytes_per_token'] / 1e6:.0f} | {acc} | "
              f"{'yes' if r['greedy_identical'] else 'NO'} |")
    print(f"wrote {args.out / 'speculative.json'}, {args.out / 'speculative.png'}")


if __name__ == "__main__":
    main()
