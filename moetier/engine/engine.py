"""The Python API: Engine.from_pretrained(path, expert_memory="30%", policy="lru").generate(prompts)."""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from moetier.cache.capacity import check_split, split_by_layer
from moetier.cache.keys import ExpertKey
from moetier.cache.policies import DEFAULT_POLICY, SUFFIX, PolicyContext, check_policy
from moetier.config import KERNELS, HostMemory, MemoryBudget, format_bytes
from moetier.engine.adapt_cache import AdaptCache
from moetier.engine.adapt_variant import AdaptVariant
from moetier.engine.blas_threads import OneBlasThread
from moetier.engine.budget import RUNTIME_BYTES, BudgetChoice, check_host_tier, plan_budget, plan_host_tier
from moetier.engine.cpu_share import CpuShare
from moetier.engine.embedding_rows import kept_bytes, not_kept, rows_read
from moetier.engine.expert_executor import ExpertExecutor
from moetier.engine.generate import OnStep, OnToken, generate
from moetier.engine.grammar import Grammar
from moetier.engine.host_tier import HostTier
from moetier.engine.huge_pages import in_huge_pages
from moetier.engine.kv_pool import KeptCache
from moetier.engine.sampling import SamplingParams
from moetier.engine.speculative import Speculation
from moetier.engine.stats import GenerationStats
from moetier.engine.tokenizer import TextStream, Tokenizer
from moetier.errors import BudgetError, MoetierError
from moetier.memory import MemoryView, memory_available, release_freed_memory
from moetier.merge.library import Library
from moetier.model.build import make_model
from moetier.model.decode_graphs import DecodeGraphs
from moetier.model.dense_quant import (
    DENSE_PRECISIONS,
    check_dense_precision,
    dense_bytes,
    dense_load_bytes,
    quantize_dense,
    quantized_dense_bytes,
    quantizing,
    with_dense_precision,
)
from moetier.model.kernels import PATHS, check_kernel_path, make_kernels, triton_installed
from moetier.model.stacked import materialized, stack_qkv
from moetier.model.transformer import Transformer
from moetier.plan.alpha_budget import CALIBRATION_ALPHAS, AlphaChoice, choose_alpha
from moetier.plan.placement import PLACEMENTS
from moetier.plan.precision import MixedPrecision
from moetier.plan.prefetchers import PREFETCHERS
from moetier.plan.similar_substitute import SimilarSubstitution
from moetier.plan.substitute import Substitution
from moetier.policy_files import load_similarity, load_thresholds, make_policy_for_model
from moetier.predict import PREDICTORS, Predictor, make_predictor
from moetier.predict.grouped import for_model
from moetier.predictor_files import TRAINED, load_nets
from moetier.quant.precisions import CODES
from moetier.resolve import BUILT_FROM, resolve_model
from moetier.store.reader import ExpertReader, check_reader_threads
from moetier.store.store import Store
from moetier.store.variants import add_precisions, expert_layouts

PARTITIONS = ("auto", "global", "per-layer")
OFFLOADS = ("all", "encoder")
LOW_TIER_SHARE = 0.75  # low-tier's default: the resident low copies take at most this share of the expert budget
# (int2 of a 12 MiB expert is 16% of its bf16 bytes: at a 25% budget, 62% of it)


def released(convert):
    """`convert` (Store.load_dense's), each tensor's freed temporaries handed back before the next is read: glibc
    keeps freed heap memory for reuse, and the heap fragments between the copies kept, so reading OLMoE's dense
    weights into int8 copies peaked at 2.8 GB RSS for 0.8 GB kept (1.05 GB with this and quant.codes writing a
    matrix's pieces into place: under a memory cgroup the difference between running and being killed)."""
    if convert is None:
        return None

    def convert_released(name: str, t: torch.Tensor):
        kept = convert(name, t)
        release_freed_memory()
        return kept

    return convert_released


