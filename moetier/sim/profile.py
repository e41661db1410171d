"""Hardware profiles: what the simulator knows about a machine, as a JSON data file.

Units are bytes, seconds, bytes per second and FLOP per second throughout. Fields:

  name, description
  sources               where each figure comes from (datasheets, papers, `moetier calibrate`)
  fast_tier_bytes       memory the expert cache may use (GPU memory, or this machine's RAM budget)
  tiers                 the tiers experts are read from, nearest first; each {name, bandwidth_bytes_per_s,
                        latency_s, utilisation, bytes}. `utilisation` is the share of nominal bandwidth reached
                        in practice (PCIe moves 75-85% of its line rate); `latency_s` what a read waits beyond its
                        transfer (set-up, pipeline fill; it overlaps the next read's transfer); `bytes` the tier's
                        capacity for experts (null: all the rest); `cpu_s_per_byte` (optional, 0) the CPU a read
                        takes from the compute device when that is the CPU that reads (syscalls, the reader's
                        threads, checksums: measured by `moetier calibrate`; 0 behind a GPU's DMA). An expert
                        that lives in a lower tier crosses every tier above it.
  devices               compute devices by name; each {memory_bandwidth_bytes_per_s, flops: {precision: FLOP/s},
                        call_overhead_s}. Time for a kernel = call_overhead + max(bytes / memory bandwidth,
                        FLOPs / throughput): flat in tokens while memory-bound (a GPU at small batch), growing
                        linearly once compute-bound (a CPU: PreScope's t_c = beta*m + C).
  compute_device        the device that holds the fast tier and runs dense layers and cached experts
  executor_s_per_layer  optional {per_token, fixed}: the host's own work per MoE layer (planning, policy events)
  predict_s_per_layer   optional {per_token, fixed}: what a predictor adds to a MoE layer that runs one, before
                        its plan (measured by `moetier calibrate` with the stacked-gates predictor; 0 elsewhere)
  host_issue            optional {plan_s, load_s, launch_s, mechanism_s: {key: s}}: the host thread that issues a
                        GPU's work, where it bounds a MoE layer whose routing it reads (moetier/sim/host_issue.py);
                        absent: a host that keeps ahead of the link and the kernels
  measured              optional list, written by `moetier calibrate`: figures measured on this machine for one
                        expert shape {hidden_size, moe_intermediate_size, precision, expert_s, dense_s_per_layer,
                        head_s}, each {per_token, fixed} or {points: [[tokens, seconds], ...]} (straight lines
                        between measured token counts; calibration writes expert_s so); used instead of the
                        roofline for that shape.
"""

from __future__ import annotations

import dataclasses
import json
from bisect import bisect_left
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path

from moetier.atomic import atomic_write_json
from moetier.errors import MoetierError
from moetier.paths import default_cache_dir
from moetier.sim.host_issue import HostIssue

PROFILE_DIR = Path(__file__).resolve().parent / "profiles"


def user_profiles_dir() -> Path:
    """Where `moetier calibrate` writes: the cache directory's profiles/ (honours $MOETIER_CACHE)."""
    return default_cache_dir() / "profiles"


class ProfileError(MoetierError):
    pass


@dataclass(frozen=True)
class Linear:
    """time = per_token * tokens + fixed"""

    per_token: float
    fixed: float

    def __call__(self, tokens: int) -> float:
        return self.per_token * tokens + self.fixed

    def scaled(self, factor: float) -> Linear:
        return Linear(self.per_token * factor, self.fixed * factor)


ZERO = Linear(0.0, 0.0)


