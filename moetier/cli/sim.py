"""`moetier calibrate` and `moetier sim`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from moetier.cache.policies import POLICIES
from moetier.cli.defaults import DEFAULT_MODEL
from moetier.errors import MoetierError


def _calibrate(args: argparse.Namespace) -> None:
    from moetier.resolve import resolve_model
    from moetier.sim.calibrate import USER_PROFILES, calibrate
    from moetier.store.store import Store

    profile = calibrate(Store(resolve_model(args.model, args.cache_dir)), args.name, args.reader_threads)
    USER_PROFILES.mkdir(parents=True, exist_ok=True)
    path = Path(args.out) if args.out else USER_PROFILES / f"{args.name}.json"
    profile.save(path)
    print(f"wrote {path}: read {profile.link.bandwidth_bytes_per_s / 1e9:.2f} GB/s; expert "
          f"{profile.expert_compute(1) * 1e3:.3f} ms at 1 token (+{profile.expert_compute.per_token * 1e6:.1f} us "
          f"per token); dense {profile.dense_s_per_layer(1) * 1e3:.3f} ms per layer")


def _sim(args: argparse.Namespace) -> None:
    from moetier.cache.policies import make_policy
    from moetier.config import MemoryBudget
    from moetier.resolve import resolve_model
    from moetier.sim.profile import HardwareProfile
    from moetier.sim.replay import replay
    from moetier.sim.timing import simulate
    from moetier.store.store import Store
    from moetier.trace.format import Trace

    trace = Trace.load(args.trace)
    profile = HardwareProfile.load(args.profile)
    store = Store(resolve_model(args.model, args.cache_dir))
    if (store.spec.num_experts, store.spec.top_k) != (trace.num_experts, trace.top_k):
        raise MoetierError(f"the trace routes top-{trace.top_k} of {trace.num_experts} experts; {args.model} has "
                           f"top-{store.spec.top_k} of {store.spec.num_experts}")
    expert_bytes = store.native_layout.blob_bytes
    total = len(trace.layers) * trace.num_experts * expert_bytes  # a share is of the layers the trace covers
    slots = min(len(trace.layers) * trace.num_experts,
                MemoryBudget.parse(args.expert_memory).resolve(total, profile.fast_tier_bytes) // expert_bytes)
    if slots < trace.top_k:
        raise MoetierError(f"expert memory {args.expert_memory} holds {slots} experts; top-{trace.top_k} needs more")
    replayed = replay(trace, make_policy(args.policy), slots, preload=args.preload)
    result = simulate(trace, replayed, profile, expert_bytes, timeline_steps=(args.timeline_step,))
    summary = result.summary()
    summary.update(profile=profile.name, policy=args.policy, slots=slots)
    if args.timeline and result.timelines:
        from moetier.sim.timing import plot_timeline

        step, timeline = next(iter(result.timelines.items()))
        plot_timeline(timeline, args.timeline,
                      f"{trace.model} on {profile.name}, {args.policy}, {args.expert_memory}: step {step}")
        summary["timeline_plot"] = args.timeline
    print(json.dumps(summary, indent=1))


def add_parser(sub) -> None:
    cal = sub.add_parser("calibrate", help="measure this machine into the `this-machine` hardware profile")
    cal.add_argument("--model", default=DEFAULT_MODEL, help="the model whose expert shape to measure")
    cal.add_argument("--name", default="this-machine")
    cal.add_argument("--out", help="profile path (default ~/.cache/moetier/profiles/NAME.json)")
    cal.add_argument("--cache-dir")
    cal.add_argument("--reader-threads", type=int, default=4)
    cal.set_defaults(func=_calibrate)

    sm = sub.add_parser("sim", help="simulate a trace on a hardware profile with a policy and a budget")
    sm.add_argument("--trace", required=True)
    sm.add_argument("--profile", default="this-machine", help="a profile name or a JSON path")
    sm.add_argument("--model", default=DEFAULT_MODEL, help="the model whose shape the trace has")
    sm.add_argument("--policy", default="lru", choices=sorted(POLICIES))
    sm.add_argument("--expert-memory", default="30%")
    sm.add_argument("--preload", action="store_true", help="start with the cache filled, as Engine.preload")
    sm.add_argument("--cache-dir")
    sm.add_argument("--timeline", help="PNG path: per-layer reads and compute of one step")
    sm.add_argument("--timeline-step", type=int, default=-1, help="which step (default: the last)")
    sm.set_defaults(func=_sim)
