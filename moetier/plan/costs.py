"""What layer steps cost lately, for the stages that weigh time (PreSched's prefetch count and placement, SMoE's
two-pointer split, CoMoE's bandwidth stability). The executor that carries the plans out reports what it measured — the real one from its clocks and
its reader, the simulated one from its cost model — so a stage decides from the same numbers in both.

Each cost is an exponentially weighted moving average (CoMoE Eq. 10, r̂(t) = α·r(t) + (1−α)·r̂(t−1)); the read
bandwidth also keeps its last `window` samples for CoMoE's stability indicator (Eq. 11–12). An expert computed on
the host, where its weights live, is PreScope's t_c = β·m + C (Eq. 3), fitted to its last `window` instances (SMoE:
"the past p instances"); flat (β = 0) while they all had one token count (SMoE Fig. 8: CPU time hardly moves with
a small batch)."""

from __future__ import annotations

from collections import deque

from moetier.adapt.monitor import Indicator


class RunningCosts:
    def __init__(self, expert_bytes: int, smoothing: float = 0.2, window: int = 16) -> None:
        """`expert_bytes`: one expert's read, at the precision prefetches read."""
        if not 0.0 < smoothing <= 1.0:
            raise ValueError(f"smoothing must be within (0, 1], not {smoothing}")
        if window < 2:
            raise ValueError(f"window must be at least 2, not {window}")
        self.expert_bytes, self.smoothing = expert_bytes, smoothing
        self.dense_s: float | None = None  # a layer's part before its routing: attention, router
        self.expert_s: float | None = None  # one expert's compute at the current batch
        self.experts_computed, self.expert_s_total = 0, 0.0  # every expert's compute so far (calibration's mean)
        self._bandwidth = Indicator(smoothing, window)  # bytes/s of expert reads
        self._host: deque[tuple[int, float]] = deque(maxlen=window)  # (tokens, seconds) of host computes
        self._host_fit: tuple[float, float] | None = None  # (β, C)

    def _smooth(self, old: float | None, new: float) -> float:
        return new if old is None else self.smoothing * new + (1 - self.smoothing) * old

    def observe_read(self, nbytes: int, seconds: float) -> None:
        """`nbytes` of expert reads took `seconds` of the link's busy time."""
        if nbytes <= 0 or seconds <= 0:
            return
        self._bandwidth.observe(nbytes / seconds)

    @property
    def bandwidth(self) -> float | None:
        """Bytes/s of expert reads, smoothed (None until one was observed)."""
        return self._bandwidth.value

    @property
    def read_s(self) -> float | None:
        """One expert's read on an idle link."""
        return self.expert_bytes / self.bandwidth if self.bandwidth else None

    def observe_dense(self, seconds: float) -> None:
        self.dense_s = self._smooth(self.dense_s, seconds)

    def observe_expert(self, seconds: float) -> None:
        self.expert_s = self._smooth(self.expert_s, seconds)
        self.experts_computed += 1
        self.expert_s_total += seconds

    def observe_host(self, tokens: int, seconds: float) -> None:
        """An expert of `tokens` tokens took `seconds` on the host."""
        self._host.append((tokens, seconds))
        ms, ts = zip(*self._host)
        if len(set(ms)) < 2:
            self._host_fit = (0.0, sum(ts) / len(ts))
        else:
            mean_m, mean_t = sum(ms) / len(ms), sum(ts) / len(ts)
            beta = sum((m - mean_m) * (t - mean_t) for m, t in self._host) / sum((m - mean_m) ** 2 for m in ms)
            beta = max(0.0, beta)
            self._host_fit = (beta, max(0.0, mean_t - beta * mean_m))

    def host_s(self, tokens: int) -> float:
        """t_c(m) = β·m + C (0 until observed)."""
        if self._host_fit is None:
            return 0.0
        beta, c = self._host_fit
        return beta * tokens + c

    @property
    def ready(self) -> bool:
        return None not in (self.read_s, self.dense_s, self.expert_s)

    @property
    def placement_ready(self) -> bool:
        """Reads, the compute device's experts and the host's all measured: what placement weighs."""
        return self.ready and self._host_fit is not None

    def bandwidth_stability(self) -> float:
        """CoMoE's S_b(t) = 1 − σ/r̂ over the last `window` bandwidth samples (Eq. 11–12), within [0, 1]; 1 until
        there are two samples."""
        return self._bandwidth.stability
