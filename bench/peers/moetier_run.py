"""One moetier decode measurement, in its own process (so a memory cgroup holds it alone): the engine on a store at
a budget and precision, a random prompt, warm-up tokens, then the measured ones; the share of its memory in huge
pages, and then the process's memory read rate (probe.py). Prints one JSON line.

With "batch": B it decodes B sequences together (each its own random prompt; a step makes a token of each,
its tok/s B over the step's time: what llama-batched-bench's S_TG reports). With "prompt_tokens": N it measures prompt processing instead, as llama-bench's pp test
does: a warm-up prefill of N random ids, then "repetitions" prefills of N other random ids (the first token
sampled from each: its TTFT), each one's prompt tokens/s kept.

    python bench/peers/moetier_run.py '{"store": ..., "budget": "auto", "precision": "int4", ...}'
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def huge_page_share() -> float | None:
    """The share of this process's resident memory in transparent huge pages (/proc/self/smaps_rollup), or None
    where the kernel does not say: weights in 4 KiB pages stream slower (moetier/engine/huge_pages.py)."""
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/self/smaps_rollup").read_text().splitlines()[1:])
        return int(fields["AnonHugePages"].split()[0]) / int(fields["Rss"].split()[0])
    except (OSError, KeyError, ValueError, ZeroDivisionError):
        return None


def run(cfg: dict) -> dict:
    from moetier import Engine
    from moetier.cache.policies import DEFAULT_POLICY
    from moetier.plan.precision import MixedPrecision

    t0 = time.perf_counter()
    engine = Engine.from_pretrained(cfg["store"], expert_memory=cfg["budget"], progress=False,
                                    precision=MixedPrecision(cfg.get("precision", "native")),
                                    dense_precision=cfg.get("dense_precision", "native"),
                                    kernels=cfg.get("kernels", "auto"), policy=cfg.get("policy") or DEFAULT_POLICY)
    load_s = time.perf_counter() - t0
    if cfg.get("preload"):
        engine.preload()
    rng = random.Random(cfg.get("seed", 0))
    vocab = engine.spec.vocab_size
    if cfg.get("prompt_tokens"):
        return prefill(engine, cfg, rng, load_s)
    n = cfg.get("batch", 1)  # sequences decoded together (a server's batch); tok/s over all of them
    warm, prompts = ([[rng.randrange(vocab) for _ in range(cfg.get("prompt_len", 16))] for _ in range(n)]
                     for _ in range(2))
    if cfg.get("warmup_tokens", 16):
        engine.generate(warm, max_new_tokens=cfg.get("warmup_tokens", 16), ignore_eos=True)
    stats = engine.generate(prompts, max_new_tokens=cfg["tokens"], ignore_eos=True).stats
    note = engine.budget.note
    huge = huge_page_share()
    engine.close()
    from probe import read_rate  # (this process's memory rate; not under a cap: the engine's memory is still held)
    return dict(tok_s=n / stats["tpot_s"], tpot_s=stats["tpot_s"], batch=n, tpot_p50_s=stats.get("tpot_p50_s"),
                hit_rate=stats.get("decode_hit_rate", stats.get("hit_rate")),
                expert_bytes_per_token=stats.get("expert_bytes_per_token"), peak_rss=stats.get("peak_rss_bytes"),
                load_s=load_s, budget_note=note, huge_page_share=huge, probe_in_gb_s=read_rate() if cfg.get("preload") else None)


def prefill(engine, cfg: dict, rng: random.Random, load_s: float) -> dict:
    """Prompt tokens/s of `repetitions` prefills after one to warm (each prompt new: nothing reused), median kept
    as `tok_s` — the number llama-bench's -p reports."""
    from moetier.engine.speed import SpeedTest, sample
    from moetier.engine.stats import peak_rss_bytes

    n = cfg["prompt_tokens"]
    # (the first warms: scratch sized, pages touched; `moetier bench`'s pp test, one run at a time)
    samples = [sample(engine, SpeedTest("pp", n), rng) for _ in range(1 + cfg.get("repetitions", 3))][1:]
    engine.close()
    return dict(tok_s=statistics.median(samples), samples_tok_s=samples, prompt_tokens=n,
                peak_rss=peak_rss_bytes(), load_s=load_s)


if __name__ == "__main__":
    print(json.dumps(run(json.loads(sys.argv[1]))))
