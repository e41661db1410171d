"""The engine's mechanisms on a GPU (`--device cuda`), each against the same run on the CPU or exact mode: device
slots fed through fewer staging buffers than reads, quantized experts computed on the device from their codes,
prefetching, HOBBIT's mixed precision, SMoE's substitution, CPU-assisted compute (placement) and the command line.
Skipped where torch sees no CUDA device (CI has none); `bench/gpu/run.sh` runs them on the GPU machine."""

import shutil

import pytest
import torch

from moetier import Engine
from moetier.cli import main
from moetier.config import HostMemory, MemoryBudget
from moetier.engine.engine import EngineConfig
from moetier.engine.slots import DeviceSlots
from moetier.errors import MoetierError
from moetier.model.expert_kernels import make_expert_kernel
from moetier.model.kernels import make_kernels
from moetier.plan.precision import MixedPrecision
from moetier.plan.substitute import Substitution
from moetier.store.reader import ON_DEMAND, ExpertReader
from moetier.store.store import Store
from moetier.store.variants import add_precisions

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (bench/gpu/run.sh)")]


def prompts(vocab: int = 128) -> list[list[int]]:
    g = torch.Generator().manual_seed(9)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (7, 12)]


def tokens(path, device: str, memory: str = "30%", batch: bool = False, costs: list | None = None,
           **config) -> tuple[list, list]:
    """Each prompt's tokens (or the batch's) and the calls' statistics; `costs` gets the executor's RunningCosts."""
    with Engine(Store(path), EngineConfig(expert_memory=MemoryBudget.parse(memory), device=device, **config),
                progress=False) as engine:
        outs = [engine.generate(prompts(), max_new_tokens=12, ignore_eos=True)] if batch else \
            [engine.generate([p], max_new_tokens=12, ignore_eos=True) for p in prompts()]
        if costs is not None:
            costs.append(engine.executor.costs)
    return [ids for o in outs for ids in o.token_ids], [o.stats for o in outs]


def test_device_slots_hold_every_expert_through_fewer_staging_buffers(tiny_store):
    """More reads in flight than staging buffers: each slot still ends up with its own expert's bytes."""
    _, path = tiny_store("olmoe", num_hidden_layers=4)
    store = Store(path)
    keys = store.spec.expert_keys()
    slots = DeviceSlots(store.native_layout, len(keys), torch.device("cuda"), staging=2)
    with ExpertReader(store.path, 4, manifest=store.manifest) as reader:
        for slot, (layer, e) in enumerate(keys):
            reader.submit(store.manifest.blob(layer, e, store.manifest.native_precision), slots.read_target(slot),
                          slots.completions[slot], ON_DEMAND)
        got = {slot: {k: t.cpu() for k, t in slots.weights(slot).items()} for slot in range(len(keys))}
    torch.cuda.synchronize()
    for slot, (layer, e) in enumerate(keys):
        want = store.read_expert(layer, e)
        for name, t in want.items():
            assert torch.equal(got[slot][name], t), f"slot {slot} ({layer}, {e}) {name}"


@pytest.mark.parametrize("precision", ["int8", "int4", "int2"])
def test_quantized_experts_on_the_gpu_compute_what_the_cpu_computes(quantized, precision):
    store = Store(quantized)
    layer, e = store.spec.expert_keys()[0]
    w = store.read_expert(layer, e, precision)
    torch.manual_seed(0)
    x = torch.randn(5, store.spec.hidden_size, dtype=torch.bfloat16)
    weights = torch.rand(5, dtype=torch.bfloat16)
    cpu = make_expert_kernel(precision, make_kernels("auto", torch.bfloat16, torch.device("cpu")), torch.bfloat16,
                             store.spec)
    gpu = make_expert_kernel(precision, make_kernels("auto", torch.bfloat16, torch.device("cuda")), torch.bfloat16,
                             store.spec)
    want = torch.empty_like(x)
    cpu(want, x, w, weights)
    got = torch.empty_like(x, device="cuda")
    gpu(got, x.cuda(), {k: t.cuda() for k, t in w.items()}, weights.cuda())
    err = ((got.cpu().float() - want.float()).norm() / want.float().norm()).item()
    assert err < 2e-2, f"{precision}: relative error {err}"