@dataclass(frozen=True)
class Piecewise:
    """time at each measured token count, straight between them, the last segment's slope beyond the last and
    the first point's time below the first. A kernel's cost is not one line in its tokens: flat while it streams
    its weights (a few tokens), steeper once it computes, and a quantized kernel changes method past a few tokens
    (from the codes, then dequantized once) — one line through 1..32 tokens priced a demo-deep-xl expert at
    0.83 ms for the one token of batch-1 decode where it takes 0.42 (bf16), and 0.87 where it takes 0.21 (int4)."""

    points: tuple[tuple[float, float], ...]  # (tokens, seconds), tokens increasing

    def __post_init__(self) -> None:
        tokens = [t for t, _ in self.points]
        if len(self.points) < 2 or any(b <= a for a, b in zip(tokens, tokens[1:])) or tokens[0] <= 0 \
                or any(s < 0 for _, s in self.points):
            raise ProfileError(f"a piecewise cost needs two or more (tokens, seconds) points, tokens positive and "
                               f"increasing, seconds >= 0: got {self.points}")

    @cached_property
    def _tokens(self) -> tuple[float, ...]:
        return tuple(t for t, _ in self.points)

    def __call__(self, tokens: float) -> float:
        pts = self.points
        if tokens <= pts[0][0]:
            return pts[0][1]
        i = min(bisect_left(self._tokens, tokens), len(pts) - 1)  # the segment that holds it (the last beyond)
        (t0, s0), (t1, s1) = pts[i - 1], pts[i]
        return max(0.0, s0 + (s1 - s0) * (tokens - t0) / (t1 - t0))

    def scaled(self, factor: float) -> Piecewise:
        return Piecewise(tuple((t, s * factor) for t, s in self.points))


Curve = Linear | Piecewise


def piecewise(tokens, seconds) -> Piecewise:
    """Measured (tokens, seconds), made non-decreasing (a later point measured a little faster is noise: more
    tokens never cost less)."""
    points, top = [], 0.0
    for t, s in sorted(zip(tokens, seconds)):
        top = max(top, float(s))
        points.append((float(t), top))
    return Piecewise(tuple(points))


def mean_curve(a: Curve, b: Curve) -> Curve:
    """Two measurements of one cost averaged: lines coefficient by coefficient, otherwise at each token count
    either measured."""
    if isinstance(a, Linear) and isinstance(b, Linear):
        return Linear((a.per_token + b.per_token) / 2, (a.fixed + b.fixed) / 2)
    tokens = sorted({t for c in (a, b) if isinstance(c, Piecewise) for t, _ in c.points})
    return Piecewise(tuple((t, (a(t) + b(t)) / 2) for t in tokens))


@dataclass(frozen=True)
class Tier:
    name: str
    bandwidth_bytes_per_s: float
    latency_s: float = 0.0
    utilisation: float = 1.0
    bytes: int | None = None  # capacity for experts; None: everything that does not fit above
    cpu_s_per_byte: float = 0.0  # CPU a read takes from a compute device that is the reading CPU
    per_read_s: float = 0.0  # link time every read pays beyond its bytes (a request's own cost: small reads feel it)

    def __post_init__(self) -> None:
        if self.bandwidth_bytes_per_s <= 0 or not 0 < self.utilisation <= 1 or self.latency_s < 0 \
                or self.cpu_s_per_byte < 0 or self.per_read_s < 0:
            raise ProfileError(f"tier {self.name!r}: bandwidth must be positive, utilisation in (0, 1], latency, "
                               f"cpu_s_per_byte and per_read_s >= 0")

    @property
    def effective_bandwidth(self) -> float:
        return self.bandwidth_bytes_per_s * self.utilisation


BLOCK_KIN = {"q8_0": "int8", "q6_k": "int8", "q5_k": "int4", "q4_k": "int4", "q5_1": "int4", "q5_0": "int4",
             "q4_1": "int4", "q4_0": "int4", "q4_k_m": "int4"}  # GGML format -> our integer kernel's


