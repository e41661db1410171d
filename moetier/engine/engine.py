"""The Python API: Engine.from_pretrained(path, expert_memory="30%", policy="lru").generate(prompts)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import psutil

from moetier.cache.policies import PolicyContext, make_policy
from moetier.config import MemoryBudget, format_bytes
from moetier.engine.expert_executor import ExpertExecutor
from moetier.engine.generate import OnStep, OnToken, generate
from moetier.engine.sampling import SamplingParams
from moetier.engine.stats import GenerationStats
from moetier.engine.tokenizer import TextStream, Tokenizer
from moetier.errors import BudgetError, MoetierError
from moetier.model.transformer import Transformer
from moetier.resolve import resolve_model
from moetier.store.reader import ExpertReader
from moetier.store.store import Store

PARTITIONS = ("global", "per-layer")
AUTO_MARGIN = 0.2  # share of available memory `auto` leaves for the OS, the KV cache and everything else


@dataclass(frozen=True)
class EngineConfig:
    expert_memory: MemoryBudget = MemoryBudget("share", 0.3)
    policy: str = "lru"
    cache_partition: str = "global"  # or "per-layer": the slots split evenly among the MoE layers
    reader_threads: int = 4
    chunk_bytes: int = 2 << 20
    verify_checksums: bool = True

    def __post_init__(self) -> None:
        if self.reader_threads < 1:
            raise MoetierError("reader_threads must be at least 1")
        if self.cache_partition not in PARTITIONS:
            raise MoetierError(f"unknown cache partition {self.cache_partition!r}", hint=f"one of {PARTITIONS}")


@dataclass
class GenerationOutput:
    texts: list[str]
    token_ids: list[list[int]]
    stats: dict


def plan_slots(store: Store, budget: MemoryBudget, dense_bytes: int) -> int:
    """Cache slots for the budget; at least one layer's top-k, at most every expert."""
    spec, slot_bytes = store.spec, store.native_layout.blob_bytes
    total = store.total_expert_bytes()
    available = None
    if budget.kind == "auto":
        available = int(psutil.virtual_memory().available * (1 - AUTO_MARGIN)) - dense_bytes
    nbytes = budget.resolve(total, available)
    slots = min(nbytes // slot_bytes, spec.num_expert_keys)
    if slots < spec.top_k:
        need = spec.top_k * slot_bytes
        raise BudgetError(
            f"expert memory {format_bytes(nbytes)} holds {slots} expert(s); one layer's top-{spec.top_k} needs "
            f"{spec.top_k} ({format_bytes(need)}, {need / total:.1%} of all expert bytes)",
            hint=f"give --expert-memory of at least {need} bytes ({-(-need * 1000 // total) / 10:.1f}%)")
    return slots


def policy_dir(store: Store) -> Path:
    """Where trained policy files (`policies/<name>.json`) for this model live: beside the store, or beside the
    model it was converted from (the built-in models ship theirs)."""
    source = Path(store.manifest.source) if store.manifest.source else None
    if not (store.path / "policies").is_dir() and source is not None and (source / "policies").is_dir():
        return source
    return store.path


class Engine:
    def __init__(self, store: Store, config: EngineConfig = EngineConfig()) -> None:
        self.store, self.config, self.spec = store, config, store.spec
        dense = store.load_dense()
        self.dense_bytes = sum(t.numel() * t.element_size() for t in dense.values())
        slots = plan_slots(store, config.expert_memory, self.dense_bytes)
        per_layer = config.cache_partition == "per-layer"
        if per_layer and slots < len(self.spec.moe_layers):
            raise BudgetError(f"a per-layer cache needs a slot for each of the {len(self.spec.moe_layers)} MoE "
                              f"layers; the budget gives {slots}", hint="give more --expert-memory")
        ctx = PolicyContext(slots, self.spec.moe_layers, self.spec.num_experts, self.spec.top_k,
                            model_dir=policy_dir(store))
        policy = make_policy(config.policy, ctx)  # before the reader's threads start: this may refuse
        self.reader = ExpertReader(store.path, config.reader_threads, config.chunk_bytes, config.verify_checksums)
        self.executor = ExpertExecutor(self.spec, store.manifest, slots, policy, self.reader, per_layer)
        self.model = Transformer(self.spec, dense, self.executor)
        self.tokenizer = Tokenizer.from_store(store) if store.tokenizer_path else None
        self.on_step: OnStep | None = None  # observer of every forward step (the trace recorder)

    @classmethod
    def from_pretrained(cls, model: str | Path, expert_memory: str | float | MemoryBudget = "30%",
                        policy: str = "lru", cache_dir: str | Path | None = None, progress: bool = True,
                        **config) -> Engine:
        store = Store(resolve_model(model, cache_dir, progress))
        return cls(store, EngineConfig(expert_memory=MemoryBudget.parse(expert_memory), policy=policy, **config))

    def encode(self, prompts: str | list[str] | list[list[int]]) -> list[list[int]]:
        if isinstance(prompts, str):
            prompts = [prompts]
        if prompts and all(isinstance(p, list) for p in prompts):
            return prompts
        if self.tokenizer is None:
            raise MoetierError(f"{self.store.path} has no tokenizer", hint="pass token ids instead of text")
        return [self.tokenizer.encode(p) for p in prompts]

    def generate(self, prompts: str | list[str] | list[list[int]], max_new_tokens: int = 64,
                 temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, ignore_eos: bool = False,
                 on_text=None, on_token: OnToken | None = None) -> GenerationOutput:
        """Generate for one prompt or a batch. `on_text(i, delta)` streams text as it is produced."""
        ids = self.encode(prompts)
        params = SamplingParams(max_new_tokens, temperature, top_p, seed)
        streams = [TextStream(self.tokenizer) for _ in ids] if on_text and self.tokenizer else None

        def emit(b: int, out: list[int]) -> None:
            if on_token is not None:
                on_token(b, out)
            if streams is not None:
                delta = streams[b].delta(out)
                if delta:
                    on_text(b, delta)

        stats = GenerationStats(expert_cache_bytes=self.executor.pool.nbytes, expert_slots=self.executor.pool.num_slots,
                                total_expert_bytes=self.store.total_expert_bytes())
        eos = () if ignore_eos else self.spec.eos_token_ids
        outputs, stats = generate(self.model, self.executor, ids, params, eos, emit, stats, self.on_step)
        texts = [self.tokenizer.decode(o) for o in outputs] if self.tokenizer else [""] * len(outputs)
        summary = stats.summary()
        summary["dense_bytes"] = self.dense_bytes
        return GenerationOutput(texts, outputs, summary)

    def preload(self) -> int:
        """Fill the expert cache before generating (every expert, if the budget holds them all)."""
        return self.executor.preload()

    def close(self) -> None:
        self.reader.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
