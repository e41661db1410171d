"""moetier against llama.cpp on the same weights, on this machine, side by side: decode tokens/s with everything
resident and under memory caps, for each format and its moetier counterpart —

    bf16    llama.cpp BF16     moetier native (exact)
    q8_0    llama.cpp Q8_0     moetier --precision int8 --dense-precision int8
    q4_k_m  llama.cpp Q4_K_M   moetier --precision int4 / hobbit / low-tier, --dense-precision int4

and, for each format, "same file": moetier given that GGUF itself (`--model FILE.gguf`), computing it in the
file's own types (its Q8_0 / Q4_K / Q6_K blocks), so the two engines run the very same weights. And one more model:

    mxfp4_moe  gpt-oss-20b's shapes as its released GGUF holds them (MXFP4 experts, Q8_0 elsewhere:
               bench/peers/gpt_oss_synth.py, 12.1 GB), "same file" alone

The weights: the synthetic OLMoE-1B-7B store (written on first use, 13 GB), exported to a Hugging Face folder and
converted by llama.cpp's own converter, then llama-quantize (bench/peers/llamacpp.py builds llama.cpp from PyPI's
llama-cpp-python source distribution on first use). moetier reads its store, whose int8/int4 copies it adds.

Each run is its own process, in its own memory cgroup for a cap (cap = a share of that format's GGUF file: 100%,
60%, 35%, 20% by default), with both engines' files dropped from the page cache first (resident runs' too); the
engines alternate, the order turning every round. Resident: llama.cpp loads the file into memory up front (`-lm
none`), moetier holds every expert (100%, preloaded). Under a cap: llama.cpp maps the file (`-lm mmap`, what a user
runs) and moetier takes `--expert-memory auto`. llama.cpp's speed is the median of llama-bench's repetitions after
the first (which warms its mapping), every repetition kept in the JSON; moetier's is the TPOT of the measured tokens
after as many warm-up tokens. A row's spread (min–max over every repetition and round) stands beside its median in
the table and as error bars in the plot. Beside the harness, each moetier mode also runs as a user runs it (`moetier
generate --preload ...`), the `(generate)` rows.

Load aware (bench/load.py): before each run the machine must be idle (bounded wait); other processes' CPU is
sampled during the run and kept in the JSON; a run whose foreign load passes 0.25 cores is run again (twice at
most) and, if kept, marked in the table.

    python bench/peers/compare.py [--formats bf16,q8_0,q4_k_m] [--caps resident,100,60,35,20] [--rounds 2]

Prompt processing too (`--caps prefill`, `--prompt-tokens 512`): everything resident, llama-bench's pp test (`-p
512 -n 0`: a prompt of random ids in one batch, prompt tokens/s) beside moetier's prefill of 512 random ids (the
first token sampled: its TTFT), each after a warm-up prefill, `--repetitions` of each kept; its `(generate)` rows
are `moetier generate --prompt-file` on 512 tokens of Emma, the process's first prefill (what a user waits).

A server's batch too (`--caps batch`, `--batch 2,4,8`): everything resident, llama-batched-bench (`-npl B -npp 16
-ntg --tokens`: B sequences, each its own 16-token prompt, then a token of each a step; its S_TG, the steps' tokens/s
over all the sequences) beside moetier decoding B prompts together (moetier_run.py's "batch"; tok/s B over a step's
time), after as many warm-up tokens; no `(generate)` rows (`moetier generate` runs one sequence; a server's
batches are `moetier serve`'s).

Each run is preceded by a memory probe in a fresh process (probe.py: the read rate the host gives now), and
moetier's process probes itself after its tokens where no cap holds it (its memory is still held then):
compare.json keeps both beside the speed, so a round's pair can be read at the rates the engines met.

Writes OUT/compare.json (every run, and medians with the ratio per row), OUT/compare.md, OUT/compare.png, and
prints the table. `--report A/compare.json B/compare.json --out DIR` renders several runs as one table and plot
(docs/performance.md's: the resident rows from one run, the caps from another; a row measured again by a later
file is taken from it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent), str(HERE.parents[1])]

from cage import drop_cache, make_cage, run_caged  # noqa: E402
from common import cpu_description, save_figure  # noqa: E402
from llamacpp import LlamaCpp, build, parse_batched, parse_bench  # noqa: E402
from load import THRESHOLD_CORES, mark, measured  # noqa: E402

from moetier.paths import default_cache_dir  # noqa: E402

MODES = {  # format -> moetier's counterparts: (label, precision, dense precision)
    "bf16": [("native", "native", "native"), ("same file", "native", "native")],
    "q8_0": [("int8", "int8", "int8"), ("same file", "native", "native")],
    "q4_k_m": [("int4", "int4", "int4"), ("hobbit", "hobbit", "int4"), ("low-tier", "low-tier", "int4"),
               ("same file", "native", "native")],
    "mxfp4_moe": [("same file", "native", "native")],  # gpt-oss-20b-shaped (gpt_oss_synth.py): its file alone
}
SAME_FILE = "same file"  # moetier given llama.cpp's GGUF itself (`--model FILE.gguf`: its experts read in place, in
# the file's types; its attention and head in theirs)
MODE_PRECISIONS = {"native": (), "int8": ("int8",), "int4": ("int4",), "hobbit": ("int4",),
                   "low-tier": ("int4", "int2"), SAME_FILE: ()}  # the store's copies a mode reads (low-tier: whichever
# fits)
USER = " (generate)"  # a moetier mode run as a user runs it, `moetier generate`, beside the harness's own run
PREFILL = "prefill"  # the setting whose rows are prompt processing (llama-bench's pp test), not decoding
BATCH = "batch"  # the setting whose rows decode several sequences together (llama-batched-bench), resident


GPT_OSS = ("mxfp4_moe",)  # the formats of gpt-oss-20b's shape (gpt_oss_synth.py); the others are OLMoE's
MODEL_OF = {"mxfp4_moe": "gpt-oss-20b-shaped"}  # a plot's title: the model of its formats (else OLMoE-1B-7B's)


def title_model(summary: list[dict]) -> str:
    """What a plot of `summary`'s rows shows: its formats' models."""
    return " and ".join(dict.fromkeys(MODEL_OF.get(s["format"], "OLMoE-1B-7B-shaped") for s in summary))


def prepare(formats: list[str], llama: LlamaCpp, work: Path, store: Path | None) -> dict[str, Path]:
    """The GGUF of each format (made once), and the store's quantized copies."""
    import gpt_oss_synth
    from export import export_hf

    work.mkdir(parents=True, exist_ok=True)
    out = {f: gpt_oss_synth.make(llama, work) for f in formats if f in GPT_OSS}
    olmoe = [f for f in formats if f not in GPT_OSS]
    if olmoe:
        bf16 = work / "olmoe-1b-7b-synth-bf16.gguf"
        if not bf16.exists():
            hf = export_hf(store, work / "olmoe-1b-7b-synth-hf")
            print("converting to GGUF with llama.cpp's converter ...", flush=True)
            llama.convert(hf, bf16)
            shutil.rmtree(hf)
        out["bf16"] = bf16
    for f in olmoe:
        if f != "bf16":
            gguf = work / f"olmoe-1b-7b-synth-{f}.gguf"
            if not gguf.exists():
                print(f"llama-quantize {f} ...", flush=True)
            out[f] = llama.quantize(bf16, gguf, f)
    wanted = ",".join(copies_needed(formats))
    if wanted:
        subprocess.run(["moetier", "quantize", str(store), "--precisions", wanted], check=True)
    return {f: out[f] for f in formats}