@dataclass(frozen=True)
class Device:
    name: str
    memory_bandwidth_bytes_per_s: float
    flops: dict[str, float] = field(hash=False)
    call_overhead_s: float = 0.0

    def kernel_s(self, nbytes: float, flop: float, precision: str, calls: int = 1) -> float:
        """Roofline time of `calls` kernels that read `nbytes` of weights and do `flop` FLOPs in total. A GGML block
        format a profile does not list is priced as the integer precision whose kernels do the same work (the same
        multiply-adds on int8 activations): an approximation until `moetier calibrate` measures them."""
        if precision not in self.flops and BLOCK_KIN.get(precision) in self.flops:
            precision = BLOCK_KIN[precision]
        if precision not in self.flops:
            raise ProfileError(f"device {self.name!r} lists no throughput for {precision}",
                               hint=f"it lists {', '.join(self.flops)}")
        return calls * self.call_overhead_s + max(nbytes / self.memory_bandwidth_bytes_per_s,
                                                  flop / self.flops[precision])


@dataclass(frozen=True)
class Measured:
    """Times measured on this machine for one expert shape and precision (by `moetier calibrate`)."""

    hidden_size: int
    moe_intermediate_size: int
    precision: str
    expert_s: Curve
    dense_s_per_layer: Curve
    head_s: Curve


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    fast_tier_bytes: int
    tiers: tuple[Tier, ...]
    devices: dict[str, Device] = field(hash=False)
    compute_device: str
    description: str = ""
    sources: tuple[str, ...] = ()
    executor_s_per_layer: Linear = ZERO
    measured: tuple[Measured, ...] = ()
    predict_s_per_layer: Linear = ZERO
    host_issue: HostIssue | None = None

    def __post_init__(self) -> None:
        if not self.tiers:
            raise ProfileError(f"profile {self.name}: no tier to read experts from")
        if self.compute_device not in self.devices:
            raise ProfileError(f"profile {self.name}: compute_device {self.compute_device!r} is not among the "
                               f"devices ({', '.join(self.devices)})")

    @property
    def device(self) -> Device:
        return self.devices[self.compute_device]

    @property
    def host(self) -> Device:
        """The host CPU (the device named "cpu"; the compute device itself where that is the CPU)."""
        return self.devices.get("cpu", self.device)

    def measured_for(self, hidden_size: int, moe_intermediate_size: int, precision: str) -> Measured | None:
        for m in self.measured:
            if (m.hidden_size, m.moe_intermediate_size, m.precision) == (hidden_size, moe_intermediate_size,
                                                                          precision):
                return m
        return None

    def merged_with(self, older: HardwareProfile) -> HardwareProfile:
        """This profile, keeping `older`'s measured figures for shapes this one did not measure."""
        mine = {(m.hidden_size, m.moe_intermediate_size, m.precision) for m in self.measured}
        kept = tuple(m for m in older.measured if (m.hidden_size, m.moe_intermediate_size, m.precision) not in mine)
        return dataclasses.replace(self, measured=self.measured + kept)

    def to_json(self) -> dict:
        d = asdict(self)
        d["sources"] = list(self.sources)
        if self.host_issue is None:
            del d["host_issue"]
        else:
            d["host_issue"] = self.host_issue.to_json()
        for dev in d["devices"].values():
            del dev["name"]
        return d

    def save(self, path: Path) -> None:
        atomic_write_json(path, self.to_json())

    @classmethod
    def load(cls, name_or_path: str | Path) -> HardwareProfile:
        """A profile by name (the user's calibrated profiles first, then the shipped ones) or by path."""
        path = Path(name_or_path)
        if not path.suffix:
            user = user_profiles_dir() / f"{name_or_path}.json"
            path = user if user.exists() else PROFILE_DIR / f"{name_or_path}.json"
        try:
            d = json.loads(path.read_text())
        except FileNotFoundError:
            hint = f"known profiles: {', '.join(known_profiles())}"
            if str(name_or_path) == "this-machine":
                hint = "`moetier calibrate` measures this machine into it; " + hint
            raise ProfileError(f"no hardware profile {name_or_path!r} ({path} does not exist)", hint=hint) from None
        except json.JSONDecodeError as e:
            raise ProfileError(f"{path}: not valid JSON ({e})") from None
        try:
            return _parse(d, _Fields(path))
        except (TypeError, ValueError) as e:
            raise ProfileError(f"{path}: {e}") from None


