"""The cost model: what each piece of a forward step costs for one model shape on one hardware profile.

Compute comes from the profile's figures measured for this shape when it has them (`moetier calibrate` on
this machine), otherwise from the compute device's roofline. Reads: each expert lives in one tier below the
fast tier (tiers fill in (layer, expert) order up to their capacity) and a read crosses every tier down to
it: the latencies add, the slowest bandwidth sets the rate (transfers are chunked and pipelined). A read holds
the link for its bytes over that rate and its request's own cost (`per_read_s`); its latency delays its own data,
not the next read."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property

from moetier.cache.keys import ExpertKey
from moetier.plan.layer_plan import FAST, HOST
from moetier.sim.profile import HardwareProfile, Linear
from moetier.sim.shapes import ModelShape, bytes_per_param

DENSE_CALLS_PER_LAYER = 8  # norms, q/k/v/o, attention, router: kernel launches a dense layer costs at least
CONTEXT_TOKENS = 512  # KV entries attention reads back per token in the roofline (a short chat)


@dataclass(frozen=True)
class CostModel:
    profile: HardwareProfile
    shape: ModelShape
    precision: str  # the experts' (what is read and computed)
    expert_bytes: int  # one expert's blob

    @classmethod
    def of(cls, profile: HardwareProfile, shape: ModelShape, precision: str | None = None,
           expert_bytes: int | None = None) -> CostModel:
        precision = precision or shape.precision
        return cls(profile, shape, precision, expert_bytes or shape.expert_bytes(precision))

    def at(self, precision: str) -> CostModel:
        """The same machine and shape with experts at `precision` (a quantized copy: the shape's bytes for it)."""
        if precision == self.precision:
            return self
        return CostModel(self.profile, self.shape, precision, self.shape.expert_bytes(precision))

    @cached_property
    def _measured(self):
        return self.profile.measured_for(self.shape.hidden_size, self.shape.moe_intermediate_size, self.precision)

    def expert_s(self, tokens: int, place: str = FAST) -> float:
        """One routed expert over `tokens` tokens: on the compute device from the cache (FAST), or on the host
        CPU where its weights live (HOST)."""
        seconds = self._expert_s.get((tokens, place))
        if seconds is None:  # (made once a token count: a replay asks ten times a layer)
            seconds = self._expert_s[tokens, place] = self._compute_expert_s(tokens, place)
        return seconds

    @cached_property
    def _expert_s(self) -> dict[tuple[int, str], float]:
        return {}

    def _compute_expert_s(self, tokens: int, place: str) -> float:
        flop = 2 * self.shape.expert_params * tokens
        if place == HOST:
            return self.profile.host.kernel_s(self.expert_bytes, flop, self.precision)
        m = self._measured
        if m is not None:
            return m.expert_s(tokens)
        return self.profile.device.kernel_s(self.expert_bytes, flop, self.precision)

    def dense_s(self, layer: int, tokens: int) -> float:
        """Attention, norms, router and shared expert or dense MLP of one layer, plus the host's per-layer work."""
        executor = self.profile.executor_s_per_layer(tokens) if layer in self._moe_index else 0.0
        m = self._measured
        if m is not None:
            return m.dense_s_per_layer(tokens) + executor
        params, dense_precision = self.shape.dense_params(layer), self.shape.precision
        kv_bytes = CONTEXT_TOKENS * self.shape.kv_per_token * bytes_per_param(dense_precision) * tokens
        return executor + self.profile.device.kernel_s(params * bytes_per_param(dense_precision) + kv_bytes,
                                                       2 * params * tokens, dense_precision, DENSE_CALLS_PER_LAYER)

    def predict_s(self, tokens: int) -> float:
        """What a predictor adds to a MoE layer that runs one (scoring the coming layers' experts on the host)."""
        return self.profile.predict_s_per_layer(tokens)

    def head_s(self, tokens: int) -> float:
        """Final norm and LM head."""
        m = self._measured
        if m is not None:
            return m.head_s(tokens)
        params = self.shape.head_params
        return self.profile.device.kernel_s(params * bytes_per_param(self.shape.precision),
                                                                  2 * params * tokens, self.shape.precision)

    def rest_of_step_s(self, traced_layers, tokens: int) -> float:
        """What a decode step costs besides the layers a trace covers: those it does not (run with their experts
        resident), and the head. An encoder-decoder's encoder layers do not run in a decode step."""
        traced = set(traced_layers)
        return sum(self.resident_layer_s(layer, tokens) for layer in range(self.shape.encoder_layers,
                                                                            self.shape.num_layers)
                   if layer not in traced) + self.head_s(tokens)

    def encoder_rest_s(self, traced_layers, tokens: int) -> float:
        """What an encoder-decoder's encoder costs over `tokens` prompt tokens besides the layers a trace covers
        (its dense layers, and MoE layers run with their experts resident)."""
        traced = set(traced_layers)
        return sum(self.resident_layer_s(layer, tokens) for layer in range(self.shape.encoder_layers)
                   if layer not in traced)

    def resident_layer_s(self, layer: int, tokens: int) -> float:
        """A layer with every expert it needs already resident (for layers a partial trace does not cover):
        min(tokens * top_k, num_experts) experts, the tokens spread evenly over them."""
        if layer not in self._moe_index:
            return self.dense_s(layer, tokens)
        used = min(tokens * self.shape.top_k, self.shape.num_experts)
        return self.dense_s(layer, tokens) + used * self.expert_s(max(1, round(tokens * self.shape.top_k / used)))

    @cached_property
    def _moe_index(self) -> dict[int, int]:
        return {layer: i for i, layer in enumerate(self.shape.moe_layers)}

    def tier_index(self, key: ExpertKey) -> int:
        tier = self._tier_of.get(key)
        if tier is None:
            tier = self._tier_of[key] = self._find_tier(key)
        return tier

    def _find_tier(self, key: ExpertKey) -> int:
        index = self._moe_index[key.layer] * self.shape.num_experts + key.expert
        held = 0
        for i, tier in enumerate(self.profile.tiers):
            if tier.bytes is None:
                return i
            held += tier.bytes // self.expert_bytes
            if index < held:
                return i
        return len(self.profile.tiers) - 1  # the last tier holds the rest whatever its stated size

    @cached_property
    def _tier_of(self) -> dict[ExpertKey, int]:
        """Each expert's tier, found once (a replay asks for each read's, a million times in 2,000 tokens)."""
        return {}

    @cached_property
    def _reads(self) -> tuple[tuple[float, float, float], ...]:
        """For a read from each tier: (the link held, the latency beyond it, the CPU it takes) — made once by the
        expressions below, so the same floats as making them at each read."""
        out = []
        for i in range(len(self.profile.tiers)):
            path = self.profile.tiers[:i + 1]
            out.append((self.expert_bytes / min(t.effective_bandwidth for t in path) + sum(t.per_read_s for t in path),
                        sum(t.latency_s for t in path), self.expert_bytes * sum(t.cpu_s_per_byte for t in path)))
        return tuple(out)

    def read_busy_s(self, key: ExpertKey) -> float:
        """How long a read holds the link: its bytes at the slowest bandwidth on its path, and each tier's cost per
        request."""
        return self._reads[self.tier_index(key)][0]

    def read_latency_s(self, key: ExpertKey) -> float:
        """What a read waits beyond that before its data is usable (request set-up, pipeline fill); the link
        serves the next read meanwhile."""
        return self._reads[self.tier_index(key)][1]

    def copy_busy_s(self) -> float:
        """Behind a host tier (SimExecutor's `host`): how long a copy from host memory holds the link (the profile's
        first tier)."""
        first = self.profile.tiers[0]
        return self.expert_bytes / first.effective_bandwidth + first.per_read_s

    def copy_latency_s(self) -> float:
        return self.profile.tiers[0].latency_s

    def disk_busy_s(self) -> float:
        """Behind a host tier: how long a read from the disk into host memory holds the disk (the profile's last
        tier, which a host tier's misses come from)."""
        last = self.profile.tiers[-1]
        return self.expert_bytes / last.effective_bandwidth + last.per_read_s

    def disk_latency_s(self) -> float:
        return self.profile.tiers[-1].latency_s

    def read_s(self, key: ExpertKey) -> float:
        """A read on an idle link, request to usable data."""
        return self.read_latency_s(key) + self.read_busy_s(key)

    def read_cpu_s(self, key: ExpertKey) -> float:
        """The CPU a read takes from the compute device, spread over the time it holds the link (0 unless the
        profile's tiers say the compute device is the CPU that reads)."""
        return self._reads[self.tier_index(key)][2]


def linear_fit(xs, ys) -> Linear:
    """Least-squares line through (tokens, seconds), clipped at zero (a negative intercept is noise); a flat line
    at the mean when all xs are equal."""
    import numpy as np

    if len(set(xs)) < 2:
        return Linear(0.0, float(np.mean(ys)))
    slope, intercept = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
    return Linear(max(0.0, float(slope)), max(0.0, float(intercept)))


class FreeCost:
    """A machine where nothing takes time: the clock stands still and every read lands at once. What replaying a
    trace for hits and misses alone runs on (cache-bench, fitting). It counts experts, not bytes — unless given
    each precision's bytes (`entry_bytes`), as a mixed-precision cache needs to split its room as the engine does.

    One exception, an instant: a layer's dense part takes 1e-12 s, so a prefetch queued by an earlier layer has
    started (and, reads taking no time, landed) when the layer routes — on-demand reads overtake only prefetches
    still queued at that moment, and with no time passing every prefetch would be."""

    def __init__(self, entry_bytes: Mapping[str, int] | None = None, precision: str = "") -> None:
        self.entry_bytes, self.precision = dict(entry_bytes or {}), precision

    @property
    def expert_bytes(self) -> int:
        return self.entry_bytes.get(self.precision, 0)

    def at(self, precision: str) -> FreeCost:
        return FreeCost(self.entry_bytes, precision)

    def dense_s(self, layer: int, tokens: int) -> float:
        return 1e-12

    def expert_s(self, tokens: int, place: str = FAST) -> float:
        return 0.0

    def predict_s(self, tokens: int) -> float:
        return 0.0

    def read_busy_s(self, key: ExpertKey) -> float:
        return 0.0

    def read_latency_s(self, key: ExpertKey) -> float:
        return 0.0

    def read_s(self, key: ExpertKey) -> float:
        return 0.0

    def read_cpu_s(self, key: ExpertKey) -> float:
        return 0.0

    def copy_busy_s(self) -> float:
        return 0.0

    def copy_latency_s(self) -> float:
        return 0.0

    def disk_busy_s(self) -> float:
        return 0.0

    def disk_latency_s(self) -> float:
        return 0.0

    def rest_of_step_s(self, traced_layers, tokens: int) -> float:
        return 0.0

    def encoder_rest_s(self, traced_layers, tokens: int) -> float:
        return 0.0