def indexed(ggufs: dict[str, Path]) -> dict[str, Path]:
    """Each GGUF's store in moetier's cache (indexed once, here, outside any timed run) for the same-file rows."""
    from moetier.resolve import resolve_model

    if not any(m[0] == SAME_FILE for f in ggufs for m in MODES[f]):
        return {}
    return {f: resolve_model(g) for f, g in ggufs.items()}


def copies_needed(formats: list[str]) -> list[str]:
    """The store's quantized copies the modes that run read, and no others (the 1.8 GB int2 copy was built for
    Q4_K_M's int4 rows too)."""
    return sorted({p for f in formats for label, *_ in MODES[f] for p in MODE_PRECISIONS[label]})


def cold(run, paths: list[Path]) -> dict:
    """`run` after dropping `paths` from the page cache."""
    drop_cache(paths)
    return run()


def probe_rate() -> float:
    """The memory read rate a fresh process meets now (probe.py), for reading a round's pair."""
    proc = subprocess.run([sys.executable, str(HERE / "probe.py")], capture_output=True, text=True, check=True,
                          env=dict(os.environ, OMP_NUM_THREADS="2"))
    return float(proc.stdout.strip())


def llama_run(llama: LlamaCpp, gguf: Path, cap: int | None, tokens: int, threads: int, timeout: float,
              repetitions: int = 3, prompt: int = 0) -> dict:
    """llama-bench's every repetition kept (`samples_tok_s`); the run's speed is their median after the first,
    which warms a mapped file (one Q8_0 round moved from 1.29x to 1.72x on taking the last one alone). With
    `prompt`: its pp test, a `prompt`-token prompt in one batch (prompt tokens/s), no token decoded."""
    argv = llama.bench_argv(gguf, 0 if prompt else tokens, threads, repetitions=repetitions,
                            load="none" if cap is None else "mmap", prompt=prompt)
    proc, peak = run_caged(argv, cap, "moetier-peer", timeout)
    if proc.returncode != 0:
        return dict(error=f"llama-bench exit {proc.returncode}: {proc.stderr.strip()[-300:]}", peak=peak)
    r = parse_bench(proc.stdout)
    samples = r["samples_tok_s"]
    kept = samples[1:] if len(samples) > 1 else samples
    return dict(tok_s=statistics.median(kept), samples_tok_s=samples, peak=peak, build=r["build"])