def known_profiles() -> list[str]:
    names = {p.stem for p in PROFILE_DIR.glob("*.json")} | {p.stem for p in user_profiles_dir().glob("*.json")}
    return sorted(names)


class _Fields:
    """Reads required and optional fields, naming the file and the field's path when one is missing."""

    def __init__(self, path: Path):
        self.path = path

    def need(self, obj: dict, key: str, where: str = ""):
        if not isinstance(obj, dict) or key not in obj:
            raise ProfileError(f"{self.path}: missing field {where}{key}",
                               hint="see the field list in moetier/sim/profile.py or docs/simulator.md")
        return obj[key]

    def linear(self, obj: dict, key: str, where: str = "") -> Linear:
        v = self.need(obj, key, where)
        return Linear(float(self.need(v, "per_token", f"{where}{key}.")), float(self.need(v, "fixed",
                                                                                           f"{where}{key}.")))

    def curve(self, obj: dict, key: str, where: str = "") -> Curve:
        """{per_token, fixed} or {points: [[tokens, seconds], ...]}."""
        v = self.need(obj, key, where)
        if isinstance(v, dict) and "points" in v:
            try:
                return Piecewise(tuple((float(t), float(s)) for t, s in v["points"]))
            except ProfileError as e:
                raise ProfileError(f"{self.path}: {where}{key}: {e}") from None
        return self.linear(obj, key, where)


def _parse(d: dict, f: _Fields) -> HardwareProfile:
    tiers = []
    for i, t in enumerate(f.need(d, "tiers")):
        w = f"tiers[{i}]."
        tiers.append(Tier(str(f.need(t, "name", w)), float(f.need(t, "bandwidth_bytes_per_s", w)),
                          float(t.get("latency_s", 0.0)), float(t.get("utilisation", 1.0)),
                          None if t.get("bytes") is None else int(t["bytes"]), float(t.get("cpu_s_per_byte", 0.0)),
                          float(t.get("per_read_s", 0.0))))
    devices = {}
    for name, dev in f.need(d, "devices").items():
        w = f"devices.{name}."
        devices[name] = Device(name, float(f.need(dev, "memory_bandwidth_bytes_per_s", w)),
                               {k: float(v) for k, v in f.need(dev, "flops", w).items()},
                               float(dev.get("call_overhead_s", 0.0)))
    measured = []
    for i, m in enumerate(d.get("measured", ())):
        w = f"measured[{i}]."
        measured.append(Measured(int(f.need(m, "hidden_size", w)), int(f.need(m, "moe_intermediate_size", w)),
                                 str(f.need(m, "precision", w)), f.curve(m, "expert_s", w),
                                 f.curve(m, "dense_s_per_layer", w), f.curve(m, "head_s", w)))
    return HardwareProfile(
        name=str(f.need(d, "name")), fast_tier_bytes=int(f.need(d, "fast_tier_bytes")), tiers=tuple(tiers),
        devices=devices, compute_device=str(f.need(d, "compute_device")), description=d.get("description", ""),
        sources=tuple(d.get("sources", ())),
        executor_s_per_layer=f.linear(d, "executor_s_per_layer") if "executor_s_per_layer" in d else ZERO,
        measured=tuple(measured),
        predict_s_per_layer=f.linear(d, "predict_s_per_layer") if "predict_s_per_layer" in d else ZERO,
        host_issue=_host_issue(d["host_issue"], f) if "host_issue" in d else None)


def _host_issue(v: dict, f: _Fields) -> HostIssue:
    mechanisms = v.get("mechanism_s", {})
    if not isinstance(mechanisms, dict):
        raise ProfileError(f"{f.path}: host_issue.mechanism_s must be an object {{key: seconds}}")
    return HostIssue(*(float(f.need(v, k, "host_issue.")) for k in ("plan_s", "load_s", "launch_s")),
                     {str(k): float(s) for k, s in mechanisms.items()})
