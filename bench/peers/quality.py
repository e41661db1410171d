"""Quality beside speed: what each 8- and 4-bit format costs in llama.cpp and in moetier, on the same trained model
(demo-deep, converted to GGUF by llama.cpp's own converter) and the same held-out text (the demo models' held-out
prose and code, train/corpus.py).

Each engine is measured against its own bf16 run, by its own tool: llama.cpp's `llama-perplexity` (chunks of
--ctx tokens, the second half of each scored; KL divergence and top-1 agreement against the bf16 model's saved
logits), and `moetier eval` (windows of --ctx tokens after a 16-token prefill, scored token by token as decoding
feeds them; KL and top-1 against exact mode). The two tools score different positions of the text, so their
perplexities differ in level; what compares is each format's change from its engine's bf16.

    moetier: int8 experts + --dense-precision int8   against   llama.cpp Q8_0
             int4 experts + --dense-precision int4   against   llama.cpp Q4_K_M (demo-deep's 64-wide down_proj
             has no whole 256-blocks: llama-quantize falls back for it, as it does for any such model)

    python bench/peers/quality.py [--model models/demo-deep] [--ctx 128] [--chunks 48] [--windows 8]

`--same-file`: moetier scores each GGUF itself (`--model FILE.gguf`) as llama-perplexity scores it — the text
tokenized by the file's tokenizer, consecutive chunks of --ctx tokens (the first a BOS where the file says to add
one), the second half of each scored (tokens n/2 + 1 .. n - 1, each from the logits before it) — so the two tools'
perplexities are one measure of one file, compared directly.

Writes OUT/quality.json and prints the table.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1])]
from llamacpp import build  # noqa: E402

from moetier.paths import default_cache_dir  # noqa: E402

PAIRS = (("bf16", "native", "native"), ("q8_0", "int8", "int8"), ("q4_k_m", "int4", "int4"))


def held_out_text() -> str:
    sys.path.insert(0, str(HERE.parents[1]))
    from train.corpus import load

    corpus = load()
    return corpus["prose_valid"] + "\n\n" + corpus["code_valid"]


def untied(model: Path, out: Path) -> Path:
    """The checkpoint with its head written out: demo-deep ties lm_head to the embedding, which llama.cpp's OLMoE
    loader does not (it wants `output.weight`). Same weights; made once, under a temporary name."""
    if (out / "config.json").exists():
        return out
    import shutil

    from safetensors.torch import load_file, save_file

    config = json.loads((model / "config.json").read_text())
    if not config.get("tie_word_embeddings"):
        return model
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors = load_file(model / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
    for f in model.iterdir():
        if f.is_file() and f.suffix == ".json" and f.name != "config.json":
            shutil.copy(f, tmp / f.name)
    (tmp / "config.json").write_text(json.dumps(dict(config, tie_word_embeddings=False), indent=1))
    tmp.rename(out)
    return out


def llama_perplexity(llama, gguf: Path, text: Path, ctx: int, chunks: int, base: Path, first: bool) -> dict:
    argv = llama.perplexity_argv(gguf, text, ctx, chunks, threads=2, kl_base=base, kl=not first)
    out = subprocess.run(argv, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"llama-perplexity failed on {gguf.name}:\n{out.stderr[-2000:]}")
    log = out.stdout + out.stderr
    row = {}
    m = re.search(r"Final estimate: PPL = ([\d.]+)", log) or re.search(r"Mean PPL\(Q\)\s*:\s*([\d.]+)", log)
    row["perplexity"] = float(m.group(1)) if m else None
    if not first:
        kl = re.search(r"Mean\s+KLD:\s*([\d.]+)", log)
        top = re.search(r"Same top p:\s*([\d.]+)", log)
        row["kl"] = float(kl.group(1)) if kl else None
        row["top1_agreement"] = float(top.group(1)) / 100 if top else None
    return row


def moetier_eval(model: str, precision: str, dense: str, text: Path, ctx: int, windows: int) -> dict:
    argv = ["moetier", "eval", "--model", model, "--expert-memory", "100%", "--text", f"held-out={text}",
            "--window", str(ctx), "--windows", str(windows), "--precision", precision, "--dense-precision", dense,
            "--json"]
    out = subprocess.run(argv, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"moetier eval failed:\n{out.stderr[-2000:]}")
    rows = json.loads(out.stdout)["rows"]
    exact, mine = rows[0], rows[-1]
    return dict(exact_perplexity=exact["domains"][0]["perplexity"], perplexity=mine["domains"][0]["perplexity"],
                kl=mine.get("kl"), top1_agreement=mine.get("top1_agreement"))


def moetier_like_llama(gguf: Path | str, text: Path, ctx: int, chunks: int, reference: list | None = None,
                       **config) -> dict:
    """moetier's perplexity of `gguf` (or any model, with engine `config`: our own copies) on `text` by
    llama-perplexity's method (above), teacher-forced in the engine: a prefill of each chunk's first half and one
    token, then a decode step per token. `reference`: another run's `logps` (the bf16 file's): the mean KL from it
    and the share of positions whose most likely token is its, as llama-perplexity's --kl-divergence reports."""
    import math

    import torch

    from moetier import Engine
    from moetier.engine.score import teacher_forced

    with Engine.from_pretrained(gguf, expert_memory="100%", progress=False, **config) as engine:
        tok = engine.tokenizer
        ids = tok.encode(text.read_text())  # (what the tokenizer adds, as llama.cpp's add_bos)
        n = min(chunks, len(ids) // ctx)
        bos = engine.spec.bos_token_id if tok.add_bos else None
        rows = [ids[i * ctx:(i + 1) * ctx] for i in range(n)]
        if bos is not None:
            rows = [[bos, *row[1:]] for row in rows]
        nll, count, kl, same, logps = 0.0, 0, 0.0, 0, []
        for j, row in enumerate(rows):
            logp, _ = teacher_forced(engine, row, ctx // 2 + 1)  # [ctx/2 - 1, V]
            targets = torch.tensor(row[ctx // 2 + 1:])
            nll -= logp.gather(1, targets[:, None]).sum().item()
            count += len(targets)
            logps.append(logp)
            if reference is not None:
                ref = reference[j]
                kl += float((ref.exp() * (ref - logp)).sum())
                same += int((ref.argmax(1) == logp.argmax(1)).sum())
    out = dict(perplexity=math.exp(nll / count), chunks=n, tokens=len(ids), scored=count, logps=logps)
    if reference is not None:
        out.update(kl=kl / count, top1_agreement=same / count)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(HERE.parents[1] / "models" / "demo-deep"))
    ap.add_argument("--ctx", type=int, default=128, help="tokens a chunk (llama.cpp) or a window (moetier)")
    ap.add_argument("--chunks", type=int, default=48, help="chunks scored by llama-perplexity")
    ap.add_argument("--windows", type=int, default=8, help="windows scored by moetier eval (each ~12 s here)")
    ap.add_argument("--out", type=Path, default=HERE.parent / "out" / "peers")
    ap.add_argument("--same-file", action="store_true", help="moetier scores each GGUF as llama-perplexity does")
    ap.add_argument("--llama-build", choices=("native", "avx2"), default="native",
                    help="llama.cpp's build (on a Sapphire Rapids-class Xeon the native build's llama-perplexity "
                         "crashed on demo-deep's Q8_0 file; its AVX2 build ran it)")
    ap.add_argument("--own-copies", action="store_true",
                    help="with --same-file: also score --model with our own q8_0 and q4_k_m copies (experts and "
                         "dense), the same way, beside llama.cpp's files of the same weights")
    ap.add_argument("--gguf", action="append", default=[], metavar="FORMAT=FILE",
                    help="with --same-file: score these files (e.g. q4_k_m=olmoe-1b-7b-synth-q4_k_m.gguf, bf16 first "
                         "for KL) instead of converting --model")
    args = ap.parse_args()
    llama = build(default_cache_dir(), isa=args.llama_build)
    if args.gguf:
        if not args.same_file:
            raise SystemExit("--gguf scores the files themselves: give --same-file")
        ggufs = {f: Path(p) for f, p in (g.split("=", 1) for g in args.gguf)}
    else:
        work = default_cache_dir() / "peers" / "models"
        work.mkdir(parents=True, exist_ok=True)
        name = Path(args.model).name
        bf16 = llama.convert(untied(Path(args.model), work / f"{name}-untied"), work / f"{name}-bf16.gguf")
        ggufs = {"bf16": bf16, **{f: llama.quantize(bf16, work / f"{name}-{f}.gguf", f) for f, _, _ in PAIRS[1:]}}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        text = Path(tmp) / "held-out.txt"
        text.write_text(held_out_text())
        base, reference = Path(tmp) / "bf16.kld", None
        for fmt, precision, dense in [p for p in PAIRS if p[0] in ggufs]:
            theirs = llama_perplexity(llama, ggufs[fmt], text, args.ctx, args.chunks, base,
                                      first=fmt == "bf16" or "bf16" not in ggufs)
            if args.same_file:
                ours = moetier_like_llama(ggufs[fmt], text, args.ctx, args.chunks, reference)
                reference = ours.pop("logps") if reference is None else reference  # (the first file's: bf16)
                ours.pop("logps", None)
                precision, dense = "the file", "the file"
                ours["exact_perplexity"] = rows[0]["moetier_run"]["perplexity"] if rows else ours["perplexity"]
                ours["vs_llama_cpp"] = ours["perplexity"] / theirs["perplexity"] - 1 if theirs["perplexity"] else None
                ours.setdefault("kl", None)
                ours.setdefault("top1_agreement", None)
            else:
                ours = moetier_eval(args.model, precision, dense, text, args.ctx, args.windows)
            rows.append(dict(format=fmt, moetier=f"{precision} (dense {dense})", llama_cpp=theirs, moetier_run=ours,
                             gguf_bytes=ggufs[fmt].stat().st_size))
            print(f"{fmt}: llama.cpp {theirs}; moetier {ours}", flush=True)
    base_l = rows[0]["llama_cpp"]["perplexity"]  # (the first format's: bf16 where it ran)
    print(f"{'format':>7} {'llama.cpp ppl':>14} {'change':>7} {'KL':>7} {'top-1':>6} | {'moetier':>18} {'ppl':>7} "
          f"{'change':>7} {'KL':>7} {'top-1':>6}")
    for r in rows:
        t, o = r["llama_cpp"], r["moetier_run"]
        fmt_kl = lambda v: f"{v:7.4f}" if v is not None else f"{'—':>7}"  # noqa: E731
        fmt_top = lambda v: f"{v:6.1%}" if v is not None else f"{'—':>6}"  # noqa: E731
        print(f"{r['format']:>7} {t['perplexity']:14.3f} {t['perplexity'] / base_l - 1:+7.2%} {fmt_kl(t.get('kl'))} "
              f"{fmt_top(t.get('top1_agreement'))} | {r['moetier']:>18} {o['perplexity']:7.3f} "
              f"{o['perplexity'] / o['exact_perplexity'] - 1:+7.2%} "
              f"{fmt_kl(o['kl'] if r['format'] != 'bf16' else None)} "
              f"{fmt_top(o['top1_agreement'] if r['format'] != 'bf16' else None)}")
    if args.own_copies:
        from moetier.plan.precision import MixedPrecision

        with tempfile.TemporaryDirectory() as tmp:
            text = Path(tmp) / "held-out.txt"
            text.write_text(held_out_text())
            exact = moetier_like_llama(args.model, text, args.ctx, args.chunks)
            logps = exact.pop("logps")
            for fmt in ("q8_0", "q4_k_m"):
                own = moetier_like_llama(args.model, text, args.ctx, args.chunks, logps, precision=MixedPrecision(fmt),
                                         dense_precision=fmt)
                own.pop("logps")
                llama_row = next(r for r in rows if r["format"] == fmt)["llama_cpp"]
                change, theirs = own["perplexity"] / exact["perplexity"] - 1, llama_row["perplexity"] / base_l - 1
                rows.append(dict(format=f"own {fmt}", own=own, exact=exact, change=change, llama_change=theirs))
                print(f"our own {fmt} copies of {Path(args.model).name}: perplexity {own['perplexity']:.4f}, "
                      f"{change:+.2%} from our bf16 ({exact['perplexity']:.4f}), KL {own['kl']:.4f}, top-1 "
                      f"{own['top1_agreement']:.1%}; llama.cpp's {fmt.upper()} file {theirs:+.2%} from its bf16 file, "
                      f"KL {llama_row.get('kl')}, top-1 {llama_row.get('top1_agreement')} (the same {own['scored']} "
                      f"tokens)")
    if args.same_file:
        for r in [r for r in rows if "moetier_run" in r]:
            o = r["moetier_run"]
            print(f"{r['format']:>7}: moetier {o['perplexity']:.4f} against llama-perplexity "
                  f"{r['llama_cpp']['perplexity']:.4f} on the same file, {o['vs_llama_cpp']:+.2%} ({o['chunks']} "
                  f"chunks of {args.ctx}, {o['scored']} tokens scored)")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "quality.json").write_text(json.dumps(dict(model=args.model, ctx=args.ctx, rows=rows), indent=1))
    print(f"wrote {args.out / 'quality.json'}")


if __name__ == "__main__":
    main()