def llama_batched_run(llama, gguf: Path, sequences: int, tokens: int, threads: int, timeout: float) -> dict:
    """llama-batched-bench: `sequences` decoded together, resident; decode tokens/s over all of them."""
    proc, peak = run_caged(llama.batched_argv(gguf, sequences, tokens, threads), None, "moetier-peer", timeout)
    if proc.returncode != 0:
        return dict(error=f"llama-batched-bench exit {proc.returncode}: {proc.stderr.strip()[-300:]}", peak=peak)
    return dict(parse_batched(proc.stdout), peak=peak)


def moetier_run(store: Path, mode: tuple[str, str, str], cap: int | None, tokens: int, timeout: float,
                kernels: str = "auto", prompt: int = 0, repetitions: int = 3, batch: int = 1,
                policy: str | None = None) -> dict:
    """moetier_run.py in its own process (and cgroup, under a cap): decode tok/s (of `batch` sequences decoded
    together: over all of them), or with `prompt` prompt tokens/s of `repetitions` prefills of that length after a
    warm-up one."""
    _, precision, dense = mode
    cfg = dict(store=str(store), budget="100%" if cap is None else "auto", preload=cap is None, precision=precision,
               dense_precision=dense, tokens=tokens, warmup_tokens=tokens, prompt_len=16, kernels=kernels,
               prompt_tokens=prompt, repetitions=repetitions, batch=batch, policy=policy)
    env = dict(os.environ, OMP_NUM_THREADS=str(2))
    proc, peak = run_caged([sys.executable, str(HERE / "moetier_run.py"), json.dumps(cfg)], cap, "moetier-peer",
                           timeout, env)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or [""])[-1]
        return dict(error=f"exit {proc.returncode}: {last[-300:]}", peak=peak)
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]), peak=peak)


def user_run(store: Path, mode: tuple[str, str, str], tokens: int, timeout: float, kernels: str = "auto",
             prompt_file: Path | None = None, policy: str | None = None) -> dict:
    """The mode as a user runs it resident: `moetier generate --expert-memory 100% --preload` (without --preload a
    resident run reads every expert from disk during its first tokens: 0.87x of the harness's figure, seen on a
    Zen 5), greedy, the decode speed from its statistics; with `prompt_file`, that prompt and one token: its prompt
    tokens over its TTFT (the process's first prefill, nothing warmed: what a user's first answer waits)."""
    _, precision, dense = mode
    prompt = ["--prompt-file", str(prompt_file), "--max-tokens", "1"] if prompt_file else [
        "--prompt", "The", "--max-tokens", str(tokens + 1)]
    argv = ["moetier", "generate", "--model", str(store), "--expert-memory", "100%", "--preload", "--precision",
            precision, "--dense-precision", dense, *prompt, "--ignore-eos", "--temperature", "0", "--kernels",
            kernels, "--json", *(["--policy", policy] if policy else [])]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, OMP_NUM_THREADS=str(2)))
    if proc.returncode != 0:
        return dict(error=f"exit {proc.returncode}: {(proc.stderr.strip().splitlines() or [''])[-1][-300:]}")
    stats = json.loads(proc.stdout)["stats"]
    if prompt_file:
        return dict(tok_s=stats["prompt_tokens"] / stats["ttft_s"], ttft_s=stats["ttft_s"],
                    prompt_tokens=stats["prompt_tokens"], command=" ".join(argv))
    return dict(tok_s=stats["decode_tokens_per_s"], tpot_s=stats["tpot_s"], command=" ".join(argv))


def prompt_text(tokenizer: Path, tokens: int, path: Path) -> Path:
    """`tokens` tokens of Jane Austen's Emma (data/gutenberg, shipped) as text, written to `path`: the user rows'
    prompt for the prefill setting (the harness and llama-bench take random ids)."""
    import gzip

    from tokenizers import Tokenizer

    text = gzip.open(HERE.parents[1] / "data" / "gutenberg" / "austen-emma.txt.gz", "rt").read()
    tok = Tokenizer.from_file(str(tokenizer))
    ids = tok.encode(text[20_000:20_000 + 12 * tokens]).ids
    if len(ids) < tokens:
        raise SystemExit(f"--prompt-tokens {tokens} is more than this text gives ({len(ids)})")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(tok.decode(ids[:tokens]))
    return path


