"""What holding output to a grammar costs a token (llguidance, moetier/engine/grammar.py): decode time per token
with and without a JSON schema, the two alternated in each round, on the demo models at a full expert budget (the
case where the grammar's share is largest: no expert reads to hide it); and the matcher's own work per token (the
mask computed and applied, the token fed back) timed alone and inside a run.

    python bench/bench_grammar.py          # ~1 min; JSON and plot in bench/out/grammar/
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.common import OUT, cpu_description  # noqa: E402

# a long string first, so a run is many tokens before the object may end
SCHEMA = {"type": "object", "properties": {"story": {"type": "string", "minLength": 200, "maxLength": 400},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["story", "n"], "additionalProperties": False}
PROMPT = "Once upon a time there was a king who"


def matcher_s(engine, tokens: list[int]) -> float:
    """The matcher's work per token along `tokens` (a constrained run's own): mask, apply, feed back."""
    import torch

    from moetier.engine.grammar import Grammar, GrammarTokenizer, Matcher

    vocab = GrammarTokenizer(engine.tokenizer.to_json(), engine.spec.vocab_size, list(engine.spec.eos_token_ids))
    m, logits = Matcher(Grammar.json_schema(SCHEMA), vocab), torch.zeros(engine.spec.vocab_size)
    start = time.perf_counter()
    for t in tokens:
        m.mask_(logits)
        m.accept(t)
    return (time.perf_counter() - start) / len(tokens)


def in_run_s(engine, grammar, tokens: int) -> float:
    """The matcher's work per token inside a constrained run (sharing the cores with the model's threads)."""
    from moetier.engine.grammar import Matcher

    spent, mask, accept = [0.0, 0], Matcher.mask_, Matcher.accept

    def timed(f):
        def call(self, *args):
            start = time.perf_counter()
            f(self, *args)
            spent[0] += time.perf_counter() - start
            spent[1] += f is mask
        return call

    Matcher.mask_, Matcher.accept = timed(mask), timed(accept)
    try:
        engine.generate([PROMPT], max_new_tokens=tokens, grammar=grammar)
    finally:
        Matcher.mask_, Matcher.accept = mask, accept
    return spent[0] / spent[1]


def run(model: str, rounds: int, tokens: int) -> dict:
    from moetier import Engine
    from moetier.engine.grammar import Grammar

    grammar = Grammar.json_schema(SCHEMA)
    with Engine.from_pretrained(ROOT / "models" / model, expert_memory="100%", progress=False) as engine:
        engine.generate([PROMPT], max_new_tokens=8)  # (warm)
        tpot = {"free": [], "json_schema": []}
        held_tokens = None
        for _ in range(rounds):
            for mode in tpot:
                out = engine.generate([PROMPT], max_new_tokens=tokens, ignore_eos=mode == "free",
                                      grammar=grammar if mode == "json_schema" else None)
                tpot[mode].append(out.stats["tpot_s"])
                if mode == "json_schema":
                    held_tokens = out.token_ids[0]
        per_token, inside = matcher_s(engine, held_tokens), in_run_s(engine, grammar, tokens)
    free, held = statistics.median(tpot["free"]), statistics.median(tpot["json_schema"])
    return {"model": model, "vocab": engine.spec.vocab_size, "rounds": tpot, "tpot_free_s": free,
            "tpot_json_schema_s": held, "slowdown": held / free, "matcher_s_per_token": per_token,
            "matcher_in_run_s_per_token": inside,
            "constrained_tokens": len(held_tokens)}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["tpot_free_s"] * 1e3 for r in rows], 0.4, label="free")
    ax.bar([i + 0.2 for i in x], [r["tpot_json_schema_s"] * 1e3 for r in rows], 0.4, label="JSON schema")
    ax.set(xticks=list(x), xticklabels=[r["model"] for r in rows], ylabel="decode ms / token (median)",
           title="constrained decoding's cost (llguidance), full expert budget")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="demo-fine,demo-deep")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--out", type=Path, default=OUT / "grammar")
    args = ap.parse_args()
    if args.rounds < 1 or args.tokens < 16:
        ap.error("--rounds at least 1, --tokens at least 16")
    rows = [run(m, args.rounds, args.tokens) for m in args.models.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "grammar.json").write_text(json.dumps({"cpu": cpu_description(), "rows": rows}, indent=1))
    plot(rows, args.out / "grammar.png")
    print("| model | vocabulary | decode ms/token free | with a JSON schema | ratio | matcher a token, alone | "
          "in the run |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['vocab']} | {r['tpot_free_s'] * 1e3:.2f} | {r['tpot_json_schema_s'] * 1e3:.2f} | "
              f"{r['slowdown']:.3f}× | {r['matcher_s_per_token'] * 1e6:.0f} µs | "
              f"{r['matcher_in_run_s_per_token'] * 1e6:.0f} µs |")
    print(f"wrote {args.out / 'grammar.json'}, {args.out / 'grammar.png'}")


if __name__ == "__main__":
    main()
