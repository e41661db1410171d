"""What a GPU decode step asks of the host, counted without a GPU: the kernels it launches. On the H200 a launch
cost the host 10–24 us and an OLMoE decode step made ~1,700 of them (bench/gpu/results/2026-11-27-h200/); here the
same step's path runs on the CPU (CUDA's streams and events stood in for, triton in its interpreter) and every aten
op that would launch a kernel on a GPU is counted with the Triton launches. Skipped where triton is not installed,
or where its interpreter cannot run (tests/triton_here.py)."""

import collections
import os

import pytest
import torch

from tests.triton_here import why_not

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # (before triton is first imported)
WHY_NOT = why_not(interpreter_only=True)
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from tests.engine.test_host_tier import FakePinning, cuda_stand_ins  # noqa: E402, F401

# aten ops that launch nothing on a GPU: views, aliases, allocations
NO_LAUNCH = {"view", "slice", "unsqueeze", "squeeze", "select", "alias", "detach", "reshape", "expand", "transpose",
             "t", "split", "chunk", "split_with_sizes", "_unsafe_view", "as_strided", "permute", "lift_fresh",
             "resolve_conj", "resolve_neg", "empty", "empty_like", "new_empty"}
MAYBE = {"to", "contiguous"}  # a copy (one launch) where it makes a new tensor; the tensor itself where not


class Launches(TorchDispatchMode):
    """Counts, by name, the aten ops that launch a kernel (a cast or `contiguous` only where it copies) and the
    Triton launches (`triton`, by the wrapper below); the ops inside a Triton launch (the interpreter's own) are not
    the GPU's."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()
        self.inside = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        out = func(*args, **(kwargs or {}))
        if not self.inside and name not in NO_LAUNCH and (name not in MAYBE or out is not args[0]):
            self.counts[name] += 1
        return out


@pytest.fixture
def launches(monkeypatch):
    """A fresh `Launches` each `with`, Triton's interpreted launches counted into the one in use."""
    import triton.runtime.interpreter as interpreter

    active: list[Launches] = []
    run = interpreter.InterpretedFunction.run

    def counted(self, *args, **kwargs):
        if active:  # (counted by the innermost; the interpreter's own ops by none)
            active[-1].counts["triton:" + self.fn.__name__] += 1
        for counting in active:
            counting.inside += 1
        try:
            return run(self, *args, **kwargs)
        finally:
            for counting in active:
                counting.inside -= 1

    monkeypatch.setattr(interpreter.InterpretedFunction, "run", counted)

    class Counting(Launches):
        def __enter__(self):
            active.append(self)
            return super().__enter__()

        def __exit__(self, *exc):
            active.pop()
            return super().__exit__(*exc)

    return Counting


