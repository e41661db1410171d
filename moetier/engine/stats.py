"""Statistics exactly as DESIGN.md defines them. Counting is a few integer additions per layer; timing is one
clock read per step; percentiles are computed once, at the end."""

from __future__ import annotations

import resource
import sys
from dataclasses import asdict, dataclass, field

import numpy as np

from moetier.plan.counters import PhaseCounters, predictor_recall, prefetch_summary


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    ttft_s: float = 0.0
    decode_step_s: list[float] = field(default_factory=list)  # one entry per decode step
    decode_tokens: int = 0  # tokens produced by decode steps (first tokens come from prefill)
    phases: tuple[PhaseCounters, PhaseCounters] = field(default_factory=lambda: (PhaseCounters(), PhaseCounters()))
    expert_cache_bytes: int = 0
    expert_slots: int = 0
    total_expert_bytes: int = 0
    stopped_at_context: list[int] = field(default_factory=list)  # sequences the context window cut short
    drafted: int = 0  # speculation: tokens drafted, kept, and the steps that verified them
    accepted: int = 0
    verify_steps: int = 0

    def summary(self) -> dict:
        pre, dec = self.phases
        steps = np.asarray(self.decode_step_s, dtype=np.float64)
        needed, hits = pre.needed + dec.needed, pre.hits + dec.hits
        total_s = self.ttft_s + float(steps.sum())
        return {
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "ttft_s": self.ttft_s,
            "tpot_s": float(steps.mean()) if len(steps) else None,
            "tpot_p50_s": float(np.percentile(steps, 50)) if len(steps) else None,
            "tpot_p90_s": float(np.percentile(steps, 90)) if len(steps) else None,
            "tokens_per_s": self.new_tokens / total_s if total_s > 0 else None,
            "decode_tokens_per_s": self.decode_tokens / float(steps.sum()) if len(steps) and steps.sum() > 0 else None,
            "hit_rate": hits / needed if needed else None,
            "decode_hit_rate": dec.hits / dec.needed if dec.needed else None,
            "expert_bytes_read": pre.bytes_read + dec.bytes_read,
            "expert_bytes_per_token": dec.bytes_read / self.decode_tokens if self.decode_tokens else None,
            "prefill_expert_bytes_read": pre.bytes_read,
            "prefetches": prefetch_summary(self.phases),
            "predictor_recall": predictor_recall(dec),  # decode steps, one MoE layer ahead
            "expert_cache_bytes": self.expert_cache_bytes,
            "expert_slots": self.expert_slots,
            "total_expert_bytes": self.total_expert_bytes,
            "peak_rss_bytes": peak_rss_bytes(),
            "stopped_at_context": sorted(self.stopped_at_context),
            "speculation": {"drafted": self.drafted, "accepted": self.accepted, "verify_steps": self.verify_steps,
                            "acceptance": self.accepted / self.drafted if self.drafted else None},
            "prefill": asdict(pre),
            "decode": asdict(dec),
        }


def peak_rss_bytes() -> int:
    """This process's peak resident memory: Linux's VmHWM, the high-water mark of its own address space.
    (getrusage's ru_maxrss survives exec: a moetier started by a 400 MiB Python process reported 405 MiB where it
    had used 277.)"""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # (macOS reports bytes, Linux KiB)


def format_summary(s: dict) -> str:
    def ms(v):
        return "n/a" if v is None else f"{v * 1e3:.1f} ms"

    def pct(v):
        return "n/a" if v is None else f"{v:.1%}"

    def rate(v):
        return "n/a" if v is None else f"{v:.2f}"

    per_tok = s["expert_bytes_per_token"]
    pf = s.get("prefetches") or {}
    prefetch = (f"prefetch {pf['issued']} read: {pf['used'] / pf['issued']:.0%} used in time, "
                f"{pf['late'] / pf['issued']:.0%} late, {pf['wasted'] / pf['issued']:.0%} wasted "
                f"({pf['cancelled']} cancelled unread) | ") if pf.get("issued") else ""
    predicted = "" if s.get("predictor_recall") is None else f"predictor recall {s['predictor_recall']:.0%} | "
    dec = s.get("decode") or {}
    mixed = (f"low precision {dec['low_runs'] / dec['needed']:.0%} of experts ({dec['low_loads']} read), "
             f"{dec['skipped']} skipped | ") if dec.get("low_runs") or dec.get("skipped") else ""
    substituted = f"{dec['substituted']} substituted | " if dec.get("substituted") else ""
    return (f"TTFT {ms(s['ttft_s'])} | TPOT {ms(s['tpot_s'])} (p50 {ms(s['tpot_p50_s'])}, "
            f"p90 {ms(s['tpot_p90_s'])}) | {rate(s['tokens_per_s'])} tok/s "
            f"(decode {rate(s['decode_tokens_per_s'])} tok/s) | "
            f"expert hit rate {pct(s['hit_rate'])} | {mixed}{substituted}{prefetch}{predicted}"
            f"expert read {'n/a' if per_tok is None else f'{per_tok / 2**20:.1f} MiB'}/token | "
            f"peak RSS {s['peak_rss_bytes'] / 2**20:.0f} MiB")