def test_prefetching_on_the_gpu_leaves_the_output_exact(tiny_store):
    """HOBBIT's prefetches what its predictor names; PreSched weighs the link's cost (with every expert in host
    memory, priced from the copies' own time: the first GPU run found it never priced, so never prefetched)."""
    _, path = tiny_store("olmoe", num_hidden_layers=4)
    exact, _ = tokens(path, "cuda", "100%")
    got, stats = tokens(path, "cuda", "30%", prefetch="hobbit", predictor="stacked-gates")
    assert got == exact and sum(s["prefetches"]["issued"] for s in stats) > 0
    costs, disk = [], []
    got, stats = tokens(path, "cuda", "30%", costs=costs, prefetch="presched", predictor="stacked-gates")
    assert got == exact and costs[0].ready
    # a copy over PCIe, not a disk read: priced faster than the same experts read from disk with no host tier (a
    # floor of 1 GB/s failed on the 2026-11-30 H200: a tiny expert's copy is bound by its latency, 0.71 GB/s there)
    tokens(path, "cuda", "30%", costs=disk, prefetch="presched", predictor="stacked-gates",
           host_memory=HostMemory.parse("0"))
    assert disk[0].bandwidth and costs[0].bandwidth > disk[0].bandwidth, (costs[0].bandwidth, disk[0].bandwidth)


@pytest.mark.parametrize("batch", [False, True])
def test_exact_mode_on_the_gpu_writes_the_cpus_tokens_single_and_batched(tiny_store, batch):
    _, path = tiny_store("qwen2_moe", num_hidden_layers=4)
    assert tokens(path, "cuda", batch=batch)[0] == tokens(path, "cpu", batch=batch)[0]


@pytest.fixture(scope="module")
def quantized_fp32(tiny_store, tmp_path_factory):
    """An fp32 four-layer OLMoE with int4 copies. In bf16 two kernels' roundings route a token differently now and
    then, and from there the plans part: on the 2026-11-30 H200 the GPU (Triton's int4 experts) made 27 loads where
    the CPU (torch's ops) made 30, as the CPU's own native kernels and torch's ops do on a CPU (22 and 32 against 23
    and 28). In fp32 both make the same plans there, so a difference is the GPU's planning, not a rounding."""
    _, path = tiny_store("olmoe", num_hidden_layers=4)
    dest = tmp_path_factory.mktemp("quantized_fp32") / "store"
    shutil.copytree(path, dest)
    add_precisions(dest, "int4", progress=False)
    return dest


def test_mixed_precision_on_the_gpu_runs_the_cpus_plans(quantized_fp32):
    mixed = MixedPrecision("hobbit")
    got, stats = tokens(quantized_fp32, "cuda", "40%", precision=mixed)
    want, cpu_stats = tokens(quantized_fp32, "cpu", "40%", precision=mixed, kernels="torch")
    for a, b in zip(stats, cpu_stats):  # the same plans: as many loads at each precision
        assert a["decode"]["loads"] == b["decode"]["loads"] and a["expert_bytes_read"] == b["expert_bytes_read"]
    assert sum(x == y for x, y in zip(sum(got, []), sum(want, []))) >= 0.8 * len(sum(want, []))


def test_substitution_on_the_gpu_runs_the_cpus_plans(tiny_store):
    _, path = tiny_store("qwen2_moe", num_hidden_layers=4)
    sub = Substitution(alpha=0.5)
    got, stats = tokens(path, "cuda", "50%", substitution=sub)
    want, cpu_stats = tokens(path, "cpu", "50%", substitution=sub)
    assert got == want
    assert [s["decode"]["substituted"] for s in stats] == [s["decode"]["substituted"] for s in cpu_stats]