# a family's tiny model with tiles that fit, and the most launches a MoE layer on Triton (at 25%: the copies of its
# misses among them), with how many times that torch's ops launch at least
MODELS = {"olmoe": (dict(num_experts=64, num_experts_per_tok=8), {"100%": 25, "25%": 33}, 3.5),
          "gpt_oss": (dict(num_local_experts=32, num_experts_per_tok=4, swiglu_limit=7.0,
                           layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
                      {"100%": 33, "25%": 40}, 2.5)}


@pytest.mark.usefixtures("cuda_stand_ins")  # (test_host_tier's: the CUDA calls of the device slots made no-ops)
@pytest.mark.parametrize("family", list(MODELS))
@pytest.mark.parametrize("budget", ["100%", "25%"])
def test_a_bf16_decode_step_on_triton_launches_a_fraction_of_what_torchs_ops_do(tiny_store, monkeypatch, launches,
                                                                             family, budget):
    """OLMoE's shape of layer (q and k norms, eight of 64 experts) and gpt-oss's (clamped experts with biases,
    attention sinks, norms with their weight in fp32) behind a whole host tier: a decode step through TritonKernels
    (experts in two launches a layer, each norm with the residual add before it and each rotation one, the KV writes
    one) against CudaKernels (torch's ops for all): with every expert resident (the step computed from the router's
    ids on the device; counted here for OLMoE 23 a MoE layer against 119, gpt-oss 32 against 110 — 97 before its
    experts and norms went to Triton) and at a quarter of them (the planned path, its misses' copies among the
    launches: 31 against 121, and 38 against 110), the step's own launches (embedding, final norm, head) shared by 3
    layers."""
    from moetier import Engine
    from moetier.config import MemoryBudget
    from moetier.engine import engine as engine_module
    from moetier.engine.engine import EngineConfig
    from moetier.engine.host_tier import HostTier
    from moetier.model.kernels import CudaKernels, TorchKernels, TritonKernels
    from moetier.store.reader import ExpertReader
    from moetier.store.store import Store

    overrides, most, times = MODELS[family]
    _, path = tiny_store(family, dtype=torch.bfloat16, hidden_size=128, intermediate_size=64, num_hidden_layers=3,
                         **overrides)
    store = Store(path)
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(3, 128, (12,), generator=g).tolist()
    steps = 3

    def per_layer(kernels_class) -> tuple[float, list[int], collections.Counter]:
        class OnTheCpu(kernels_class):
            def decode_attention(self, *args):  # (the GPU's SDPA backends list is CUDA's)
                return TorchKernels.decode_attention(self, *args)

        monkeypatch.setattr(engine_module, "make_kernels", lambda *args: OnTheCpu())
        keys, native = store.spec.expert_keys(), store.manifest.native_precision
        tier = HostTier(store.manifest, keys, {native: len(keys)}, FakePinning())
        with ExpertReader(store.path, 2, manifest=store.manifest) as reader:
            tier.fill(reader, progress=False)
        config = EngineConfig(expert_memory=MemoryBudget.parse(budget), kernels="torch")
        with Engine(store, config, progress=False, host_tier=tier) as engine:
            if budget == "100%":
                engine.preload()
            engine.generate([prompt], max_new_tokens=2, ignore_eos=True)  # (warm: the cache and the rope tables)
            with launches() as prefill:
                engine.generate([prompt], max_new_tokens=1, ignore_eos=True)
            with launches() as whole:
                tokens = engine.generate([prompt], max_new_tokens=steps + 1, ignore_eos=True).token_ids[0]
        decode = whole.counts - prefill.counts
        return sum(decode.values()) / steps / len(store.spec.moe_layers), tokens, decode

    ours, tokens, decode = per_layer(TritonKernels)
    theirs, want, _ = per_layer(CudaKernels)
    assert decode["triton:rms_norm_kernel"] and decode["triton:rope_kernel"] and decode["triton:gate_up"]
    assert ours <= most[budget] and theirs >= times * ours, (ours, theirs, decode)
    assert sum(a == b for a, b in zip(tokens, want)) >= len(want) - 1


PARTS_UNUSED = {"captured": 0, "replayed": 0, "off": None}  # (every expert resident: the whole step a graph)

# ops that read a tensor's values back to the host: a CUDA graph's capture fails on them (or bakes the value in)
READ_BACKS = {"_local_scalar_dense", "item", "nonzero", "is_nonzero", "equal", "unique", "_unique2", "masked_select",
              "_assert_async"}


@pytest.mark.usefixtures("cuda_stand_ins")
def test_a_graphed_resident_step_on_triton_reads_nothing_back_and_writes_the_layer_by_layer_tokens(
        tiny_store, monkeypatch, launches):
    """`--cuda-graphs`' step (moetier/model/decode_graphs.py) on TritonKernels with every expert resident, behind a
    whole host tier as on a GPU: captured by a stand-in that watches its ops and replays it eagerly into the same
    outputs. The captured step computes each layer's experts from the Triton tables (the router's ids on the
    device), makes no op that reads a value back to the host, and the tokens are the layer-by-layer step's (its attention summed over the graph's bucket of keys, bf16: but where a rounding
    tips one)."""
    from moetier import Engine
    from moetier.config import MemoryBudget
    from moetier.engine import engine as engine_module
    from moetier.engine.engine import EngineConfig
    from moetier.engine.host_tier import HostTier
    from moetier.model.decode_graphs import DecodeGraphs
    from moetier.model.kernels import TorchKernels, TritonKernels
    from moetier.store.reader import ExpertReader
    from moetier.store.store import Store
    from tests.model.test_decode_graphs import Replayed

    _, path = tiny_store("olmoe", dtype=torch.bfloat16, hidden_size=128, intermediate_size=64, num_hidden_layers=2)
    store = Store(path)
    g = torch.Generator().manual_seed(5)
    prompt, second = (torch.randint(3, 128, (n,), generator=g).tolist() for n in (6, 3))

    class OnTheCpu(TritonKernels):
        def decode_attention(self, *args):  # (the GPU's SDPA backends list is CUDA's)
            return TorchKernels.decode_attention(self, *args)

    class Watched:
        def __init__(self) -> None:
            self.seen: list[collections.Counter] = []

        def __call__(self, step, pool=None):
            with launches() as seen:
                outputs = step()
            self.seen.append(seen.counts)
            return Replayed(step, outputs), outputs

    monkeypatch.setattr(engine_module, "make_kernels", lambda *args: OnTheCpu())
    keys, native = store.spec.expert_keys(), store.manifest.native_precision
    got = []
    for graphed in (False, True):
        tier = HostTier(store.manifest, keys, {native: len(keys)}, FakePinning())
        with ExpertReader(store.path, 2, manifest=store.manifest) as reader:
            tier.fill(reader, progress=False)
        with Engine(store, EngineConfig(expert_memory=MemoryBudget.parse("100%"), kernels="torch"), progress=False,
                    host_tier=tier) as engine:
            engine.preload()
            watched = Watched()
            graphs = engine.model.graphs = DecodeGraphs.make(engine.model, watched, shortest=8) if graphed else None
            got.append(engine.generate([prompt], max_new_tokens=5, ignore_eos=True).token_ids[0])
            assert engine.executor.resident_layers.tables is not None  # (Triton's tables: the device's routing)
            if graphed:  # 6 tokens and 4 decode steps: sequences of 7, 8 (the bucket of 8), 9 and 10 (of 16)
                assert graphs.status == {"captured": 2, "replayed": 4, "off": None, "parts": PARTS_UNUSED}
            # two sequences a step: each (token, expert) pair on its own row of the Triton tables, no grouping
            got += engine.generate([prompt, second], max_new_tokens=3, ignore_eos=True).token_ids
            if graphed:  # 2 steps of two sequences, the longer 7 and 8 long: a graph for two, of 8 keys
                assert graphs.status == {"captured": 3, "replayed": 6, "off": None, "parts": PARTS_UNUSED}
    assert len(watched.seen) == 3
    for captured in watched.seen:
        assert not READ_BACKS & set(captured), captured
        assert captured["triton:gate_up"] == captured["triton:down"] == len(store.spec.moe_layers)
        assert captured["triton:rms_norm_kernel"] and captured["triton:rope_kernel"]
    plain, graphed = got[:3], got[3:]  # (one sequence, then two: the layer-by-layer steps', then the graphs')
    for a, b in zip(plain, graphed):
        assert sum(x == y for x, y in zip(a, b)) >= len(a) - 1, got


@pytest.mark.usefixtures("cuda_stand_ins")
def test_graphed_dense_parts_of_a_planned_step_leave_the_host_its_experts_launches(tiny_store, monkeypatch,
                                                                                 launches):
    """`--cuda-graphs` at a quarter of the experts (moetier/model/part_graphs.py), OLMoE's shape on TritonKernels
    behind a whole host tier: each dense part between two MoE layers' experts captured by a stand-in that watches
    its ops and replays it eagerly. What the host launches itself a MoE layer — the layer's expert launches and its
    misses' copies, a replay and the copy of the experts' output — against the layer-by-layer step's; the parts read
    nothing back; the tokens are the layer-by-layer step's."""
    from moetier import Engine
    from moetier.config import MemoryBudget
    from moetier.engine import engine as engine_module
    from moetier.engine.engine import EngineConfig
    from moetier.engine.host_tier import HostTier
    from moetier.model.decode_graphs import DecodeGraphs
    from moetier.model.kernels import TorchKernels, TritonKernels
    from moetier.store.reader import ExpertReader
    from moetier.store.store import Store
    from tests.model.test_decode_graphs import Replayed

    _, path = tiny_store("olmoe", dtype=torch.bfloat16, hidden_size=128, intermediate_size=64, num_hidden_layers=3,
                         num_experts=64, num_experts_per_tok=8)
    store = Store(path)
    layers = len(store.spec.moe_layers)
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(3, 128, (12,), generator=g).tolist()
    steps = 3

    class OnTheCpu(TritonKernels):
        def decode_attention(self, *args):  # (the GPU's SDPA backends list is CUDA's)
            return TorchKernels.decode_attention(self, *args)

    captured: list[collections.Counter] = []
    replayed: collections.Counter = collections.Counter()  # what the captures and replays ran (a replay is one
    # launch on a GPU, a capture none after the first step)
    replays: list = []

    class Quiet(Replayed):
        def replay(self) -> None:
            with launches() as inside:  # (the Triton launches counted here alone, aten's here and outside)
                super().replay()
            replayed.update(inside.counts)
            replays.append(self)

    def watch(step, pool=None):
        with launches() as seen:  # (as with the replays: its aten ops are counted outside too)
            outputs = step()
        captured.append(seen.counts)
        replayed.update(seen.counts)
        return Quiet(step, outputs), outputs

    monkeypatch.setattr(engine_module, "make_kernels", lambda *args: OnTheCpu())
    keys, native = store.spec.expert_keys(), store.manifest.native_precision

    def per_layer(graphed: bool) -> tuple[float, list[int], DecodeGraphs | None]:
        tier = HostTier(store.manifest, keys, {native: len(keys)}, FakePinning())
        with ExpertReader(store.path, 2, manifest=store.manifest) as reader:
            tier.fill(reader, progress=False)
        config = EngineConfig(expert_memory=MemoryBudget.parse("25%"), kernels="torch")
        with Engine(store, config, progress=False, host_tier=tier) as engine:
            graphs = engine.model.graphs = DecodeGraphs.make(engine.model, watch, shortest=32) if graphed else None
            engine.generate([prompt], max_new_tokens=2, ignore_eos=True)  # (warm; the chain of 32 keys captured)
            replayed.clear()
            replays.clear()
            with launches() as prefill:
                engine.generate([prompt], max_new_tokens=1, ignore_eos=True)
            with launches() as whole:
                tokens = engine.generate([prompt], max_new_tokens=steps + 1, ignore_eos=True).token_ids[0]
            status = graphs.status["parts"] if graphed else None
        host = whole.counts - prefill.counts - replayed  # (Counter's difference: the host's own launches)
        host["graph replays"] = len(replays)
        return sum(host.values()) / steps / layers, tokens, status, host

    ours, tokens, status, host = per_layer(True)
    theirs, want, _, _ = per_layer(False)
    # each generate call a KV cache of its own: a chain captured each (of 32 keys), a replay each decode step
    assert status == {"captured": 2, "replayed": 1 + steps, "off": None}
    assert len(captured) == 2 * (layers + 1)  # a part a MoE layer and the head's
    for seen in captured:
        assert not READ_BACKS & set(seen), seen
        assert not seen["triton:gate_up"]  # (the experts are the engine's, between the parts)
    assert all(seen["triton:rms_norm_kernel"] and seen["triton:rope_kernel"]
               for chain in (captured[:layers + 1], captured[layers + 1:]) for seen in chain[:-1])
    # counted here: 18.6 a MoE layer (1.3 of them replays) against 31.2 layer by layer
    assert ours <= 20 and theirs >= 1.5 * ours, (ours, theirs, host)
    assert sum(a == b for a, b in zip(tokens, want)) >= len(want) - 1
