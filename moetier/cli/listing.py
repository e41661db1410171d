"""`moetier list models|families|policies|predictors|profiles|shapes`: what the other commands accept by name."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from moetier.cli.defaults import command

ABBREVIATIONS = ("Eq", "Eqs", "Fig", "Alg", "Sec", "al", "vs", "e.g", "i.e", "cf")  # a full stop that ends no sentence


def _summary(doc: str | None, width: int = 80) -> str:
    """A module docstring's opening phrase: up to its first colon, dash or full stop outside parentheses (not the
    stop of an abbreviation, `Eq. 3`), at most `width` characters, cut at a word."""
    text = " ".join((doc or "").split())
    depth = 0
    for i, c in enumerate(text):
        depth += (c == "(") - (c == ")")
        if depth == 0 and (text.startswith((": ", " — "), i) or (text.startswith(". ", i) and not text[:i].endswith(
                ABBREVIATIONS))):
            text = text[:i]
            break
    text = text.removesuffix(".")
    if len(text) <= width:
        return text
    cut = text[:width - 1].rsplit(" ", 1)[0]
    if cut.count("(") > cut.count(")"):  # never end inside a parenthesis: drop it whole
        cut = cut[:cut.rfind("(")].rstrip(" ,")
    return cut + "…"


def _models(args: argparse.Namespace) -> list[tuple[str, str]]:
    from moetier.errors import StoreError
    from moetier.paths import default_cache_dir
    from moetier.resolve import builtin_models, inflated_builtins
    from moetier.store.checkpoint import read_config
    from moetier.store.format import Manifest, is_store

    rows = []
    for name, path in builtin_models().items():
        cfg = read_config(path)
        experts = cfg.get("num_experts") or cfg.get("num_local_experts")
        rows.append((name, f"built-in {cfg.get('model_type')}, {cfg.get('num_hidden_layers')} layers, top-"
                           f"{cfg.get('num_experts_per_tok')} of {experts} experts ({path})"))
    for name, base in inflated_builtins().items():
        rows.append((name, f"built-in: {base} with its experts inflated to OLMoE's 12 MiB (same tokens; built into "
                           f"the cache on first use)"))
    cache = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
    for path in sorted(p for p in cache.iterdir() if p.is_dir() and is_store(p)) if cache.is_dir() else []:
        try:
            m = Manifest.load(path)
            made = f"inflated from {m.config['moetier_inflated']['from']}" if "moetier_inflated" in m.config else \
                f"converted from {m.source}"
            rows.append((str(path), made))
        except StoreError as e:  # a damaged conversion is listed as such, not hidden
            rows.append((str(path), f"damaged conversion ({str(e).splitlines()[0]})"))
    return rows


def _policies(_: argparse.Namespace) -> list[tuple[str, str]]:
    from moetier.cache.policies import LEARNED, OFFLINE, POLICIES, SUFFIX
    from moetier.cache.policies.predicted import PredictedPolicy

    rows = []
    for name, cls in POLICIES.items():
        tags = ["offline: sim and cache-bench only"] if name in OFFLINE else []
        tags += ["learned: needs its file from `moetier train cache-policy`"] if name in LEARNED else []
        doc = _summary(sys.modules[cls.__module__].__doc__)
        rows.append((name, doc + (f" [{'; '.join(tags)}]" if tags else "")))
    rows.append((f"NAME{SUFFIX}", f"{_summary(sys.modules[PredictedPolicy.__module__].__doc__.split(': ', 1)[-1])} "
                                  "[needs --predictor]"))
    return rows


def _predictors(_: argparse.Namespace) -> list[tuple[str, str]]:
    from moetier.predict import BUILT_ON, PREDICTORS

    return [(name, f"{_summary(sys.modules[cls.__module__].__doc__.split(': ', 1)[-1])} [built on {BUILT_ON[name][0]}]")
            for name, cls in PREDICTORS.items()]


def _profiles(args: argparse.Namespace) -> list[tuple[str, str]]:
    """With --verbose, each profile's sources under it: where every figure comes from, and what is assumed."""
    from moetier.sim.profile import HardwareProfile, ProfileError, known_profiles

    rows = []
    for name in known_profiles():
        try:
            profile = HardwareProfile.load(name)
        except ProfileError as e:
            rows.append((name, f"unreadable ({str(e).splitlines()[0]})"))
            continue
        rows.append((name, profile.description))
        if getattr(args, "verbose", False):
            rows += [("", f"- {source}") for source in profile.sources]
    return rows


def _families(_: argparse.Namespace) -> list[tuple[str, str]]:
    from moetier.model.families import FAMILIES, REFUSED
    from moetier.store.gguf_file import ARCHES

    gguf = {t: arch for arch, spec in ARCHES.items() for t in spec.model_types}  # llama.cpp's names, where a GGUF runs
    rows = [(name, " ".join((type(f).__doc__ or "").split())
             + (f" GGUF arch: {gguf[name]}{' (with experts)' if gguf[name] == 'llama' else ''}." if name in gguf
                else "")) for name, f in FAMILIES.items()]
    return rows + [(name, f"refused: {_summary(why, 100)}") for name, why in REFUSED.items()]


def _shapes(_: argparse.Namespace) -> list[tuple[str, str]]:
    from moetier.resolve import builtin_names
    from moetier.sim.shapes import SHAPES

    rows = [(s.name, f"{len(s.moe_layers)} MoE layers, top-{s.top_k} of {s.num_experts} experts of "
                     f"{s.expert_bytes() / 2**20:.1f} MiB ({s.precision})") for s in SHAPES.values()]
    return rows + [(name, "built-in model (its shape is read from its config.json)") for name in builtin_names()]


KINDS = {"models": _models, "families": _families, "policies": _policies, "predictors": _predictors, "profiles": _profiles,
         "shapes": _shapes}
EMPTY = {"predictors": "no predictors yet: next-layer expert prediction arrives with prefetching",
         "models": "no models"}


def _list(args: argparse.Namespace) -> None:
    rows = KINDS[args.kind](args)
    if not rows:
        print(EMPTY.get(args.kind, f"no {args.kind}"))
        return
    width = min(max(len(name) for name, _ in rows), 40)
    for name, about in rows:
        print(f"{name:<{width}}  {about}")


def add_parser(sub) -> None:
    ls = command(sub, "list", "what the other commands accept by name: models, model families (config.json's "
                              "model_type), policies, predictors, profiles, model shapes")
    ls.add_argument("kind", choices=list(KINDS), help="what to list")
    ls.add_argument("--verbose", action="store_true", help="profiles: each one's sources and assumptions")
    ls.add_argument("--cache-dir", help="models: also list conversions here (default: $MOETIER_CACHE or "
                                        "~/.cache/moetier)")
    ls.set_defaults(func=_list)