def is_share(c: str) -> bool:
    """A cap: a share of the file in %, over 0 and at most 100."""
    try:
        return 0 < float(c) <= 100
    except ValueError:
        return False


def rows_of(formats: list[str], caps: list[str], ggufs: dict[str, Path], prompt_tokens: int = 512,
            batches: tuple[int, ...] = (2, 4, 8)) -> list[dict]:
    """A row per format and setting: resident, prefill (resident, prompt tokens/s of a `prompt_tokens` prompt),
    batch (resident, decode tokens/s of each of `batches` sequences decoded together), or a cap in % of the
    format's file."""
    rows = []
    for f in formats:
        size = ggufs[f].stat().st_size
        for c in caps:
            if c == BATCH:
                rows += [dict(format=f, setting=f"batch {n}", cap_bytes=None, gguf_bytes=size, batch=n)
                         for n in batches]
                continue
            if c == PREFILL:
                rows.append(dict(format=f, setting=f"prefill {prompt_tokens}", cap_bytes=None, gguf_bytes=size,
                                 prompt_tokens=prompt_tokens))
                continue
            cap = None if c == "resident" else int(size * float(c) / 100)
            rows.append(dict(format=f, setting=c if c == "resident" else f"{c}% cap", cap_bytes=cap, gguf_bytes=size))
    return rows


def summarize(rows: list[dict], runs: list[dict]) -> list[dict]:
    out = []
    for row in rows:
        mine = [r for r in runs if r["format"] == row["format"] and r["setting"] == row["setting"]]
        llama = [r["tok_s"] for r in mine if r["engine"] == "llama.cpp" and "tok_s" in r]
        base = statistics.median(llama) if llama else None
        for mode in dict.fromkeys(r["engine"] for r in mine):
            ok = [r for r in mine if r["engine"] == mode and "tok_s" in r]
            errors = [r["error"] for r in mine if r["engine"] == mode and "error" in r]
            med = statistics.median(r["tok_s"] for r in ok) if ok else None
            every = [t for r in ok for t in r.get("samples_tok_s", [r["tok_s"]])]  # each repetition of each round
            out.append(dict(row, engine=mode, tok_s=med, runs_tok_s=[r["tok_s"] for r in ok],
                            spread_tok_s=[min(every), max(every)] if every else None,
                            under_load=mark(ok) == "*", foreign_cores=[r.get("load", {}).get("foreign_cores")
                                                                        for r in ok],
                            peak_bytes=max((r.get("peak", -1) for r in ok), default=None),
                            ratio=(med / base) if med and base and mode != "llama.cpp" else None,
                            error=errors[0] if errors and not ok else None))
    return out


def spread(s: dict) -> str:
    """A row's spread over every repetition and round, min–max."""
    return f"{s['spread_tok_s'][0]:.2f}–{s['spread_tok_s'][1]:.2f}" if s.get("spread_tok_s") else ""


def table(summary: list[dict]) -> str:
    lines = [f"{'format':>7} {'setting':>10} {'engine':>19} {'tok/s':>9} {'spread':>13} {'runs':>16} {'peak GiB':>9} "
             f"{'x llama':>8}"]
    for s in summary:
        tok = (f"{s['tok_s']:.2f}" if s["tok_s"] else "—") + ("*" if s.get("under_load") else "")
        runs = ",".join(f"{t:.2f}" for t in s["runs_tok_s"])
        peak = f"{s['peak_bytes'] / 2**30:.2f}" if s["peak_bytes"] and s["peak_bytes"] > 0 else ""
        ratio = f"{s['ratio']:.2f}" if s["ratio"] else ""
        lines.append(f"{s['format']:>7} {s['setting']:>10} {s['engine']:>19} {tok:>9} {spread(s):>13} {runs:>16} "
                     f"{peak:>9} {ratio:>8}" + (f"  ({s['error'][:80]})" if s["error"] else ""))
    if any(s.get("under_load") for s in summary):
        lines.append(f"* kept although another process took over {THRESHOLD_CORES} cores during it (every rerun did)")
    return "\n".join(lines)