@dataclass(frozen=True)
class EngineConfig:
    expert_memory: MemoryBudget = MemoryBudget("share", 0.3)
    policy: str = DEFAULT_POLICY
    cache_partition: str = "auto"  # "global", "per-layer" (the slots split evenly among the MoE layers), or "auto"
    # (per_layer says which)
    reader_threads: int = 4
    chunk_bytes: int = 2 << 20
    verify_checksums: bool = True
    device: str = "cpu"  # where the dense weights, the expert cache and the kernels live ("cuda", "cuda:1", ...)
    kernels: str = "auto"  # "auto": native one-row bf16 products on the CPU where they build; "torch"; "native"
    prefetch: str = "none"  # a prefetch stage of moetier.plan.prefetchers: hobbit, smoe, comoe(-37), presched, ahead
    predictor: str = "none"  # what the prefetch stage and the eviction policy hear: a name of moetier.predict
    predict_distance: int = 2  # MoE layers ahead the predictor scores (HOBBIT's p; the other stages use the next)
    precision: MixedPrecision = MixedPrecision()  # every expert at the model's own precision: exact mode
    substitution: Substitution | SimilarSubstitution | None = None  # SMoE's substitution of low-score experts, or
    # CoMoE's of mispredicted low-priority ones by similar cached experts (None: exact mode)
    dense_precision: str = "native"  # or int8/int4: attention projections and the head quantized at load (as
    # llama.cpp's Q8_0/Q4_K_M files hold them); not exact
    share_cpu: bool = True  # on the CPU: as many compute threads as other runnable processes leave cores for
    placement: str = "none"  # load a missing expert or compute it on the host CPU (moetier.plan.placement); every
    # expert is then held in host memory too. Made for a GPU (--device cuda); on the CPU the same memory stands in
    # for both, which tests the mechanism and gains nothing
    reserve_bytes: int = 0  # memory the caller will take beside the engine (a server's KV rows): left out of the
    # expert cache's room like the dense weights
    host_memory: HostMemory | None = None  # the host tier behind a GPU's cache (engine/host_tier.py): bytes, a
    # share of the experts, auto, or none; None: the default, auto on a GPU (every expert where the host has room)
    offload: str = "all"  # whose experts the cache offloads: every MoE layer's, or an encoder-decoder's encoder's
    # alone, the decoder's kept resident (CoMoE's encoder-focused offloading: Residency.keep)
    adapt: bool = False  # the expert cache follows the memory free beside it while running (engine/adapt_cache.py)
    variants: str | None = None  # with adapt: a merge library's folder; its variants switched between by the memory
    speculation: Speculation | None = None  # drafts by prompt lookup verified in one step (engine/speculative.py);
    # None: one token a request a step
    cuda_graphs: bool = False  # on a GPU: a decode step of up to 8 sequences replayed as a CUDA graph where every
    # expert is resident (moetier/model/decode_graphs.py), else each layer's dense part one (part_graphs.py)

    def per_layer(self, slots: int, layers: int, experts: int) -> bool:
        """Whether the expert cache's `slots` are split among the `layers` MoE layers (moetier/cache/capacity.py:
        "auto" splits them where speculation runs under a budget)."""
        # (HOBBIT's cache is split by precision, an encoder-focused one keeps the decoder's apart: neither by layer)
        free = self.offload == "all" and self.precision.mode != "hobbit"
        return split_by_layer(self.cache_partition, self.speculation is not None and free, slots, layers, experts)

    def __post_init__(self) -> None:
        check_reader_threads(self.reader_threads, "reader_threads")
        if self.reserve_bytes < 0:
            raise MoetierError(f"reserve_bytes must be >= 0, not {self.reserve_bytes}")
        if self.variants is not None and not self.adapt:
            raise MoetierError("--variants switches between a model's merged variants as the memory changes: it "
                               "needs --adapt", hint="add --adapt")
        check_device(self.device)
        if not isinstance(self.precision, MixedPrecision):
            raise MoetierError(f"precision must be a MixedPrecision, not {self.precision!r}",
                               hint="e.g. MixedPrecision('hobbit') (moetier.plan.precision)")
        if self.substitution is not None and not isinstance(self.substitution, (Substitution, SimilarSubstitution)):
            raise MoetierError(f"substitution must be a Substitution or SimilarSubstitution, not {self.substitution!r}",
                               hint="e.g. Substitution(alpha=0.35) (moetier.plan.substitute)")
        if self.offload not in OFFLOADS:
            raise MoetierError(f"unknown offload scope {self.offload!r}", hint=f"one of {', '.join(OFFLOADS)}")
        if self.precision.mode == "hobbit" and self.cache_partition == "per-layer":
            raise MoetierError("HOBBIT's mixed precision splits the expert cache by precision; it cannot also be "
                               "split by layer", hint="drop --cache-partition per-layer")
        if self.offload == "encoder" and self.cache_partition == "per-layer":
            raise MoetierError("--offload encoder keeps the decoder's experts in one shared cache beside the "
                               "encoder's", hint="drop --cache-partition per-layer")
        if self.kernels not in KERNELS:
            raise MoetierError(f"unknown kernels {self.kernels!r}", hint=f"one of {', '.join(KERNELS)}")
        if self.kernels in PATHS:  # a path by name: this CPU runs it, or one line now
            if torch.device(self.device).type != "cpu":
                raise MoetierError(f"--kernels {self.kernels} is a CPU path; the model runs on {self.device}",
                                   hint="use --kernels auto with a GPU")
            check_kernel_path(self.kernels)
        if self.cache_partition not in PARTITIONS:
            raise MoetierError(f"unknown cache partition {self.cache_partition!r}", hint=f"one of {PARTITIONS}")
        if self.prefetch != "none" and self.prefetch not in PREFETCHERS:
            raise MoetierError(f"unknown prefetcher {self.prefetch!r}", hint=f"one of none, {', '.join(PREFETCHERS)}")
        if self.predictor != "none" and self.predictor not in PREDICTORS:
            raise MoetierError(f"unknown predictor {self.predictor!r}", hint=f"one of none, {', '.join(PREDICTORS)}")
        if self.prefetch != "none" and self.predictor == "none":
            raise MoetierError(f"prefetch {self.prefetch!r} needs a predictor",
                               hint="give one, e.g. --predictor stacked-gates")
        if self.predict_distance < 1:
            raise MoetierError(f"predict_distance must be at least 1, not {self.predict_distance}")
        check_policy(self.policy, live=True)
        if self.dense_precision not in DENSE_PRECISIONS:
            raise MoetierError(f"unknown dense precision {self.dense_precision!r}",
                               hint=f"one of {', '.join(DENSE_PRECISIONS)}")
        if self.dense_precision != "native" and torch.device(self.device).type != "cpu":
            raise MoetierError(f"--dense-precision {self.dense_precision} computes on the CPU's kernels; the dense "
                               f"weights are on {self.device}", hint="use --dense-precision native with a GPU")
        if self.cuda_graphs and torch.device(self.device).type == "cpu":
            raise MoetierError("--cuda-graphs replays a GPU's decode step; the model runs on the CPU",
                               hint="use --device cuda, or drop --cuda-graphs")
        if self.cuda_graphs and (self.kernels == "torch" or not triton_installed()):
            raise MoetierError("--cuda-graphs computes a token's experts from the router's ids on the device, "
                               "through Triton's kernels" + ("" if self.kernels == "torch" else
                                                            ", and triton is not installed"),
                               hint="use --kernels auto with triton installed, or drop --cuda-graphs")
        if self.host_memory is not None and torch.device(self.device).type == "cpu":
            raise MoetierError("--host-memory is the host tier behind a GPU's expert cache; on the CPU the expert "
                               "cache is in host memory already", hint="use --expert-memory, or --device cuda")
        if self.placement != "none" and self.placement not in PLACEMENTS:
            raise MoetierError(f"unknown placement {self.placement!r}", hint=f"one of none, {', '.join(PLACEMENTS)}")
        if self.policy.endswith(SUFFIX) and self.predictor == "none":
            raise MoetierError(f"policy {self.policy!r} needs a predictor", hint="give one, e.g. --predictor stacked-gates")


