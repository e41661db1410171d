"""Exact mode on your own checkpoint: moetier's logits and greedy tokens against Hugging Face transformers' on the
same folder, at several expert budgets — what tests/model/test_parity.py checks on tiny random models, for a real
one.

    python bench/check_parity.py --model PATH/TO/HF_FOLDER [--expert-memory 10%,50%,100%] [--prompt TEXT]

transformers loads the whole model at the checkpoint's precision (it must fit in memory; moetier converts the
folder into its cache on first use). The claim is fp32's: an fp32 checkpoint agrees to ~1e-6; bf16 ones differ by
bf16 rounding (other kernels sum in other orders), and their greedy tokens may part after a near tie. Prints a
table and writes JSON (--out)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from moetier import Engine
from moetier.engine.stats import GenerationStats
from moetier.errors import BudgetError
from moetier.model.batch import StepBatch
from moetier.model.kv_cache import KVCache
from moetier.plan.route import DECODE, PREFILL
from moetier.progress import tqdm

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model")


def reference(model, prompt: list[int], steps: int, tokens: int, start: int | None):
    """transformers' next-token logits after the prompt and after each of `steps` greedy tokens, and its greedy
    continuation of `tokens` tokens. `start`: an encoder-decoder's decoder start token (None: decoder-only)."""
    with torch.no_grad():
        ids = torch.tensor([prompt])
        if start is None:
            out = model(ids, use_cache=True)
            kwargs = {}
        else:
            kwargs = {"encoder_outputs": model.get_encoder()(input_ids=ids)}
            out = model(decoder_input_ids=torch.tensor([[start]]), use_cache=True, **kwargs)
        logits, past, fed = [out.logits[0, -1]], out.past_key_values, []
        for _ in range(steps):
            fed.append(int(logits[-1].argmax()))
            key = "input_ids" if start is None else "decoder_input_ids"
            out = model(**{key: torch.tensor([[fed[-1]]])}, past_key_values=past, use_cache=True, **kwargs)
            logits.append(out.logits[0, -1])
            past = out.past_key_values
        greedy = model.generate(ids, max_new_tokens=tokens, do_sample=False)[0].tolist()
    return logits, fed, greedy[1:] if start is not None else greedy[len(prompt):]


def ours(engine: Engine, prompt: list[int], fed: list[int], tokens: int):
    """moetier's logits for the same prefill and fed tokens, and its greedy continuation."""
    spec = engine.spec
    kv = KVCache(spec, 1, len(prompt) + len(fed) + 1, engine.model.dtype, engine.model.device)
    stats = GenerationStats().phases
    engine.executor.layer_step.on_sequence_start()
    engine.executor.begin_step(PREFILL, stats)
    logits = [engine.model.forward(StepBatch.prefill([prompt], [0], device=engine.model.device), kv)[0]]
    for i, token in enumerate(fed):
        engine.executor.begin_step(DECODE, stats)
        step = StepBatch.decode_step([token], [0], [len(prompt) + i], 1, device=engine.model.device)
        logits.append(engine.model.forward(step, kv)[0])
    out = engine.generate([prompt], max_new_tokens=tokens, ignore_eos=True)
    return logits, out.token_ids[0], out.stats["hit_rate"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a Hugging Face model folder of a supported family")
    p.add_argument("--expert-memory", default="10%,50%,100%", help="expert budgets, comma-separated")
    p.add_argument("--prompt", default="It was a fine morning, and", help="the prompt (random ids without a "
                                                                            "tokenizer)")
    p.add_argument("--steps", type=int, default=16, help="decode steps whose logits are compared")
    p.add_argument("--tokens", type=int, default=32, help="greedy tokens compared")
    p.add_argument("--out", default="parity.json", help="the JSON report")
    args = p.parse_args(argv)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM

    folder = Path(args.model)
    config = AutoConfig.from_pretrained(folder)
    seq2seq = bool(getattr(config, "is_encoder_decoder", False))
    model = (AutoModelForSeq2SeqLM if seq2seq else AutoModelForCausalLM).from_pretrained(folder, dtype="auto").eval()
    if any((folder / name).exists() for name in TOKENIZER_FILES):
        from transformers import AutoTokenizer

        prompt = AutoTokenizer.from_pretrained(folder)(args.prompt)["input_ids"]
    else:  # random ids, as the tests use (transformers would make an untrained tokenizer up)
        prompt = torch.randint(3, config.vocab_size, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    start = config.decoder_start_token_id if seq2seq else None
    ref_logits, fed, ref_greedy = reference(model, prompt, args.steps, args.tokens, start)
    rows = []
    for budget in tqdm(args.expert_memory.split(","), desc="budgets", unit="budget"):
        try:
            engine = Engine.from_pretrained(folder, expert_memory=budget, progress=False)
        except BudgetError as e:  # too small for this model: said, and the other budgets run
            print(f"{budget}: {str(e).splitlines()[0]}", file=sys.stderr)
            continue
        with engine:
            logits, greedy, hit = ours(engine, prompt, fed, args.tokens)
        diffs = [(a.float() - b.float()).abs().max().item() for a, b in zip(logits, ref_logits)]
        same = next((i for i, (a, b) in enumerate(zip(greedy, ref_greedy)) if a != b), len(ref_greedy))
        rows.append({"expert_memory": budget, "max_abs_logit_diff": max(diffs), "prefill_diff": diffs[0],
                     "greedy_tokens_equal": same, "greedy_tokens": len(ref_greedy), "hit_rate": hit})
    report = {"model": str(folder), "dtype": str(model.dtype).removeprefix("torch."), "prompt_tokens": len(prompt),
              "steps": args.steps, "rows": rows}
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"{folder} ({report['dtype']}), {len(prompt)} prompt tokens, {args.steps} decode steps")
    print(f"{'budget':>8}  {'max |Δlogit|':>12}  {'greedy equal':>12}  {'hit':>6}")
    for r in rows:
        print(f"{r['expert_memory']:>8}  {r['max_abs_logit_diff']:>12.2e}  "
              f"{r['greedy_tokens_equal']:>5} of {r['greedy_tokens']:<4}  {r['hit_rate']:>6.1%}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
