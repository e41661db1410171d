"""`moetier serve` under concurrent clients: continuous batching against the same requests served one at a time.

Two servers of the same model and expert budget run side by side (one decodes up to --max-running sequences
together, the other one at a time: --max-running 1, the rest queued); only one is sent work at a time, the two
alternating at each concurrency level (which goes first turns each level). At concurrency C, C clients each send
--requests-per-client streaming requests one after another (greedy, a fixed number of tokens, EOS ignored), over
loopback. Measured at the client: output tokens/s over the level's wall time, time to first token and the gaps
between tokens (p50/p90/p99); from the server's /metrics: expert bytes read per generated token.

    python bench/bench_serve.py                                  # demo-deep-xl, 25%, concurrency 1,2,4,8
    python bench/bench_serve.py --model demo-fine --concurrency 1,4 --requests-per-client 2 --tokens 16   # quick
    python bench/bench_serve.py --report bench/out/bench_serve.json   # the table and plot again
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.common import OUT, cpu_description  # noqa: E402
from train.corpus import VALID_BOOKS, prompt_lines  # noqa: E402

MODES = ("batching", "one-at-a-time")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, args: argparse.Namespace, max_running: int, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "moetier.cli", "serve", "--model", args.model, "--expert-memory",
               args.expert_memory, "--port", str(self.port), "--max-running", str(max_running), "--max-queue", "256",
               "--max-model-len", str(args.max_model_len), *args.serve_args.split()]
        self.log = log.open("w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ})

    def wait_up(self, timeout: float = 1800) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}): see {self.log.name}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not come up")
            time.sleep(0.5)

    def counters(self) -> dict[str, float]:
        import httpx

        text = httpx.get(self.url + "/metrics", timeout=10).text
        out = {}
        for name in ("moetier_expert_read_bytes_total", "moetier_generation_tokens_total"):
            m = re.search(rf"^{name} (\S+)$", text, re.M)
            out[name] = float(m.group(1)) if m else 0.0
        return out

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


async def one_request(client, url: str, prompt: str, tokens: int) -> dict:
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    stamps, generated, first = [], 0, True
    async with client.stream("POST", url + "/v1/completions", json=body, timeout=3600) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "usage" in chunk:  # the last: no token of its own
                generated = chunk["usage"]["completion_tokens"]
            elif first:  # the opening chunk (the role, or an echo): sent before any token
                first = False
            else:  # one chunk per token
                stamps.append(time.perf_counter())
    return {"ttft": stamps[0] - start if stamps else None, "gaps": np.diff(stamps).tolist(), "tokens": generated}


async def level(server: Server, prompts: list[str], concurrency: int, per_client: int, tokens: int) -> dict:
    import httpx

    before = server.counters()
    jobs = [prompts[(c * per_client + i) % len(prompts)] for c in range(concurrency) for i in range(per_client)]

    async def client_loop(c: int, client) -> list[dict]:
        return [await one_request(client, server.url, p, tokens) for p in jobs[c * per_client:(c + 1) * per_client]]

    start = time.perf_counter()
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=concurrency + 2)) as client:
        results = [r for rs in await asyncio.gather(*(client_loop(c, client) for c in range(concurrency)))
                   for r in rs]
    wall = time.perf_counter() - start
    after = server.counters()
    generated = sum(r["tokens"] for r in results)
    ttft = [r["ttft"] for r in results if r["ttft"] is not None]
    gaps = [g for r in results for g in r["gaps"]]
    read = after["moetier_expert_read_bytes_total"] - before["moetier_expert_read_bytes_total"]

    def pct(v, q):
        return float(np.percentile(v, q)) if v else None

    return {"concurrency": concurrency, "requests": len(results), "generated": generated, "wall_s": wall,
            "tok_s": generated / wall, "ttft_p50": pct(ttft, 50), "ttft_p90": pct(ttft, 90), "ttft_p99": pct(ttft, 99),
            "itl_p50": pct(gaps, 50), "itl_p90": pct(gaps, 90), "itl_p99": pct(gaps, 99),
            "itl_mean": float(np.mean(gaps)) if gaps else None, "bytes_per_token": read / generated}


def cpu_label(cpu: dict | str) -> str:
    """(an older run's JSON holds the model name alone)"""
    if isinstance(cpu, str):
        return cpu
    return f"{cpu['model']}, {cpu['cores']} cores, flags {' '.join(cpu['vector_flags'])}"


def report(result: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    by = {(r["mode"], r["concurrency"]): r for r in rows}
    levels = sorted({r["concurrency"] for r in rows})
    single = by.get(("one-at-a-time", 1)) or by.get(("batching", 1))
    tpot = single["itl_mean"] if single else None
    lines = [f"{result['model']} at {result['expert_memory']}, {result['tokens']} tokens a request, "
             f"{result['requests_per_client']} requests a client; {cpu_label(result['cpu'])}", "",
             "| concurrency | mode | tok/s | × one-at-a-time | TTFT p50 / p90 / p99 (s) | inter-token p50 / p90 / p99 "
             "(ms) | p90 / single-stream TPOT | expert MiB read / token |",
             "|---|---|---|---|---|---|---|---|"]
    for c in levels:
        base = by.get(("one-at-a-time", c))
        for mode in MODES:
            r = by.get((mode, c))
            if r is None:
                continue
            gain = f"{r['tok_s'] / base['tok_s']:.2f}×" if base else "—"
            ratio = f"{r['itl_p90'] / tpot:.2f}×" if tpot and r["itl_p90"] else "—"
            lines.append(f"| {c} | {mode} | {r['tok_s']:.2f} | {gain} | {r['ttft_p50']:.2f} / {r['ttft_p90']:.2f} / "
                         f"{r['ttft_p99']:.2f} | {r['itl_p50'] * 1e3:.0f} / {r['itl_p90'] * 1e3:.0f} / "
                         f"{r['itl_p99'] * 1e3:.0f} | {ratio} | {r['bytes_per_token'] / 2**20:.1f} |")
    table = "\n".join(lines)
    (out / "bench_serve.md").write_text(table + "\n")
    print(table)
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for mode, marker in zip(MODES, "os"):
        rs = [by[(mode, c)] for c in levels if (mode, c) in by]
        cs = [r["concurrency"] for r in rs]
        axes[0].plot(cs, [r["tok_s"] for r in rs], marker=marker, label=mode)
        axes[1].plot(cs, [r["itl_p90"] * 1e3 for r in rs], marker=marker, label=f"{mode} p90")
        axes[2].plot(cs, [r["bytes_per_token"] / 2**20 for r in rs], marker=marker, label=mode)
    axes[0].set_ylabel("output tokens/s")
    axes[1].set_ylabel("inter-token latency p90 (ms)")
    axes[2].set_ylabel("expert MiB read per token")
    for ax in axes:
        ax.set_xlabel("concurrent clients")
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"moetier serve: {result['model']} at {result['expert_memory']} expert memory")
    fig.tight_layout()
    fig.savefig(out / "bench_serve.png", dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo-deep-xl")
    ap.add_argument("--expert-memory", default="25%")
    ap.add_argument("--concurrency", default="1,2,4,8")
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32, help="generated tokens per request (EOS ignored)")
    ap.add_argument("--max-running", type=int, default=8, help="the batching server's")
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--serve-args", default="", help="more options for both servers, e.g. '--policy lfu'")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--report", type=Path, help="redraw the table and plot of an earlier run's JSON")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.report:
        return report(json.loads(args.report.read_text()), args.out)
    levels = [int(c) for c in args.concurrency.split(",")]
    prompts = prompt_lines(list(VALID_BOOKS), 64, words=40)
    servers = {"batching": Server(args, args.max_running, args.out / "serve-batching.log"),
               "one-at-a-time": Server(args, 1, args.out / "serve-one.log")}
    rows = []
    try:
        for s in servers.values():
            s.wait_up()
        for s in servers.values():  # a warm cache for both before anything is measured
            asyncio.run(level(s, prompts[-4:], 1, 2, 8))
        for i, c in enumerate(levels):
            order = MODES if i % 2 == 0 else MODES[::-1]
            for mode in order:
                r = asyncio.run(level(servers[mode], prompts, c, args.requests_per_client, args.tokens))
                rows.append({"mode": mode, **r})
                print(f"concurrency {c} {mode}: {r['tok_s']:.2f} tok/s, inter-token p90 "
                      f"{r['itl_p90'] * 1e3:.0f} ms, {r['bytes_per_token'] / 2**20:.1f} MiB/token", flush=True)
    finally:
        for s in servers.values():
            s.stop()
    result = {"model": args.model, "expert_memory": args.expert_memory, "tokens": args.tokens,
              "requests_per_client": args.requests_per_client, "max_running": args.max_running, "cpu": cpu_description(),
              "loadavg_before": os.getloadavg(), "rows": rows}
    (args.out / "bench_serve.json").write_text(json.dumps(result, indent=1))
    report(result, args.out)


if __name__ == "__main__":
    main()