def _is_id(t) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def sampling_params(max_new_tokens, temperature=0.0, top_p=1.0, seed=0, **sampling) -> SamplingParams:
    """SamplingParams from the Python API's arguments: unknown ones refused by name, logit_bias as a mapping."""
    fields = set(SamplingParams.__dataclass_fields__) - {"max_new_tokens", "temperature", "top_p", "seed"}
    unknown = sorted(set(sampling) - fields)
    if unknown:
        raise MoetierError(f"unknown sampling argument {unknown[0]!r}", hint=f"one of {', '.join(sorted(fields))}")
    bias = sampling.pop("logit_bias", None) or {}
    if not isinstance(bias, dict):
        raise MoetierError("logit_bias must map token ids to biases ({token id: bias})")
    return SamplingParams(max_new_tokens, temperature, top_p, seed, **sampling,
                          logit_bias=tuple(sorted((int(k) if isinstance(k, str) and k.isdigit() else k, v)
                                                  for k, v in bias.items())))


@dataclass
class GenerationOutput:
    texts: list[str]
    token_ids: list[list[int]]
    stats: dict


def check_variant(current: Store, other: Store) -> None:
    """`other` is a variant of `current`'s model: the same family, config (but for its merge) and dense weights."""
    a, b = current.manifest, other.manifest
    unmerged = lambda cfg: {k: v for k, v in cfg.items() if k != "moetier_merged"}  # noqa: E731
    if a.family != b.family or unmerged(a.config) != unmerged(b.config) or a.dense_crc32 != b.dense_crc32:
        raise MoetierError(f"{other.path.name} is not a variant of {current.path.name}: its family, config or dense "
                           f"weights differ", hint="switch between a model and its merged variants (moetier merge)")


def choose_low(mixed: MixedPrecision, store: Store, cache_bytes: int) -> MixedPrecision:
    """low-tier without a low precision: the most precise copy whose every expert takes at most LOW_TIER_SHARE of
    the expert budget (the rest is the high-precision cache)."""
    if mixed.mode != "low-tier" or mixed.low:
        return mixed
    spec, n = store.spec, store.spec.num_expert_keys
    for low in CODES:  # our own copies (a GGML format is taken when named: --low-precision q4_k)
        if expert_layouts(spec, [low])[low].blob_bytes * n <= LOW_TIER_SHARE * cache_bytes:
            return dataclasses.replace(mixed, low=low)
    smallest = expert_layouts(spec, ["int2"])["int2"].blob_bytes * n
    raise BudgetError(f"low-tier keeps every expert resident at low precision; even int2 ({format_bytes(smallest)}) "
                      f"takes more than {LOW_TIER_SHARE:.0%} of the expert budget ({format_bytes(cache_bytes)})",
                      hint="give more --expert-memory, or use --precision hobbit")


def add_missing_precisions(store: Store, mixed: MixedPrecision, progress: bool) -> list[str]:
    """A store moetier converted into its cache on first use gets the quantized copies a mode needs on first use
    too (returns those it lacked: added here, or by another process this one waited for under the store's lock —
    either way its manifest must be read again) — in whichever cache it was built (`--cache-dir` too: the note
    moetier leaves in each build says so); a store the user made is never changed (the executor names the command
    that would add them)."""
    native = store.manifest.native_precision
    missing = [p for p in mixed.precisions(native) if p not in store.manifest.precisions]
    if not missing or not (store.path / BUILT_FROM).is_file():
        return []
    add_precisions(store.path, missing, progress)
    return missing


