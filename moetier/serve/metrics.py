"""The server's Prometheus metrics, in a registry of its own (two servers in one process do not share one)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# seconds: from a fast resident token (a few ms) to a prefill behind a long queue under a small budget (minutes)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("moetier_requests", "requests by outcome (stop, length, abort, error, rejected: 429, invalid: other 4xx)",
                                ["outcome"], registry=r)
        self.prompt_tokens = Counter("moetier_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("moetier_generation_tokens", "tokens generated", registry=r)
        self.ttft = Histogram("moetier_time_to_first_token_seconds", "arrival to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.inter_token = Histogram("moetier_inter_token_latency_seconds", "between a request's tokens",
                                     buckets=LATENCY_BUCKETS, registry=r)
        self.waiting = Gauge("moetier_queue_depth", "requests waiting for a KV row", registry=r)
        self.running = Gauge("moetier_running_sequences", "sequences being decoded", registry=r)
        self.expert_needed = Counter("moetier_expert_needed", "experts layers needed (DESIGN.md's needed)",
                                     registry=r)
        self.expert_hits = Counter("moetier_expert_hits", "of those, resident when needed", registry=r)
        self.expert_bytes_read = Counter("moetier_expert_read_bytes", "expert bytes read from disk", registry=r)
        self.cache_bytes = Gauge("moetier_expert_cache_bytes", "bytes the expert cache reserved", registry=r)
        self.kv_bytes = Gauge("moetier_kv_cache_bytes", "bytes the KV rows reserved", registry=r)
        self.variant_switches = Counter("moetier_variant_switches", "switches of merged variant (--adapt --variants)",
                                        registry=r)
        Gauge("moetier_expert_hit_rate", "hits / needed since start", registry=r).set_function(self.hit_rate)

    def hit_rate(self) -> float:
        needed = self.expert_needed._value.get()
        return self.expert_hits._value.get() / needed if needed else 0.0

    def render(self) -> bytes:
        return generate_latest(self.registry)