def markdown(summary: list[dict]) -> str:
    """The table for docs/performance.md: one row per format and setting, llama.cpp beside each moetier mode."""
    rows = list(dict.fromkeys((s["format"], s["setting"]) for s in summary))
    modes = list(dict.fromkeys(s["engine"] for s in summary if s["engine"] != "llama.cpp"))
    head = ("| format | setting | cap | llama.cpp tok/s | " + " | ".join(f"{m} tok/s (× llama.cpp)" for m in modes)
            + " |")
    lines = [head, "|" + "---|" * (4 + len(modes))]
    for fmt, setting in rows:
        mine = {s["engine"]: s for s in summary if (s["format"], s["setting"]) == (fmt, setting)}
        llama = mine.get("llama.cpp")
        cap = "—" if llama["cap_bytes"] is None else f"{llama['cap_bytes'] / 2**30:.2f} GiB"

        def cell(s):
            if s is None:
                return ""
            if s["tok_s"] is None:
                return "does not run" if s["error"] and "exit 1" in s["error"] else "killed" if s["error"] else "—"
            star = "\\*" if s.get("under_load") else ""
            return f"{s['tok_s']:.2f}{star} ({spread(s)})" + (f" **{s['ratio']:.2f}×**" if s.get("ratio") else "")

        lines.append(f"| {fmt} | {setting} | {cap} | {cell(llama)} | " + " | ".join(cell(mine.get(m)) for m in modes)
                     + " |")
    return "\n".join(lines)