@pytest.mark.parametrize("placement", ["smoe-two-pointer", "prescope", "greedy", "hobbit-coop", "cpu-offload"])
def test_cpu_assisted_compute_beside_the_gpu_is_exact(tiny_store, placement):
    """Experts the plan puts on the host are computed by the CPU from host memory and their outputs copied back."""
    _, path = tiny_store("qwen2_moe", num_hidden_layers=4)
    exact, _ = tokens(path, "cuda", "100%")
    extra = {"prefetch": "presched", "predictor": "stacked-gates"} if placement == "prescope" else {}
    costs = []
    got, stats = tokens(path, "cuda", "25%", costs=costs, placement=placement, **extra)
    assert got == exact
    host_runs = sum(s["decode"]["host_runs"] + s["prefill"]["host_runs"] for s in stats)
    if placement in ("hobbit-coop", "cpu-offload"):  # by rule: every decode miss on the CPU
        assert host_runs > 0
    else:  # by cost: loads (copies over PCIe) priced beside the host's computes, whichever wins
        assert costs[0].placement_ready


def test_generate_on_the_gpu_from_the_command_line(capsys):
    """The shipped demo model (bf16) with its experts on disk and a 30% cache on the GPU."""
    import json

    assert main(["generate", "--model", "demo-fine", "--prompt", "It was a fine morning, and", "--max-tokens", "12",
                 "--ignore-eos", "--device", "cuda", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["token_ids"][0]) == 12 and out["stats"]["decode"]["loads"] > 0


@pytest.mark.parametrize("host", ["0", "40%", "auto"])
def test_the_gpu_cache_with_or_without_the_host_tier_behind_it_is_exact(tiny_store, host):
    """No host tier (every miss read from disk through staging buffers), a host tier holding 40% of the experts
    (misses read from disk into it, then copied), and one holding them all (filled at start-up, every load a copy
    from page-locked memory)."""
    _, path = tiny_store("olmoe", num_hidden_layers=4)
    exact, _ = tokens(path, "cuda", "100%")
    got, stats = tokens(path, "cuda", "25%", host_memory=HostMemory.parse(host))
    assert got == exact
    tiers = [s.get("host_tier") for s in stats]
    if host == "0":
        assert tiers == [None, None]
    elif host == "auto":
        assert all(t["reads"] == 0 and t["hits"] > 0 for t in tiers)
    else:
        assert sum(t["reads"] for t in tiers) > 0 and sum(t["hits"] for t in tiers) > 0


@pytest.mark.parametrize("order, host", [("demand-first", "auto"), ("demand-first", "40%"), ("fifo", "auto")])
def test_prefetch_copies_held_for_the_link_or_queued_when_asked_leave_the_output_exact(tiny_store, order, host):
    """engine/copy_queue.py on a real copy stream: prefetch copies held on the host until the link has room (and
    fed while the host waits for each layer's routing), or queued when asked (the first runs' order)."""
    _, path = tiny_store("olmoe", num_hidden_layers=4)
    exact, _ = tokens(path, "cuda", "100%")
    config = EngineConfig(expert_memory=MemoryBudget.parse("25%"), device="cuda", prefetch="hobbit",
                          predictor="stacked-gates", host_memory=HostMemory.parse(host))
    with Engine(Store(path), config, progress=False, copy_order=order) as engine:
        outs = [engine.generate([p], max_new_tokens=12, ignore_eos=True) for p in prompts()]
    assert [ids for o in outs for ids in o.token_ids] == exact
    assert sum(o.stats["prefetches"]["issued"] for o in outs) > 0


def test_an_auto_budget_on_the_gpu_is_sized_from_the_devices_free_memory(tiny_store):
    """`--expert-memory auto` with `--device cuda`: the cache from what the device has free (torch.cuda.mem_get_info;
    every expert of a tiny model on a GPU of tens of GB), the tokens exact."""
    _, path = tiny_store("olmoe", num_hidden_layers=4)
    exact, _ = tokens(path, "cuda", "100%")
    with Engine(Store(path), EngineConfig(expert_memory=MemoryBudget.parse("auto"), device="cuda"),
                progress=False) as engine:
        assert engine.budget.slots == engine.spec.num_expert_keys
        assert "cuda" in engine.budget.note  # (the device's memory described, not the host's)
        got = [ids for p in prompts() for ids in engine.generate([p], max_new_tokens=12, ignore_eos=True).token_ids]
    assert got == exact


def test_closing_a_gpu_engine_hands_its_expert_cache_back_to_the_device(tiny_store):
    """`close` empties the cache's device blocks whatever still names the engine."""
    _, path = tiny_store("olmoe", num_hidden_layers=4)
    with Engine(Store(path), EngineConfig(expert_memory=MemoryBudget.parse("50%"), device="cuda"),
                progress=False) as engine:
        engine.generate([[1, 2, 3]], max_new_tokens=2)
        cache = engine.executor.pool.num_slots * engine.executor.pool.slot_bytes
        assert torch.cuda.memory_allocated() >= cache
        during = torch.cuda.memory_allocated()
    assert torch.cuda.memory_allocated() <= during - cache  # (`engine` still names the slots)


def test_the_host_tier_is_page_locked(tiny_store):
    _, path = tiny_store("olmoe", num_hidden_layers=4)
    with Engine(Store(path), EngineConfig(expert_memory=MemoryBudget.parse("25%"), device="cuda"),
                progress=False) as engine:
        tier = engine.host_tier
        native = engine.store.manifest.native_precision
        assert tier.holds(native) and tier.pools[native].region(0).is_pinned()


def triton_against_torch(path, precision: str, kind) -> None:
    """`--kernels auto` (Triton's two launches a layer, `kind`'s; at 100% from the router's ids on the device, the
    routing never read back to the host; each norm and rotation one launch) against `--kernels torch` on the same
    model: the same greedy tokens but where bf16's rounding tips one."""
    for memory in ("30%", "100%"):
        got = []
        for kernels in ("auto", "torch"):
            config = EngineConfig(expert_memory=MemoryBudget.parse(memory), device="cuda", kernels=kernels)
            with Engine(Store(path), config, progress=False) as engine:
                engine.preload()
                got.append(engine.generate(prompts(), max_new_tokens=12, ignore_eos=True).token_ids)
                triton = isinstance(engine.executor.expert_kernels[precision], kind)
                assert triton == (kernels == "auto") == (engine.kernels.name == "triton")  # (norms, rotations too)
                if memory == "100%":
                    assert (engine.executor.resident_layers.tables is not None) == triton
        a, b = sum(got[0], []), sum(got[1], [])
        assert sum(x == y for x, y in zip(a, b)) >= 0.8 * len(b), memory


def test_a_bf16_models_experts_through_triton_write_what_torchs_ops_write(tiny_store):
    from moetier.model.triton_experts import TritonExperts

    _, path = tiny_store("olmoe", torch.bfloat16, num_hidden_layers=4, intermediate_size=64)
    triton_against_torch(path, "bf16", TritonExperts)


def test_a_q4_k_m_gguf_s_experts_through_triton_write_what_torchs_ops_write(tmp_path):
    """A GGUF's experts as a Q4_K_M file keeps them (gate and up Q4_K; down Q6_K in layer 0, Q5_0 in layer 1, as
    where a row is not whole 256-blocks), computed from their blocks by Triton against torch's ops on the blocks
    dequantized."""
    from moetier.model.triton_experts import TritonGgmlExperts
    from moetier.store.gguf_store import index_gguf
    from tests.store import gguf_export
    from tests.tiny_models import build_tiny

    build_tiny("olmoe", tmp_path / "hf", hidden_size=256, intermediate_size=256, num_attention_heads=4,
               num_key_value_heads=4, num_layers=2)
    path = gguf_export.export(tmp_path / "hf", tmp_path / "q4_k_m.gguf", {0: ("q4_k", "q6_k"), 1: ("q4_k", "q5_0")},
                              dense_type="bf16")
    triton_against_torch(index_gguf(path, tmp_path / "store", progress=False), "q4_k", TritonGgmlExperts)


@pytest.mark.parametrize("source", ["mxfp4-gguf", "bf16-checkpoint"])
def test_gpt_oss_experts_through_triton_write_what_torchs_ops_write(tmp_path, tiny_store, source):
    """gpt-oss's clamped SwiGLU experts with their biases in Triton's two launches a layer: from a GGUF's MXFP4
    blocks and fp32 biases read in place, and from its checkpoint's bf16 store, against torch's ops on the same."""
    from moetier.model.triton_experts import TritonExperts, TritonGgmlExperts
    from moetier.store.gguf_store import index_gguf
    from tests.store import gguf_export
    from tests.tiny_models import build_tiny

    shape = dict(hidden_size=256, intermediate_size=256, swiglu_limit=7.0)
    if source == "bf16-checkpoint":
        triton_against_torch(tiny_store("gpt_oss", torch.bfloat16, **shape)[1], "bf16", TritonExperts)
    else:
        build_tiny("gpt_oss", tmp_path / "hf", **shape)
        path = gguf_export.export(tmp_path / "hf", tmp_path / "mxfp4.gguf", {0: ("MXFP4", "MXFP4"),
                                  1: ("MXFP4", "MXFP4")}, dense_type="bf16")
        triton_against_torch(index_gguf(path, tmp_path / "store", progress=False), "mxfp4", TritonGgmlExperts)


def test_cuda_graphs_replay_the_layer_by_layer_steps(tiny_store):
    """`--cuda-graphs`: with every expert resident, each decode step of one sequence, and of a batch of two,
    replayed from a graph (one a number of sequences and a bucket of keys); at 30% (planned layers read their
    routing back) each layer's dense part replayed from a graph, the engine's experts between. The same greedy
    tokens as the steps layer by layer but where bf16's rounding tips one (the graphs' attention sums over their
    bucket's keys, those past the token masked); the engine's KV cache kept from one call to the next of the same
    rows, so the second prompt replays the graphs the first captured."""
    from moetier.model.kernels import triton_installed

    if not triton_installed():
        pytest.skip("a resident token's experts are computed on the device through Triton's tables")
    with pytest.raises(MoetierError, match="through Triton's kernels"):
        EngineConfig(device="cuda", cuda_graphs=True, kernels="torch")
    _, path = tiny_store("olmoe", torch.bfloat16, num_hidden_layers=4, intermediate_size=64)
    got, status = {}, {}
    for memory, graphs in (("100%", False), ("100%", True), ("30%", False), ("30%", True)):
        config = EngineConfig(expert_memory=MemoryBudget.parse(memory), device="cuda", cuda_graphs=graphs)
        with Engine(Store(path), config, progress=False) as engine:
            engine.preload()
            got[memory, graphs] = [engine.generate([p], max_new_tokens=12, ignore_eos=True).token_ids[0]
                                   for p in prompts()]
            got[memory, graphs] += engine.generate(prompts(), max_new_tokens=4, ignore_eos=True).token_ids
            if graphs:
                status[memory] = dict(engine.model.graphs.status)
        if graphs:
            assert engine.model.graphs.graphs == {} == engine.model.graphs.parts.chains  # closing the engine drops
            # them (their memory pools)
    # 11 decode steps of each prompt alone (a kept cache of 256: one bucket), then 3 of both (a cache of two rows)
    assert status["100%"]["off"] is None and status["30%"]["parts"]["off"] is None, status
    assert (status["100%"]["replayed"], status["100%"]["captured"]) == (2 * 11 + 3, 2)
    assert (status["30%"]["parts"]["replayed"], status["30%"]["parts"]["captured"]) == (2 * 11 + 3, 2)
    assert status["30%"]["replayed"] == 0
    for memory in ("100%", "30%"):
        a, b = sum(got[memory, True], []), sum(got[memory, False], [])
        assert sum(x == y for x, y in zip(a, b)) >= 0.9 * len(b), memory
