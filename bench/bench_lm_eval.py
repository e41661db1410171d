"""lm-evaluation-harness against `moetier serve`: its `local-completions` model scores a task defined over a local
file (held-out prose the demo models never trained on; log-likelihood of each document, `loglikelihood_rolling`),
and the same documents are scored by `moetier eval` — the perplexities side by side.

How any configuration is evaluated with the harness: serve it (`moetier serve --model M --precision int4 ...`) and
point `local-completions` at it, with the model's own tokenizer (a folder with its tokenizer.json: the model's,
or its store):

    lm_eval --model local-completions --tasks TASK --model_args \\
        model=M,base_url=http://127.0.0.1:8000/v1/completions,tokenizer_backend=huggingface,tokenizer=STORE,max_length=512

    pip install "lm_eval[api]"          # once: the harness is not a dependency of moetier
    python bench/bench_lm_eval.py       # demo-deep, 8 documents of the held-out prose
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.bench_serve import free_port  # noqa: E402
from bench.common import OUT  # noqa: E402

TASK = """task: moetier_heldout
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
"""


def documents(tokenizer, count: int, tokens: int) -> list[str]:
    """`count` documents of about `tokens` tokens each: whole paragraphs of the held-out prose."""
    from train.corpus import load

    paragraphs = [p.strip() for p in load()["prose_valid"].split("\n") if len(p.split()) >= 20]
    docs, current = [], ""
    for p in paragraphs:
        candidate = f"{current}\n{p}" if current else p
        if len(tokenizer.encode(candidate)) > tokens:
            if current:
                docs.append(current)
            current = p if len(tokenizer.encode(p)) <= tokens else ""
        else:
            current = candidate
        if len(docs) == count:
            break
    return docs


def moetier_eval(model: str, doc: str, eot: str, folder: Path) -> tuple[float, int]:
    """`moetier eval` on one document, scored as the harness scores it: after the end-of-text token, every token
    of the document. Returns (summed negative log-likelihood, tokens)."""
    from moetier.model_info import inspect_model

    path = folder / "doc.txt"
    path.write_text(eot + doc, encoding="utf-8")
    n = len(inspect_model(model).tokenizer().encode(eot + doc))
    out = subprocess.run([sys.executable, "-m", "moetier.cli", "eval", "--model", model, "--expert-memory", "100%",
                          "--text", f"doc={path}", "--window", str(n), "--windows", "1", "--prefix", "1", "--json"],
                         capture_output=True, text=True, check=True)
    record = json.loads(out.stdout)
    domain = record["rows"][0]["domains"][0] if "rows" in record else record[0]["domains"][0]
    return math.log(domain["perplexity"]) * domain["tokens"], domain["tokens"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo-deep")
    ap.add_argument("--documents", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=200, help="tokens per document, at most")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    import lm_eval
    from lm_eval.tasks import TaskManager

    from moetier.model_info import inspect_model
    from moetier.resolve import resolve_model

    store = resolve_model(args.model, None, True, False)  # (converted or built now: the tokenizer's folder)
    tokenizer = inspect_model(args.model).tokenizer()
    docs = documents(tokenizer, args.documents, args.tokens)
    eot = "<|endoftext|>"
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "moetier.cli", "serve", "--model", args.model, "--port",
                               str(port), "--expert-memory", "100%", "--max-model-len", "512"],
                              stderr=subprocess.DEVNULL, env={**os.environ})
    try:
        import httpx

        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                if server.poll() is not None:
                    raise RuntimeError("the server did not start") from None
                time.sleep(0.3)
        with tempfile.TemporaryDirectory() as tmp:
            data = Path(tmp) / "docs.jsonl"
            data.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
            (Path(tmp) / "moetier_heldout.yaml").write_text(TASK.format(data=data))
            results = lm_eval.simple_evaluate(
                model="local-completions",
                model_args=f"model={args.model},base_url=http://127.0.0.1:{port}/v1/completions,"
                           f"tokenizer_backend=huggingface,tokenizer={store},max_length=512,num_concurrent=1",
                tasks=["moetier_heldout"], task_manager=TaskManager(include_path=tmp))
            harness = {k.split(",")[0]: v for k, v in results["results"]["moetier_heldout"].items()
                       if isinstance(v, float)}
            ours = [moetier_eval(args.model, d, eot, Path(tmp)) for d in docs]
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)
    nll, tokens = sum(n for n, _ in ours), sum(t for _, t in ours)
    nbytes = sum(len(d.encode("utf-8")) for d in docs)
    words = sum(len(re.split(r"\s+", d)) for d in docs)
    mine = {"token_perplexity": math.exp(nll / tokens), "byte_perplexity": math.exp(nll / nbytes),
            "word_perplexity": math.exp(nll / words), "bits_per_byte": nll / nbytes / math.log(2)}
    harness_nll = math.log(harness["byte_perplexity"]) * nbytes
    harness["token_perplexity"] = math.exp(harness_nll / tokens)
    result = {"model": args.model, "documents": len(docs), "tokens": tokens, "bytes": nbytes, "words": words,
              "lm_eval": harness, "moetier_eval": mine, "lm_eval_version": lm_eval.__version__}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_lm_eval.json").write_text(json.dumps(result, indent=1))
    print(f"{args.model}: {len(docs)} held-out documents, {tokens} tokens")
    print(f"{'':18}{'lm-eval (served)':>18}{'moetier eval':>14}")
    for key in ("token_perplexity", "word_perplexity", "byte_perplexity", "bits_per_byte"):
        print(f"{key:18}{harness[key]:18.4f}{mine[key]:14.4f}")


if __name__ == "__main__":
    main()