def decoder_experts(store: Store, budget: BudgetChoice) -> list[ExpertKey]:
    """An encoder-decoder's decoder experts, which `--offload encoder` keeps resident — refused where there is no
    decoder, or where the budget does not hold them and one encoder layer's top-k beside."""
    spec = store.spec
    if spec.encoder_decoder is None:
        raise MoetierError("--offload encoder offloads an encoder-decoder's encoder; this model is a decoder alone",
                           hint="use --offload all (the default)")
    first = spec.encoder_decoder.encoder_layers
    kept = [ExpertKey(layer, e) for layer, e in spec.expert_keys() if layer >= first]
    if budget.slots < len(kept) + spec.top_k:
        raise BudgetError(f"--offload encoder keeps the decoder's {len(kept)} experts resident and needs room for "
                          f"{spec.top_k} of the encoder's beside them; the budget holds {budget.slots}",
                          hint="give more --expert-memory, or use --offload all")
    return kept


def check_device(name: str) -> torch.device:
    """A torch device this machine has, or a clear error."""
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise MoetierError(f"unknown device {name!r}", hint="cpu, cuda, or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise MoetierError(f"device {name!r} asked for, but this torch sees no CUDA device",
                           hint="use --device cpu, or install a CUDA build of torch on a machine with a GPU")
    if device.type not in ("cpu", "cuda"):
        raise MoetierError(f"device {name!r} is not supported", hint="cpu or cuda")
    return device


def predictor_inputs(name: str, dense: dict[str, torch.Tensor], store: Store,
                     model: Callable[[], Transformer]) -> dict:
    """What predictor `name` is built on: the engine's own weights or model (`model()` once it exists), or networks
    trained for the model."""
    if name == "stacked-gates":
        return {"routers": {layer: dense[f"layers.{layer}.router"] for layer in store.spec.moe_layers}}
    if name == "smoe-lookahead":  # (the model is made after the executor that holds the predictor)
        if store.spec.encoder_decoder is not None:
            raise MoetierError("the smoe-lookahead predictor runs a decoder-only model's next layer; this is an "
                               "encoder-decoder", hint="use another predictor, e.g. stacked-gates")
        return {"lookahead": lambda layer, target: model().lookahead(layer, target)}
    if name in TRAINED:
        return {"nets": load_nets(name, store.trained_dir("predictors"))}
    return {}


def device_memory(device: torch.device) -> MemoryView:
    """What the fast tier may still take: this process's share of host memory (cgroups included) for the CPU, the
    device's free memory for a GPU."""
    if device.type == "cpu":
        return memory_available()
    free, total = torch.cuda.mem_get_info(device)
    return MemoryView(free, str(device), total, total - free)


@dataclass(frozen=True)
class _Parts:
    """What holds one store's experts (Engine._parts)."""

    store: Store
    precision: MixedPrecision
    reader: ExpertReader
    host_tier: HostTier | None
    own_tier: bool  # made here (closed with the engine), not handed in
    host_note: str
    executor: ExpertExecutor
    model: Transformer


