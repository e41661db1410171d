"""A decode step replayed as a CUDA graph (moetier/model/decode_graphs.py), held on the CPU with a stand-in capture
whose replay runs the captured step again and writes its results into the tensors the capture returned — what a
graph's replay does to its memory. The same tokens as the step layer by layer, the policy and the counters told the
same routes, a graph a bucket of keys, and every step no graph applies to left to the layers. (On a GPU:
tests/engine/test_cuda.py's `test_cuda_graphs_...`.)"""

import pytest
import torch
from torch.utils._pytree import tree_leaves

from moetier import Engine
from moetier.cli import main
from moetier.engine.engine import EngineConfig
from moetier.errors import MoetierError
from moetier.model.decode_graphs import DecodeGraphs, bucket

PROMPTS = [[3, 14, 15, 92, 65], [35, 89]]  # token ids (the tiny models have no tokenizer)


class Replayed:
    def __init__(self, step, outputs) -> None:
        self.step, self.outputs = step, outputs

    def replay(self) -> None:
        kept, new = (tree_leaves(o) for o in (self.outputs, self.step()))
        assert len(kept) == len(new)
        for a, b in zip(kept, new):
            if isinstance(a, torch.Tensor):
                a.copy_(b)


class EagerCapture:
    """The step run once (the capture); `replay` runs it again into the same outputs. Records the pools asked for."""

    def __init__(self) -> None:
        self.pools: list = []

    def __call__(self, step, pool=None):
        self.pools.append(pool)
        outputs = step()
        return Replayed(step, outputs), outputs


class FailingCapture:
    def __call__(self, step, pool=None):
        raise RuntimeError("operation not permitted when stream is capturing\nmore")


@pytest.fixture
def path(tiny_store):
    return tiny_store("olmoe")[1]


def run(path, graphs=None, memory="100%", prompts=PROMPTS[:1], tokens=40):
    engine = Engine.from_pretrained(path, expert_memory=memory, kernels="torch", progress=False)
    engine.preload()  # (at 100%: every expert resident from the first step)
    made = None
    if graphs is not None:
        made = engine.model.graphs = DecodeGraphs.make(engine.model, graphs, shortest=8)
    policy_heard = []
    policy = engine.executor.residency.policy
    on_route = policy.on_route
    policy.on_route = lambda route: (policy_heard.append((route.layer, route.topk_ids.tolist())), on_route(route))
    out = engine.generate(prompts, max_new_tokens=tokens, ignore_eos=True)
    status = None if made is None else {**made.status, "keys": sorted(keys for _, keys, _ in made.graphs),
                                        "note": made.note}
    engine.close()
    if made is not None:
        assert made.graphs == {} and made.off in (status["off"], "closed")  # closing drops them
    return out, status, policy_heard


def test_replayed_steps_write_the_layer_by_layer_tokens_and_tell_the_same_routes(path):
    plain, _, heard_plain = run(path)
    graphed, status, heard = run(path, EagerCapture())
    assert graphed.token_ids == plain.token_ids
    assert heard == heard_plain  # every layer's route, in order, each step
    assert graphed.stats["decode"] == plain.stats["decode"]  # the counters: layer steps, needed experts, hits
    assert graphed.stats["decode"]["hits"] > 0
    # a prompt of 5 tokens and 40 more: the lengths cross the 8, 16 and 32 buckets and the KV cache's 45, each
    # captured once
    assert status == {"captured": 4, "replayed": 39, "off": None, "keys": [8, 16, 32, 45],
                      "parts": {"captured": 0, "replayed": 0, "off": None},
                      "note": "CUDA graphs: 39 decode steps replayed from 4 captured"}


@pytest.mark.parametrize("memory", ["100%", "50%"])
def test_the_logits_are_the_layer_by_layer_steps(path, memory):
    """Attention over a bucket of keys, those past the token masked: the layer-by-layer step's logits, from the
    whole step's graph (every expert resident) or the dense parts' (half of them)."""
    from moetier.model.batch import StepBatch
    from moetier.model.kv_cache import KVCache

    engine = Engine.from_pretrained(path, expert_memory=memory, kernels="torch", progress=False)
    engine.preload()
    model, spec = engine.model, engine.spec
    graphs = DecodeGraphs.make(model, EagerCapture(), shortest=8)
    kv = KVCache(spec, 1, 64, model.dtype)
    prompt = [3, 14, 15, 92, 65]
    engine.executor.begin_step(0, _phases())
    model.forward(StepBatch.prefill([prompt], [0]), kv)
    for position, token in enumerate([35, 89, 79, 32, 38, 46], start=len(prompt)):
        batch = StepBatch.decode_step([token], [0], [position], 1)
        engine.executor.begin_step(1, _phases())
        plain = model.run_layers(batch, kv, model.ensure_rope(kv.max_len).tables(batch), model.experts)
        engine.executor.begin_step(1, _phases())
        replayed = graphs(batch, kv, model.ensure_rope(kv.max_len).tables(batch))
        torch.testing.assert_close(replayed, plain, rtol=1e-5, atol=1e-5)
    replayed = graphs if memory == "100%" else graphs.parts
    assert replayed.replayed == 6 and replayed.captured == 2  # buckets 8 (positions 5-7) and 16
    engine.close()