def plot(summary: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    formats = list(dict.fromkeys(s["format"] for s in summary))
    fig, axes = plt.subplots(1, len(formats), figsize=(5.2 * len(formats), 4), squeeze=False)
    for ax, f in zip(axes[0], formats):
        mine = [s for s in summary if s["format"] == f]
        settings = list(dict.fromkeys(s["setting"] for s in mine))
        engines = list(dict.fromkeys(s["engine"] for s in mine))
        width = 0.8 / len(engines)
        for i, e in enumerate(engines):
            cells = [next((s for s in mine if s["setting"] == st and s["engine"] == e), None) for st in settings]
            ys = [(c["tok_s"] or 0) if c else 0 for c in cells]
            lo = [y - c["spread_tok_s"][0] if c and c.get("spread_tok_s") else 0 for y, c in zip(ys, cells)]
            hi = [c["spread_tok_s"][1] - y if c and c.get("spread_tok_s") else 0 for y, c in zip(ys, cells)]
            ax.bar([j + (i - (len(engines) - 1) / 2) * width for j in range(len(settings))], ys, width, label=e,
                   yerr=[lo, hi], capsize=2, error_kw={"linewidth": 0.8})  # (the spread: min–max of every run)
        ax.set_xticks(range(len(settings)), settings, fontsize=8)
        ax.set_title(f"{f} (GGUF {mine[0]['gguf_bytes'] / 2**30:.1f} GiB)")
        ax.legend(fontsize=7)
        if all(s.get("prompt_tokens") for s in mine):  # prefill alone: speeds within 2x of each other, from 0
            ax.set_ylabel("prompt tokens/s")
            continue
        ax.set_yscale("log")  # caps: speeds 10-100x apart
        ax.set_ylabel("tokens/s (log): decode; prompt on a prefill row" if any(
            s.get("prompt_tokens") for s in mine) else "decode tokens/s (log)")
    save_figure(fig, title, path, title_size=9)


def round_ratios(done: dict) -> dict[tuple[str, str, str], list[float]]:
    """(format, setting, moetier mode) -> each round's moetier / llama.cpp, the two run back to back: robust to a
    host whose memory speed moves between minutes, where the medians of a row may pair a fast run with a slow one."""
    by: dict[tuple, dict[str, float]] = {}
    for r in done["runs"]:
        if "tok_s" in r:
            by.setdefault((r["format"], r["setting"], r["round"]), {})[r["engine"]] = r["tok_s"]
    out: dict[tuple[str, str, str], list[float]] = {}
    for (fmt, setting, _), engines in sorted(by.items(), key=lambda kv: kv[0][2]):
        for engine, tok_s in engines.items():
            if engine != "llama.cpp" and engines.get("llama.cpp"):
                out.setdefault((fmt, setting, engine), []).append(tok_s / engines["llama.cpp"])
    return out


def speeds(done: dict) -> dict[tuple[str, str, str], dict[str, list[float]]]:
    """(format, setting, moetier mode) -> {engine: every round's tok/s}: the speeds behind round_ratios."""
    out: dict[tuple[str, str, str], dict[str, list[float]]] = {}
    modes = {(r["format"], r["setting"]): r["engine"] for r in done["runs"] if r["engine"] != "llama.cpp"}
    for r in done["runs"]:
        mode = modes.get((r["format"], r["setting"]))
        if "tok_s" in r and mode is not None:
            out.setdefault((r["format"], r["setting"], mode), {}).setdefault(r["engine"], []).append(r["tok_s"])
    return out


def plot_pairs(runs: dict[str, dict], path: Path, title: str) -> str:
    """Each run's round ratios per format and mode (dots) and their median (a bar), beside the 1.0 line; and beside
    them every run's tok/s of each engine (a host's memory states show as clusters): the PNG at `path`; returns the
    markdown table of the ratios."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ratios = {name: round_ratios(d) for name, d in runs.items()}
    keys = list(dict.fromkeys(k for r in ratios.values() for k in r))
    fig, (ax, speed_ax) = plt.subplots(1, 2, figsize=(2 * (1.6 + 1.4 * len(keys) * len(runs) ** 0.5), 4))
    plot_speeds({name: speeds(d) for name, d in runs.items()}, keys, speed_ax)
    width = 0.8 / len(runs)
    lines = ["| run | " + " | ".join(f"{f} {s}: {m}" for f, s, m in keys) + " |", "|---|" + "---|" * len(keys)]
    for i, (name, r) in enumerate(ratios.items()):
        xs = [j + (i - (len(runs) - 1) / 2) * width for j in range(len(keys))]
        meds = [statistics.median(r[k]) if k in r else 0 for k in keys]
        ax.bar(xs, meds, width * 0.9, alpha=0.45, label=name)
        for x, k in zip(xs, keys):
            ax.plot([x] * len(r.get(k, [])), r.get(k, []), "k.", markersize=4)
        lines.append(f"| {name} | " + " | ".join(
            f"{' '.join(f'{v:.2f}' for v in r[k])} (**{statistics.median(r[k]):.2f}**)" if k in r else ""
            for k in keys) + " |")
    ax.axhline(1.0, color="k", linewidth=0.8)
    ax.set_xticks(range(len(keys)), [f"{f}\n{m}" for f, _, m in keys], fontsize=8)
    ax.set_ylabel("moetier / llama.cpp, each round (dots), median (bar)")
    ax.legend(fontsize=7)
    save_figure(fig, title, path, title_size=9)
    return "\n".join(lines)


def plot_speeds(speed: dict[str, dict], keys: list[tuple[str, str, str]], ax) -> None:
    """tok/s of every run: per format and mode, a column of dots per engine and run."""
    width = 0.8 / max(1, len(speed))
    for i, by_key in enumerate(speed.values()):  # (the runs in the order of the left panel)
        for j, key in enumerate(keys):
            x = j + (i - (len(speed) - 1) / 2) * width
            for engine, colour, dx in (("llama.cpp", "tab:red", -width / 5), (key[2], "tab:blue", width / 5)):
                ys = by_key.get(key, {}).get(engine, [])
                ax.plot([x + dx] * len(ys), ys, ".", color=colour, markersize=5,
                        label=("llama.cpp" if engine == "llama.cpp" else "moetier") if i == j == 0 else None)
    ax.set_xticks(range(len(keys)), [f"{f}\n{m}" for f, _, m in keys], fontsize=8)
    ax.set_ylabel("tok/s of each run (runs side by side)")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default="bf16,q8_0,q4_k_m")
    ap.add_argument("--caps", default="resident,100,60,35,20",
                    help="resident; prefill (resident, prompt tokens/s of a --prompt-tokens prompt: llama-bench's pp "
                         "test); and caps in %% of the format's file")
    ap.add_argument("--prompt-tokens", type=int, default=512, help="the prefill rows' prompt (llama-bench -p)")
    ap.add_argument("--batch", default="2,4,8", help="the batch rows' sequences decoded together (llama-batched-"
                                                     "bench's -npl), each with a 16-token prompt")
    ap.add_argument("--modes", default="", help="only these moetier modes (e.g. native,int4)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32, help="measured tokens (resident); caps measure --cap-tokens")
    ap.add_argument("--cap-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repetitions", type=int, default=3, help="llama-bench's -r: every one kept, the first "
                                                                   "(warming a mapped file) left out of the median")
    ap.add_argument("--policy", help="moetier's eviction policy (`moetier generate --policy`; default: moetier's)")
    ap.add_argument("--kernels", default="auto", help="moetier's kernel path (`moetier generate --kernels`): avx2 "
                                                     "measures the AVX2 path on a CPU that has more, beside "
                                                     "llama.cpp's AVX2 build (built once)")
    ap.add_argument("--user-command", action=argparse.BooleanOptionalAction, default=True,
                    help="also run each moetier mode resident as a user runs it (`moetier generate --preload`)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds a run may take before it counts as failed")
    ap.add_argument("--out", type=Path, default=HERE.parent / "out" / "peers")
    ap.add_argument("--report", type=Path, nargs="+",
                    help="only render the table, markdown and plot of compare.json files (one table) into --out")
    ap.add_argument("--pairs", type=Path, nargs="+",
                    help="only plot each round's ratio (the engines back to back) of compare.json files, a run each, "
                         "into --out (pairs.png, pairs.md)")
    args = ap.parse_args()
    if args.policy:
        from moetier.cache.policies import check_policy
        from moetier.errors import MoetierError

        try:
            check_policy(args.policy, live=True)
        except MoetierError as e:  # (one line, before anything runs)
            sys.exit(f"compare.py: error: {e}")
    if args.pairs:
        done = {path.parent.name: json.loads(path.read_text()) for path in args.pairs}
        meta = next(iter(done.values()))["meta"]
        args.out.mkdir(parents=True, exist_ok=True)
        md = plot_pairs(done, args.out / "pairs.png", f"each round's moetier / llama.cpp, same weights, "
                                                       f"{meta['threads']} threads, {meta['cpu']['model']}")
        (args.out / "pairs.md").write_text(md + "\n")
        print(md)
        print(f"wrote {args.out / 'pairs.md'} and {args.out / 'pairs.png'}")
        return
    if args.report:  # several runs' results (the resident rows of one, the caps of another) in one table
        done = [json.loads(path.read_text()) for path in args.report]
        rows: dict[tuple[str, str], list[dict]] = {}  # a row a later run measured again is taken from that run
        for d in done:
            for key in dict.fromkeys((s["format"], s["setting"]) for s in d["summary"]):
                rows[key] = [s for s in d["summary"] if (s["format"], s["setting"]) == key]
        order = {f: i for i, f in enumerate(MODES)}
        keys = sorted(rows, key=lambda k: (order.get(k[0], len(order)), k[1] != "resident"))
        summary = [s for key in keys for s in rows[key]]
        print(table(summary))
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "compare.md").write_text(markdown(summary) + "\n")
        meta = done[0]["meta"]
        plot(summary, args.out / "compare.png",
             f"{title_model(summary)}, same weights, {meta['threads']} threads, {meta['cpu']['model']}")
        print(f"wrote {args.out / 'compare.md'} and {args.out / 'compare.png'}")
        return
    formats = [f for f in args.formats.split(",") if f]
    if unknown := [f for f in formats if f not in MODES]:
        raise SystemExit(f"unknown format(s) {unknown}; known: {', '.join(MODES)}")
    caps = [c for c in args.caps.split(",") if c]
    if bad := [c for c in caps if c not in ("resident", PREFILL, BATCH) and not is_share(c)]:
        raise SystemExit(f"compare.py: error: unknown setting(s) {bad} in --caps; known: resident, {PREFILL}, "
                         f"{BATCH}, and shares of the file in %, over 0 and at most 100 (e.g. 60)")
    if args.prompt_tokens < 1:
        raise SystemExit("compare.py: error: --prompt-tokens must be at least 1")
    try:
        batches = tuple(int(n) for n in args.batch.split(",") if n)
    except ValueError:
        batches = ()
    if not batches or min(batches) < 1:
        raise SystemExit(f"compare.py: error: --batch takes sequence counts of at least 1, e.g. 2,4,8 (got "
                         f"{args.batch!r})")
    if any(c not in ("resident", PREFILL, BATCH) for c in caps):
        cage = make_cage(1 << 30, "moetier-peer-probe")
        if isinstance(cage, str):
            print(f"skipping the caps: {cage}", file=sys.stderr)
            caps = [c for c in caps if c in ("resident", PREFILL, BATCH)]
        else:
            cage.remove()
    if args.modes:
        keep = set(args.modes.split(","))
        for f in MODES:
            MODES[f] = [m for m in MODES[f] if m[0] in keep]
    sys.path.insert(0, str(HERE.parent))
    from bench_offload import SYNTH, store_of

    store = store_of(SYNTH) if any(f not in GPT_OSS for f in formats) else None  # (13 GB: only if run)
    # the AVX2 row: both engines held to AVX2 (llama.cpp's AVX2 build beside moetier's AVX2 kernels)
    llama = build(default_cache_dir(), isa="avx2" if args.kernels == "avx2" else "native")
    ggufs = prepare(formats, llama, default_cache_dir() / "peers" / "models", store)
    index = indexed(ggufs)
    rows = rows_of(formats, caps, ggufs, args.prompt_tokens, batches)
    tokenizer = store / "tokenizer.json" if store else HERE.parents[1] / "models" / "demo-coarse" / "tokenizer.json"
    prompt_file = (prompt_text(tokenizer, args.prompt_tokens, args.out / "prompt.txt")
                   if PREFILL in caps and args.user_command else None)
    runs = []
    def engines_of(row: dict) -> list[str]:
        modes = [m[0] for m in MODES[row["format"]]]
        users = [m + USER for m in modes] if (row["cap_bytes"] is None and args.user_command
                                              and "batch" not in row) else []  # (`generate` runs one sequence)
        return ["llama.cpp", *modes, *users]

    jobs = [(row, e) for row in rows for e in engines_of(row)]
    print(f"{len(jobs) * args.rounds} runs; load {os.getloadavg()[0]:.2f}", flush=True)
    for rnd in range(args.rounds):
        for row in rows:
            engines = engines_of(row)
            engines = engines[rnd % len(engines):] + engines[:rnd % len(engines)]  # the order turns each round
            for engine in engines:
                capped = row["cap_bytes"] is not None
                tokens = args.cap_tokens if capped else args.tokens
                probe = probe_rate()
                t0 = time.perf_counter()
                mode = next((m for m in MODES[row["format"]] if m[0] == engine.removesuffix(USER)), None)
                model = ggufs[row["format"]] if mode and mode[0] == SAME_FILE else store
                prompt = row.get("prompt_tokens", 0)
                if engine == "llama.cpp" and "batch" in row:
                    run = partial(llama_batched_run, llama, ggufs[row["format"]], row["batch"], tokens, args.threads,
                                  args.timeout)
                elif engine == "llama.cpp":
                    run = partial(llama_run, llama, ggufs[row["format"]], row["cap_bytes"], tokens, args.threads,
                                  args.timeout, args.repetitions, prompt)
                elif engine.endswith(USER):
                    run = partial(user_run, model, mode, tokens, args.timeout, args.kernels,
                                  prompt_file if prompt else None, args.policy)
                else:
                    run = partial(moetier_run, model, mode, row["cap_bytes"], tokens, args.timeout, args.kernels,
                                  prompt, args.repetitions, row.get("batch", 1), args.policy)
                # each attempt from a cold page cache (a rerun found the first attempt's pages) — resident runs too:
                # a file's pages left cached by the run before took the memory a resident engine then loads into
                # (the 12 GB gpt-oss file on a 23 GB host: moetier 8.5 tok/s beside the cached file, 11.2 without,
                # its weights then 97% in huge pages), so every run starts from the same host
                run = partial(cold, run, [p for p in (ggufs[row["format"]], store, *index.values()) if p])
                # waited for an idle machine, measured beside the other processes' CPU, run again under it
                r = measured(run)
                runs.append(dict(row, engine=engine, round=rnd, wall_s=time.perf_counter() - t0,
                                 probe_before_gb_s=probe, **r))
                shown = (f"{r['tok_s']:.2f} {'prompt ' if prompt else ''}tok/s" if "tok_s" in r else
                         r["error"][:120])
                shown += f"  (memory {probe:.1f} GB/s before" + (
                    f", {r['probe_in_gb_s']:.1f} in moetier's process)" if r.get("probe_in_gb_s") else ")")
                if r.get("huge_page_share") is not None:
                    shown += f"  {r['huge_page_share']:.0%} in huge pages"
                load = r["load"]
                shown += f"  other processes {load['foreign_cores']:.2f} cores" + (
                    f" (kept after {load['reruns']} reruns: MARKED)" if load["under_load"] else
                    f" ({load['reruns']} reruns)" if load["reruns"] else "")
                print(f"round {rnd + 1} {row['format']:>7} {row['setting']:>9} {engine:>19}: {shown}", flush=True)
                args.out.mkdir(parents=True, exist_ok=True)  # every run so far, should a long comparison stop
                (args.out / "runs.partial.json").write_text(json.dumps(runs, indent=1))
    summary = summarize(rows, runs)
    print(table(summary))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "compare.md").write_text(markdown(summary) + "\n")
    meta = dict(cpu=cpu_description(), llama_cpp=llama.version(), threads=args.threads, tokens=args.tokens,
                cap_tokens=args.cap_tokens, prompt_tokens=args.prompt_tokens, batches=list(batches), rounds=args.rounds, repetitions=args.repetitions,
                load_threshold_cores=THRESHOLD_CORES, kernels=args.kernels, policy=args.policy, llama_cpp_build=llama.isa,
                date=time.strftime("%Y-%m-%d"))
    (args.out / "compare.json").write_text(json.dumps(dict(meta=meta, summary=summary, runs=runs), indent=1))
    plot(summary, args.out / "compare.png",
         f"{title_model(summary)}, same weights, {args.threads} threads, {meta['cpu']['model']}")
    (args.out / "runs.partial.json").unlink(missing_ok=True)
    print(f"wrote {args.out / 'compare.json'} and {args.out / 'compare.png'}")


if __name__ == "__main__":
    main()