class Engine:
    def __init__(self, store: Store, config: EngineConfig = EngineConfig(), memory: MemoryView | None = None,
                 predictor: Predictor | None = None, progress: bool = True, host_tier: HostTier | None = None,
                 copy_order: str = "demand-first") -> None:
        """`memory`: what bounds this process's memory (default: measured now, host and cgroups). `predictor`: a
        predictor object instead of the one `config.predictor` names (e.g. an oracle built from a trace).
        `host_tier`: a GPU run's host tier made earlier for this store (a benchmark's, shared by its engines; the
        engine then leaves it open), instead of the one `config.host_memory` asks for. `copy_order`: how copies from
        the host tier are queued (engine/copy_queue.py; "fifo" keeps the first GPU runs' order for a benchmark)."""
        self.store, self.config, self.spec = store, config, store.spec
        self.device = check_device(config.device)
        check_dense_precision(self.spec, config.dense_precision)
        if config.speculation is not None and self.spec.encoder_decoder is not None:
            raise MoetierError("speculative decoding verifies drafts in a decoder-only model's steps; this model is "
                               "an encoder-decoder", hint="drop --speculate")
        if config.cuda_graphs and self.spec.encoder_decoder is not None:
            raise MoetierError("--cuda-graphs replays a decoder-only model's decode step; this model is an "
                               "encoder-decoder", hint="drop --cuda-graphs")
        tensors = store.dense_tensors()
        in_blocks = config.dense_precision == "native" and self.device.type == "cpu"  # (a GGUF's: below)
        blocks = {name: b.nbytes for name, b in store.manifest.dense_blocks.items()} if in_blocks else {}
        # an untied embedding table read a row a token from the file's pages, counted as the rows (embedding_rows.py)
        by_row = rows_read(self.spec, tensors, config.dense_precision, self.device)
        kept = {**blocks, **{name: kept_bytes(*tensors[name]) for name in by_row}}
        self.budget = plan_budget(store, config.expert_memory, memory or device_memory(self.device),
                                  config.precision,
                                  quantized_dense_bytes(tensors, config.dense_precision, kept) + config.reserve_bytes,
                                  load_bytes=dense_load_bytes(tensors, config.dense_precision))
        slots = self.budget.slots
        per_layer = config.per_layer(slots, len(self.spec.moe_layers), len(self.spec.expert_keys()))
        check_split(per_layer, slots, len(self.spec.moe_layers))
        # before the reader's threads start: this may refuse (an offline policy, a learned one without its file)
        policy = self._policy(store, self.budget)
        if isinstance(config.substitution, SimilarSubstitution):  # likewise its similarities (read again by _parts,
            load_similarity(store.trained_dir(), self.spec.moe_layers, self.spec.num_experts)  # as a variant's are)
        convert = released(quantizing(config.dense_precision, self.spec.num_layers))  # (native: None: as they are)
        dense = {name: t.to(self.device) if convert is None else t
                 for name, t in store.load_dense(convert, by_row, skip=tuple(blocks)).items()}
        if in_blocks:  # a GGUF's, in the file's blocks (their float copies, mapped, dropped)
            dense.update(store.load_dense_blocks())
        dense = quantize_dense(dense, self.spec, config.dense_precision)  # a tied head's copy (native: unchanged)
        release_freed_memory()  # what reading (and quantizing) them left, before the cache is reserved
        if self.spec.encoder_decoder is None:  # one product for q, k and v (moetier/model/stacked.py)
            dense = stack_qkv(dense, self.spec.num_layers)
        if torch.device(self.device).type == "cpu":  # streamed every token: from huge pages (huge_pages.py)
            dense = in_huge_pages(dense, leave=by_row)  # (the stacked parts copied one after another there)
        else:
            dense = materialized(dense)
        self.dense_bytes = dense_bytes(dense) - not_kept(tensors, by_row)
        self.kernels = make_kernels(config.kernels, dense["embed_tokens"].dtype, self.device)
        self._given_predictor, self._given_tier = predictor is not None, host_tier is not None
        self._copy_order = copy_order
        parts = self._parts(store, self.budget, policy, predictor, dense,
                            with_dense_precision(self.kernels, config.dense_precision, dense), memory, progress,
                            host_tier)
        self.store, self.spec, self.precision, self.reader = parts.store, parts.store.spec, parts.precision, parts.reader
        self.host_tier, self._own_tier, self.host_note = parts.host_tier, parts.own_tier, parts.host_note
        self.executor, self.model = parts.executor, parts.model
        # with CUDA graphs, a generate call's KV cache kept for the next (the graphs captured on it replay there)
        self.kept_kv = KeptCache(self.spec, self.model.dtype, self.device) if config.cuda_graphs else None
        # an engine dropped unclosed (a notebook making it again) stops its reader threads when it is freed; they
        # hold the reader, not the engine, and would wait on its queue for good
        self._stop_reader = weakref.finalize(self, self.reader.close)
        store = self.store
        self.tokenizer = Tokenizer.from_store(store) if store.tokenizer_path else None
        self.step_hooks: list[OnStep] = []  # observers of every forward step (the trace recorder)
        # fewer compute threads while other processes want the cores (moetier/engine/cpu_share.py)
        self.cpu_share = CpuShare() if self.device.type == "cpu" and config.share_cpu else None
        if self.cpu_share is not None:
            self.step_hooks.append(self.cpu_share)
        # the expert cache resized to the memory free beside it, between steps (CoMoE Eq. 17; --adapt)
        self.adapt = AdaptCache(self, lambda: device_memory(self.device)) if config.adapt else None
        if self.adapt is not None:
            self.step_hooks.append(self.adapt)
        # the library variant the memory allows, switched to between calls (CoMoE Eq. 34-35; --adapt --variants)
        self.adapt_variant = AdaptVariant(self, Library.load(config.variants), lambda: device_memory(self.device)) \
            if config.variants else None
        if self.adapt_variant is not None:
            self.step_hooks.append(self.adapt_variant)
        # NumPy's BLAS threads would spin on the cores torch computes on (moetier/engine/blas_threads.py)
        self.blas_threads = OneBlasThread()
        self.closed = False

    @classmethod
    def from_pretrained(cls, model: str | Path, expert_memory: str | float | MemoryBudget = "30%",
                        policy: str = DEFAULT_POLICY, cache_dir: str | Path | None = None, progress: bool = True,
                        reconvert: bool = False, **config) -> Engine:
        """`reconvert`: convert a Hugging Face folder again even if the cache holds its store (a damaged one)."""
        config = EngineConfig(expert_memory=MemoryBudget.parse(expert_memory), policy=policy, **config)
        return cls(Store(resolve_model(model, cache_dir, progress, reconvert)), config, progress=progress)

    def _policy(self, store: Store, budget: BudgetChoice):
        """The run's eviction policy for `store`'s experts at `budget` (a learned one's file read from beside it)."""
        mixed = self.config.precision
        high = mixed.pair(store.manifest.native_precision)[0] if mixed.mixed else None  # what LHU counts
        ctx = PolicyContext(budget.slots, store.spec.moe_layers, store.spec.num_experts, store.spec.top_k, high)
        return make_policy_for_model(self.config.policy, ctx, store.trained_dir())

    def _parts(self, store: Store, budget: BudgetChoice, policy, predictor: Predictor | None,
               dense: dict[str, torch.Tensor], kernels, memory: MemoryView | None, progress: bool,
               host_tier: HostTier | None) -> _Parts:
        """Everything that holds one store's experts — its precision pair, predictor, reader, host tier, executor
        and the model over them and `dense` — made for `store` at `budget`: at start-up, and for each switch of
        variant (use_variant), so a switched engine runs as a fresh one on the variant would. Nothing of the
        engine's is touched: a failure closes what it opened and leaves the engine as it was."""
        config, spec = self.config, store.spec
        if predictor is None and config.predictor != "none":
            predictor = make_predictor(config.predictor, spec.moe_layers, spec.num_experts, spec.top_k,
                                       config.predict_distance,
                                       **predictor_inputs(config.predictor, dense, store, lambda: self.model))
        if predictor is not None:  # a merged variant's: each group's scores on its principal
            predictor = for_model(predictor, spec.expert_groups)
        substitution = config.substitution
        if isinstance(substitution, SimilarSubstitution):  # the model's own similarities (refused without them)
            substitution = dataclasses.replace(substitution, similarity=load_similarity(
                store.trained_dir(), spec.moe_layers, spec.num_experts))
        fitted = load_thresholds(store.trained_dir())  # the model's own T1, T2, where it has them
        precision = choose_low(config.precision.with_thresholds(fitted), store, budget.cache_bytes)
        if add_missing_precisions(store, precision, progress):
            store = Store(store.path)
        if config.placement != "none" and self.device.type == "cpu":
            check_host_tier(store, budget, memory or memory_available(), True,
                            precision.host_precisions(store.manifest.native_precision))
        host_choice = None
        if host_tier is None and self.device.type != "cpu":  # (checked before the reader's threads start)
            host_choice = plan_host_tier(store, config.host_memory or HostMemory(), memory_available(),
                                         precision.host_precisions(store.manifest.native_precision),
                                         must_hold_all=config.placement != "none")
        kept = decoder_experts(store, budget) if config.offload == "encoder" else []  # (refused before the reader)
        reader = ExpertReader(store.path, config.reader_threads, config.chunk_bytes, config.verify_checksums,
                              manifest=store.manifest)
        try:
            if host_choice is not None:
                host_tier = HostTier(store.manifest, spec.expert_keys(), host_choice.slots)
                host_tier.fill(reader, progress)
            dtype = dense["embed_tokens"].dtype
            executor = ExpertExecutor(spec, store.manifest, budget.cache_bytes, policy, reader,
                                      config.per_layer(budget.slots, len(spec.moe_layers), len(spec.expert_keys())),
                                      self.device, self.kernels,
                                      config.prefetch, predictor, mixed=precision, dtype=dtype,
                                      substitution=substitution, placement=config.placement,
                                      host_kernels=make_kernels(config.kernels, dtype, "cpu")
                                      if self.device.type != "cpu" else None, host_tier=host_tier,
                                      copy_order=self._copy_order)
            model = make_model(spec, dense, executor, kernels)
            if config.cuda_graphs:  # (a decoder-only model's: __init__ refused the others)
                model.graphs = DecodeGraphs.make(model)
            executor.preload(kept)  # (--offload encoder: the decoder's experts, resident for good)
            executor.residency.keep(kept)
            executor.preload(policy.start_set())  # a policy's profiled hot set, loaded at start-up (PreScope)
        except BaseException:
            reader.close()
            if host_choice is not None and host_tier is not None:
                host_tier.close()
            raise
        return _Parts(store, precision, reader, host_tier, host_choice is not None,
                      host_choice.note if host_choice else "", executor, model)

    def _check_open(self) -> None:
        if self.closed:
            raise MoetierError("this Engine is closed", hint="make a new one with Engine.from_pretrained")

    def encode(self, prompts: str | list[str] | list[int] | list[list[int]]) -> list[list[int]]:
        """Prompts as token ids: a text, texts, a list of ids (one prompt) or lists of ids (several)."""
        if isinstance(prompts, str):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise MoetierError(f"prompts must be text, a list of texts or token ids, not {type(prompts).__name__}")
        if prompts and all(_is_id(t) for t in prompts):  # one prompt's ids
            return [list(prompts)]
        if prompts and all(isinstance(p, (list, tuple)) for p in prompts):
            if not all(_is_id(t) for p in prompts for t in p):
                raise MoetierError("prompts given as token ids must hold whole numbers only")
            return [list(p) for p in prompts]
        if not all(isinstance(p, str) for p in prompts):
            raise MoetierError("prompts must be all texts or all token-id lists, not a mix")
        if self.tokenizer is None:
            raise MoetierError(f"{self.store.path} has no tokenizer", hint="pass token ids instead of text")
        return [self.tokenizer.encode(p) for p in prompts]

    def generate(self, prompts: str | list[str] | list[int] | list[list[int]], max_new_tokens: int = 64,
                 temperature: float = 0.0, top_p: float = 1.0, seed: int | None = 0, ignore_eos: bool = False,
                 on_text=None, on_token: OnToken | None = None, grammar: Grammar | None = None,
                 **sampling) -> GenerationOutput:
        """Generate for one prompt or a batch. `on_text(i, delta)` streams text as it is produced. Greedy by default
        (exact mode's tokens); `temperature` > 0 samples, with `top_p` and any other SamplingParams field in
        `sampling` (top_k, min_p, repetition_penalty, repetition_window, presence_penalty, frequency_penalty,
        logit_bias as {token id: bias}); prompt i draws from `seed` + i (None: fresh randomness). `grammar`: every
        output held to it (moetier/engine/grammar.py: `Grammar.json_schema(schema)`, `Grammar.json_object()`)."""
        self._check_open()
        if self.adapt_variant is not None:  # a switch of variant asked for while the last call ran
            self.adapt_variant.apply()
        ids = self.encode(prompts)
        params = sampling_params(max_new_tokens, temperature, top_p, seed, **sampling)
        streams = [TextStream(self.tokenizer) for _ in ids] if on_text and self.tokenizer else None

        def emit(b: int, out: list[int]) -> None:
            if on_token is not None:
                on_token(b, out)
            if streams is not None:
                delta = streams[b].delta(out)
                if delta:
                    on_text(b, delta)

        stats = GenerationStats(expert_cache_bytes=self.executor.reserved_bytes, expert_slots=self.executor.slots,
                                total_expert_bytes=self.store.total_expert_bytes())
        eos = () if ignore_eos else self.spec.eos_token_ids
        tier = self.host_tier.counts if self.host_tier is not None else None
        before = dataclasses.replace(tier) if tier is not None else None
        outputs, stats = generate(self.model, self.executor, ids, params, eos, emit, stats, self.step_hooks, grammar,
                                  self.tokenizer, self.config.speculation, self.kept_kv)
        texts = [self.tokenizer.decode(o) for o in outputs] if self.tokenizer else [""] * len(outputs)
        summary = stats.summary()
        summary["dense_bytes"] = self.dense_bytes
        if tier is not None:  # the device's loads: found in host memory, or read from disk (this call's)
            summary["host_tier"] = {"hits": tier.hits - before.hits, "reads": tier.reads - before.reads,
                                    "bytes_read": tier.bytes_read - before.bytes_read}
        return GenerationOutput(texts, outputs, summary)

    def chat(self, messages: list[dict], max_new_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0,
             seed: int | None = 0, on_text=None, **sampling) -> str:
        """The assistant's answer to `messages` ([{"role": "user", "content": "..."}, ...]), the conversation
        rendered with the model's chat template. `on_text(delta)` streams it. Sampling as `generate`'s."""
        self._check_open()
        if self.tokenizer is None or self.tokenizer.chat_template is None:
            raise MoetierError(f"{self.store.path} has no chat template",
                               hint="chat needs tokenizer_config.json's chat_template (or chat_template.jinja); "
                                    "generate continues plain text")
        prompt = self.tokenizer.encode(self.tokenizer.chat_template.render(messages), add_bos=False)
        out = self.generate([prompt], max_new_tokens, temperature, top_p, seed,
                            on_text=(lambda _, delta: on_text(delta)) if on_text else None, **sampling)
        return out.texts[0]

    def tune_substitution(self, budget_s: float, prompts: str | list[str] | list[list[int]], tokens: int = 24,
                          alphas: tuple[float, ...] = CALIBRATION_ALPHAS, progress: bool = False) -> AlphaChoice:
        """SMoE §V-C: decode `tokens` tokens at each α of `alphas` (after one warm-up run, so every point starts
        from a warm cache), fit T(α), and set the substitution's α to the smallest that meets the TPOT budget — or,
        if none does, to the fastest (the choice says by how much the budget is missed). Each run continues the
        text the one before produced, so every point meets new tokens, as a generation does (repeating one
        continuation measured a cache tuned to it: 20% optimistic on demo-deep-xl)."""
        from moetier.progress import tqdm

        self._check_open()
        stage = self.executor.substitution
        if stage is None:
            raise MoetierError("this engine substitutes nothing, so there is no alpha to tune",
                               hint="make it with substitution=Substitution() (--substitute auto)")
        bar = tqdm(total=len(alphas) + 1, desc="calibrating alpha", unit="run", disable=not progress, leave=False)

        text = [list(ids) for ids in self.encode(prompts)]  # (the caller's lists stay as they are)

        def measure(alpha: float) -> float:
            stage.alpha = alpha
            out = self.generate(text, max_new_tokens=tokens, ignore_eos=True)
            for ids, new in zip(text, out.token_ids):
                ids += new
            bar.update()
            return out.stats["tpot_s"]

        with bar:
            measure(alphas[0])  # warm-up: the cache fills
            choice = choose_alpha(measure, budget_s, alphas)
        stage.alpha = choice.alpha
        return choice

    def set_expert_memory(self, budget: str | MemoryBudget, asked: bool = True, order=None) -> BudgetChoice:
        """Resize the expert cache to `budget` ("2GiB", "40%", auto) between generate calls or steps, without
        restarting: the budget is planned as at start-up against the memory free now plus what the cache holds
        (so it may grow back into memory it gave up), shrinking evicts by the policy and gives the freed slots'
        pages back, growing adds slots. Refused (BudgetError, the cache unchanged) where the budget cannot fit.
        `asked`: the caller's budget, which `--adapt` then never grows past (False: --adapt's own resize).
        `order`: which experts leave first when it shrinks (None: the policy's; --adapt's: CoMoE Eq. 18).
        Returns the new choice (its `note` says what was reserved)."""
        self._check_open()
        budget = MemoryBudget.parse(budget)  # (refuses what is not a budget: None, -1, nan, ...)
        choice = self._replan(self.store, budget)
        slot = self.executor.residency.entry_bytes[self.executor.precision]
        if choice.cache_bytes < self.executor.tier_bytes + self.spec.top_k * slot:
            raise BudgetError(f"{choice.note.split(';')[0]}: less than the low tier and one layer's top-k beside it",
                              hint="give more memory, or run without the low tier")
        self.executor.resize(choice.cache_bytes, order)
        self.budget = choice
        if asked and self.adapt is not None:
            self.adapt.ceiling = self.executor.slots
        return choice

    def _replan(self, store: Store, budget: MemoryBudget) -> BudgetChoice:
        """`budget` for `store`'s experts, planned as at start-up against the memory free now plus what the dense
        weights and the cache hold (given up to re-plan, then taken again); the runtime and a server's KV rows are
        here already, counted in what the memory sees used."""
        now = device_memory(self.device)
        held = self.budget.cache_bytes + self.dense_bytes
        view = MemoryView(now.available + held, now.source, now.limit, now.used)
        return plan_budget(store, budget, view, self.precision, self.dense_bytes, held=RUNTIME_BYTES)

    def use_variant(self, model: str | Path) -> BudgetChoice:
        """Run another variant of this model from the next call on: the original or a merged store of it (`moetier
        merge`) — the same dense weights (checked by their checksums) and config but for the merge, so the dense
        weights, tokenizer and kernels stay and only the experts, the router's groups and the cache change. The cache
        keeps the bytes it has (at most every expert of the variant). Between calls, never during one. Everything
        that holds one store's experts is made again for the variant as a fresh engine on it would make it (CoMoE
        Algorithm 7: the coarse level's switch under the fine level's prediction, prefetch, eviction, precision and
        placement): the policy, the predictor (by name; a merged variant's scores grouped onto its principals), the
        precision pair with the variant's thresholds, the substitution stage, the host tier on a GPU. Refused where
        what the engine was handed holds one store's experts: a predictor object (an oracle of a trace) or a host
        tier made by the caller. Returns the new cache's budget choice."""
        self._check_open()
        if self._given_predictor or self._given_tier:
            raise MoetierError("this engine was handed a predictor or host tier made for one store's experts; a "
                               "variant needs its own", hint="name the predictor in the config instead, or run the "
                               "variant as its own model")
        new = Store(resolve_model(model, progress=False))
        check_variant(self.store, new)
        budget = self._replan(new, MemoryBudget("bytes", self.budget.cache_bytes))
        parts = self._parts(new, budget, self._policy(new, budget), None, self.model.w, self.model.kernels, None,
                            False, None)
        self._stop_reader()
        if getattr(self.model, "graphs", None) is not None:  # (the old model's: the new one captures its own; an
            self.model.graphs.close()  # encoder-decoder has none)
        self.executor.close()
        if self._own_tier and self.host_tier is not None:
            self.host_tier.close()
        self.store, self.spec, self.precision, self.reader = parts.store, parts.store.spec, parts.precision, parts.reader
        self._stop_reader = weakref.finalize(self, self.reader.close)
        self.host_tier, self._own_tier, self.host_note = parts.host_tier, parts.own_tier, parts.host_note
        self.executor, self.model, self.budget = parts.executor, parts.model, budget
        return budget

    def preload(self) -> int:
        """Fill the expert cache before generating (every expert, if the budget holds them all)."""
        self._check_open()
        return self.executor.preload()

    def close(self) -> None:
        """Stop the reader threads and hand the expert cache's memory back (at once: not when the engine object is
        collected); the engine refuses work afterwards. Closing twice is harmless."""
        if not self.closed:
            self.closed = True
            self._stop_reader()
            if getattr(self.model, "graphs", None) is not None:  # (their memory pools, before the cache's)
                self.model.graphs.close()
            if self.kept_kv is not None:
                self.kept_kv.clear()
            self.executor.close()
            if self._own_tier and self.host_tier is not None:
                self.host_tier.close()
            if self.cpu_share is not None:
                self.cpu_share.restore()
            self.blas_threads.restore()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