def _phases():
    from moetier.engine.stats import GenerationStats

    return GenerationStats().phases


@pytest.mark.parametrize("memory", ["25%", "50%"])
def test_below_100_percent_the_dense_parts_replay_and_the_engine_runs_the_experts_between(path, memory):
    """A layer's experts planned on the host (its routing read back): each dense part between two MoE layers' experts
    a graph, the engine's experts run between the replays — the same tokens, routes heard and counters (hits, loads)
    as layer by layer; one chain of parts (a graph a MoE layer and one for the head) a bucket, captured before any is
    replayed."""
    plain, _, heard_plain = run(path, memory=memory, tokens=20)
    capture = EagerCapture()
    graphed, status, heard = run(path, capture, memory=memory, tokens=20)
    assert graphed.token_ids == plain.token_ids
    assert heard == heard_plain
    assert graphed.stats["decode"] == plain.stats["decode"]
    assert 0 < graphed.stats["decode"]["hits"] < graphed.stats["decode"]["needed"]  # (some loads)
    layers = Engine.from_pretrained(path, progress=False).spec.num_layers
    # a prompt of 5 and 20 more: buckets 8, 16 and the cache's 25, each a chain
    assert status["parts"] == {"captured": 3, "replayed": 19, "off": None}
    assert status["captured"] == status["replayed"] == 0 and len(capture.pools) == 3 * (layers + 1)
    assert status["note"] == "CUDA graphs: 19 steps' dense parts replayed from 3 captured chains"


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen2_moe", "gpt_oss"])
def test_each_familys_dense_parts_replay_its_layer_by_layer_tokens(tiny_store, family):
    """A dense first layer inside part 0 and latent attention (DeepSeek-V3), a gated shared expert computed by the
    executor from a part's output (Qwen2-MoE), sinks and a sliding window over the bucket's keys (gpt-oss): at half
    the experts, the same tokens and routes as layer by layer."""
    path = tiny_store(family)[1]
    plain, _, heard_plain = run(path, memory="50%", tokens=12)
    graphed, status, heard = run(path, EagerCapture(), memory="50%", tokens=12)
    assert graphed.token_ids == plain.token_ids and heard == heard_plain
    assert status["parts"] == {"captured": 2, "replayed": 11, "off": None}  # (buckets 8 and 16)


def test_two_sequences_replay_as_one_step_of_each_kind(path):
    for memory in ("100%", "50%"):
        plain, _, heard_plain = run(path, memory=memory, prompts=PROMPTS, tokens=12)
        graphed, status, heard = run(path, EagerCapture(), memory=memory, prompts=PROMPTS, tokens=12)
        assert graphed.token_ids == plain.token_ids and heard == heard_plain
        assert status["replayed"] + status["parts"]["replayed"] == 11


@pytest.mark.parametrize("memory", ["100%", "50%"])
def test_a_kept_kv_cache_keeps_the_graphs_from_one_call_to_the_next(path, memory):
    """With `--cuda-graphs` the engine keeps a call's KV cache for the next (KeptCache): the second call of the same
    size replays the graphs the first captured, and writes the same tokens."""
    from moetier.engine.kv_pool import KeptCache

    plain, _, _ = run(path, memory=memory, tokens=12)
    engine = Engine.from_pretrained(path, expert_memory=memory, kernels="torch", progress=False)
    engine.preload()
    graphs = engine.model.graphs = DecodeGraphs.make(engine.model, EagerCapture(), shortest=8)
    engine.kept_kv = KeptCache(engine.spec, engine.model.dtype, "cpu", step=32)
    counts = graphs if memory == "100%" else graphs.parts
    outs = []
    for _ in range(2):
        outs.append(engine.generate(PROMPTS[:1], max_new_tokens=12, ignore_eos=True).token_ids)
        # 5 tokens and 11 decode steps (sequences of 6 to 16) in a cache of 32: buckets 8 and 16, captured by the
        # first call alone
        assert (counts.captured, counts.replayed) == (2, 11 * len(outs))
    assert outs == [plain.token_ids] * 2
    engine.close()
    assert engine.kept_kv.cache is None


def test_steps_no_graph_applies_to_run_layer_by_layer(path):
    # more sequences than a graph holds (ROWS): every step layer by layer
    prompts = [[3 + i, 14, 15] for i in range(9)]
    plain, _, _ = run(path, prompts=prompts, tokens=6)
    graphed, status, _ = run(path, EagerCapture(), prompts=prompts, tokens=6)
    assert graphed.token_ids == plain.token_ids
    assert status["replayed"] == status["parts"]["replayed"] == 0
    assert status["note"].startswith("CUDA graphs: no step replayed (they need at most 8 sequences, one token each")


def test_a_capture_that_fails_turns_graphs_off_and_the_step_runs_layer_by_layer(path):
    plain, _, _ = run(path, tokens=12)
    graphed, status, _ = run(path, FailingCapture(), tokens=12)
    assert graphed.token_ids == plain.token_ids
    assert status["off"] == "RuntimeError: operation not permitted when stream is capturing"
    assert status["note"] == ("CUDA graphs: no step replayed; turned off, a capture failed: the whole step's "
                              "(RuntimeError: operation not permitted when stream is capturing) (those steps ran "
                              "layer by layer)")
    assert status["captured"] == status["replayed"] == 0


class FailingLater(EagerCapture):
    """Captures the first `good` parts of a chain, then fails."""

    def __init__(self, good: int) -> None:
        super().__init__()
        self.good = good

    def __call__(self, step, pool=None):
        if len(self.pools) == self.good:
            raise RuntimeError("operation not permitted when stream is capturing")
        return super().__call__(step, pool)


def test_a_chain_that_fails_part_way_replays_nothing_and_the_step_runs_once_layer_by_layer(path):
    """The parts captured before the failure are never replayed: no layer's experts run twice (the counters are
    layer by layer's), the tokens are the same, and no later step tries again."""
    plain, _, heard_plain = run(path, memory="50%", tokens=12)
    capture = FailingLater(good=2)
    graphed, status, heard = run(path, capture, memory="50%", tokens=12)
    assert graphed.token_ids == plain.token_ids and heard == heard_plain
    assert graphed.stats["decode"] == plain.stats["decode"]
    assert status["parts"] == {"captured": 0, "replayed": 0,
                               "off": "RuntimeError: operation not permitted when stream is capturing"}
    assert len(capture.pools) == 2  # (tried once)


def test_no_graphs_where_the_kernels_take_positions_from_the_host():
    """The native kernels take a decode token's position and row from the host (a graph would replay the first's)."""
    from types import SimpleNamespace

    from moetier.model.kernels import NativeKernels, TorchKernels

    experts = SimpleNamespace(resident_on_device=lambda tokens: None, heard=None)
    for kernels, graphs in ((NativeKernels(lib=None), False), (TorchKernels(), True)):
        model = SimpleNamespace(kernels=kernels, experts=experts, device="cpu", dtype=torch.float32, is_moe=[True],
                                w={"embed_tokens": torch.zeros(4, 2)})
        assert (DecodeGraphs.make(model) is not None) == graphs
    assert DecodeGraphs.make(SimpleNamespace(kernels=TorchKernels(), experts=object(), device="cpu")) is None


@pytest.mark.parametrize(("length", "keys"), [(1, 256), (256, 256), (257, 512), (3000, 4096), (5000, 4096)])
def test_a_bucket_holds_the_sequence_and_no_more_than_the_cache(length, keys):
    assert bucket(length, 4096) == keys


def test_cuda_graphs_are_refused_on_the_cpu_in_one_line(path, capsys):
    with pytest.raises(MoetierError, match="replays a GPU's decode step"):
        EngineConfig(device="cpu", cuda_graphs=True)
    assert main(["generate", "--model", str(path), "--prompt", "x", "--cuda-graphs"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("moetier: error: --cuda-graphs replays a GPU's decode step") and err.count("\n") == 2


def test_the_capture_warms_up_on_a_side_stream_then_captures_thread_locally(monkeypatch):
    """CudaGraphCapture with CUDA's calls stood in for: the step run once on a side stream that waited for the
    current one, the current one waiting for it, then run once more inside `torch.cuda.graph` (whose real signature
    takes the thread-local error mode asked for); what the captured call returned is what the capture hands back."""
    import contextlib
    import inspect

    from moetier.model.decode_graphs import CudaGraphCapture

    assert {"pool", "capture_error_mode"} <= set(inspect.signature(torch.cuda.graph.__init__).parameters)
    events: list[str] = []

    class Stream:
        def __init__(self, name: str = "side") -> None:
            self.name = name

        def wait_stream(self, other) -> None:
            events.append(f"{self.name} waits for {other.name}")

    current = Stream("current")

    @contextlib.contextmanager
    def on(stream):
        events.append(f"on {stream.name}")
        yield
        events.append(f"off {stream.name}")

    class Graph:
        def replay(self) -> None:
            events.append("replay")

    @contextlib.contextmanager
    def graph(g, pool=None, capture_error_mode="global"):
        events.append(f"capture ({capture_error_mode}, pool {pool})")
        yield
        events.append("captured")

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: current)
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    calls = []

    def step():
        events.append("step")
        calls.append(object())
        return calls[-1]

    replay, outputs = CudaGraphCapture()(step, "chain's")
    assert outputs is calls[1] and isinstance(replay, Graph)
    assert events == ["side waits for current", "on side", "step", "off side", "current waits for side",
                      "capture (thread_local, pool chain's)", "step", "captured"]
