"""The native bf16 row kernels against torch's ops: the same numbers up to the last bit of an output near a
rounding boundary, on shapes with and without tails; the engine with them decodes as transformers does in bf16;
and every way of not having them is said."""

import shutil
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moetier.config import MemoryBudget, RopeSpec
from moetier.engine.engine import Engine, EngineConfig
from moetier.errors import MoetierError
from moetier.model import native
from moetier.model.batch import StepBatch
from moetier.model.kernels import NATIVE_ROWS, NativeKernels, NativeWithGemm, TorchKernels, make_kernels
from moetier.model.kv_cache import KVCache
from moetier.model.rope import Rope
from moetier.store.store import Store
from tests.model.isas import isa_params

CPU = torch.device("cpu")


@pytest.fixture(scope="module", params=isa_params())
def kernels(request) -> NativeKernels:
    """The native kernels built for each instruction set this CPU runs (the others skipped with the reason)."""
    loaded = native.load(request.param)
    assert loaded.lib is not None, loaded.reason
    return NativeKernels(loaded.lib)


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bf16 steps apart each pair of values is (both finite, same sign or zero)."""
    ia, ib = a.view(torch.int16).int(), b.view(torch.int16).int()
    return (ia - ib).abs()


def assert_linear_as_torch(ours: torch.Tensor, ref: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                           b: torch.Tensor | None) -> None:
    """fp32 sums in another order: a result may round the other way, never further — unless the sum cancels, where
    any order's fp32 error (K * 2^-24 of the sum of |terms|) can exceed a step of the small result: there ours must
    be as near the exact sum as fp32 summation allows (seen on a Zen 4, whose torch sums in yet another order)."""
    exact = x.double() @ w.double().T + (0 if b is None else b.double())
    terms = x.double().abs() @ w.double().abs().T + (0 if b is None else b.double().abs())
    allowed = terms * w.shape[1] * 2 ** -24 + exact.abs() * 2 ** -8  # the summation's error + bf16's half step
    near = (ours.double() - exact).abs() <= allowed
    assert bool(((ulps_apart(ours, ref) <= 1) | near).all()), (ours - ref).abs().max()


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 70), k=st.integers(1, 300), bias=st.booleans(), seed=st.integers(0, 2**16))
def test_linear_matches_torch(kernels, n, k, bias, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(1, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    ours, ref = kernels.linear(x, w, b), TorchKernels().linear(x, w, b)
    assert ours.shape == ref.shape and ours.dtype == torch.bfloat16
    assert_linear_as_torch(ours, ref, x, w, b)


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(2, 16), n=st.integers(1, 70), k=st.integers(1, 300), bias=st.booleans(),
       seed=st.integers(0, 2**16))
def test_a_batchs_rows_are_each_its_own_row_bit_for_bit(kernels, rows, n, k, bias, seed):
    """A decode batch's products (a server's sequences): each row what it would be alone, and near torch's."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(rows, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    together = kernels.linear(x, w, b)
    assert torch.equal(together, torch.cat([kernels.linear(x[t:t + 1], w, b) for t in range(rows)]))
    assert_linear_as_torch(together, TorchKernels().linear(x, w, b), x, w, b)


@pytest.mark.parametrize("hidden,intermediate", [(256, 128), (100, 130)])
def test_a_batchs_experts_are_each_token_alone_bit_for_bit(kernels, hidden, intermediate):
    g = torch.Generator().manual_seed(hidden)
    experts = [((torch.randn(2 * intermediate, hidden, generator=g) / hidden ** 0.5).bfloat16(),
                (torch.randn(hidden, intermediate, generator=g) / intermediate ** 0.5).bfloat16()) for _ in range(3)]
    counts = [3, 1, 6]
    xs = torch.randn(sum(counts), hidden, generator=g).bfloat16()
    weights = torch.rand(sum(counts), generator=g).bfloat16()
    spans = [(0, 3), (3, 4), (4, 10)]
    together = torch.empty_like(xs)
    kernels.expert_layer(together, xs, weights, [(gu, d, a, b) for (gu, d), (a, b) in zip(experts, spans)])
    alone = torch.empty_like(xs)
    for (gu, d), (a, b) in zip(experts, spans):
        for t in range(a, b):
            kernels.expert(alone[t:t + 1], xs[t:t + 1], gu, d, weights[t:t + 1])
    assert torch.equal(together, alone) and alone.abs().sum() > 0
    gu, d = experts[2]
    assert torch.equal(kernels.swiglu(xs, gu, d), torch.cat([kernels.swiglu(xs[t:t + 1], gu, d) for t in range(10)]))
    ref = torch.empty_like(xs[4:10])
    TorchKernels().expert(ref, xs[4:10], gu, d, weights[4:10])
    assert ulps_apart(together[4:10], ref).max().item() <= 2


def test_a_prefill_in_pieces_is_the_same_as_whole(kernels, monkeypatch):
    """Products of more rows than one call takes, and experts whose work space passes the cap, run in several
    calls: nothing changes but the calls."""
    from moetier.model import kernels as module

    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(40, 64, generator=g).bfloat16(), torch.randn(11, 64, generator=g).bfloat16()
    experts = [((torch.randn(2 * 48, 64, generator=g) / 8).bfloat16(), (torch.randn(64, 48, generator=g) / 7).bfloat16())
               for _ in range(2)]
    weights = torch.rand(11, generator=g).bfloat16()
    items = [(experts[0][0], experts[0][1], 0, 7), (experts[1][0], experts[1][1], 7, 11)]
    whole_linear, whole_layer = kernels.linear(x, w), torch.empty_like(x)
    kernels.expert_layer(whole_layer, x, weights, items)
    monkeypatch.setattr(module, "LINEAR_ROWS", 4)
    monkeypatch.setattr(module, "LAYER_SCRATCH_BYTES", 3 * 4 * (64 + 48))  # three rows a call
    pieces = torch.empty_like(x)
    kernels.expert_layer(pieces, x, weights, items)
    assert torch.equal(kernels.linear(x, w), whole_linear) and torch.equal(pieces, whole_layer)


@pytest.mark.parametrize("hidden,intermediate", [(2048, 1024), (64, 48), (30, 21), (100, 130), (16, 1)])
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_expert_matches_torch(kernels, hidden, intermediate, weight_dtype):
    torch.manual_seed(hidden + intermediate)
    gate_up = (torch.randn(2 * intermediate, hidden) / hidden ** 0.5).bfloat16()
    down = (torch.randn(hidden, intermediate) / intermediate ** 0.5).bfloat16()
    x = torch.randn(1, hidden).bfloat16()
    weights = torch.tensor([0.37]).to(weight_dtype)  # Mixtral keeps its routing weights in fp32
    ours, ref = torch.empty(1, hidden, dtype=torch.bfloat16), torch.empty(1, hidden, dtype=torch.bfloat16)
    kernels.expert(ours, x, gate_up, down, weights)
    TorchKernels().expert(ref, x, gate_up, down, weights)
    # rare one-step differences inside may move an output a step or two; most are identical
    assert ulps_apart(ours, ref).max().item() <= 2
    assert (ours == ref).float().mean().item() >= 0.95
    assert torch.equal(kernels.swiglu(x, gate_up, down), kernels.swiglu(x, gate_up, down))  # deterministic


@pytest.mark.parametrize("shape", [(1, 2048), (1, 4, 16), (1, 7)])
def test_rms_norm_matches_torch(kernels, shape):
    torch.manual_seed(shape[-1])
    x, w = (torch.randn(shape) * 3).bfloat16(), torch.randn(shape[-1]).bfloat16()
    assert ulps_apart(kernels.rms_norm(x, w, 1e-6), TorchKernels().rms_norm(x, w, 1e-6)).max().item() <= 1


@pytest.mark.parametrize("shape", [(1, 2880), (3, 64)])
def test_gpt_oss_norm_matches_torch(kernels, shape):
    """gpt-oss's RMSNorm (the weight applied to the fp32 values, one rounding): within one bf16 step of torch's."""
    torch.manual_seed(shape[-1])
    x, w = (torch.randn(shape) * 3).bfloat16(), torch.randn(shape[-1]).bfloat16()
    ours, ref = kernels.rms_norm_fp32_weight(x, w, 1e-5), TorchKernels().rms_norm_fp32_weight(x, w, 1e-5)
    assert ulps_apart(ours, ref).max().item() <= 1 and (ours == ref).float().mean().item() >= 0.99

def test_rope_matches_torch(kernels):
    batch = StepBatch.decode_step([5], [0], [37], 1)
    rope = Rope(RopeSpec(), 16, 64, torch.bfloat16).tables(batch)
    x = torch.randn(1, 4, 16).bfloat16()
    assert torch.equal(kernels.rope(rope, x, batch), TorchKernels().rope(rope, x, batch))


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("d", [32, 12])  # 12: eight lanes and a tail
def test_decode_attention_matches_torch(kernels, window, d):
    torch.manual_seed(0)
    hq, hkv, s_max, length = 8, 2, 40, 23
    keys, values = torch.randn(2, hkv, s_max, d).bfloat16(), torch.randn(2, hkv, s_max, d).bfloat16()
    q = torch.randn(1, hq, d).bfloat16()
    batch = StepBatch.decode_step([5], [1], [length - 1], 2)  # the second sequence, the other one finished
    ours = kernels.decode_attention(q, keys, values, batch, window, d ** -0.5)
    ref = TorchKernels().decode_attention(q, keys, values, batch, window, d ** -0.5)
    assert ulps_apart(ours, ref).max().item() <= 2 and (ours == ref).float().mean().item() >= 0.9


@pytest.mark.parametrize("window", [None, 5])
def test_sink_decode_attention_is_the_softmax_with_one_more_logit(kernels, window):
    """gpt-oss's decode attention where the kernels have it (the native ones): each head's sink one more logit in
    its softmax, weighting no value — as near the exact attention (fp64) as SinkAttention's written-out bf16 ops are,
    and the plain kernel's bits where the sink is so low it takes nothing."""
    from moetier.model.attention import SinkAttention

    torch.manual_seed(2)
    hq, hkv, s_max, d, length = 8, 2, 40, 32, 23
    keys, values = torch.randn(2, hkv, s_max, d).bfloat16(), torch.randn(2, hkv, s_max, d).bfloat16()
    q = torch.randn(1, hq, d).bfloat16()
    sinks = (torch.randn(hq) * 2).bfloat16()
    batch = StepBatch.decode_step([5], [1], [length - 1], 2)
    ours = kernels.sink_decode_attention(q, keys, values, batch, window, d ** -0.5, sinks)
    # (torch's kernels leave it to SinkAttention's own ops)
    assert TorchKernels().sink_decode_attention(q, keys, values, batch, window, d ** -0.5, sinks) is None
    attention = SinkAttention.__new__(SinkAttention)
    attention.sinks, attention.scale = sinks, d ** -0.5
    visible = batch.decode_mask(window)
    written = attention._softmax_attend(q[:, :, None], keys[1:, :, :length], values[1:, :, :length], visible)[:, :, 0]
    start = max(0, length - window) if window else 0
    k64, v64 = (t[1, :, start:length].double().repeat_interleave(hq // hkv, 0) for t in (keys, values))
    logits = torch.cat([q[0].double()[:, None] @ k64.transpose(1, 2) * d ** -0.5,
                        sinks.double()[:, None, None]], -1)  # [hq, 1, n + 1]
    exact = (torch.softmax(logits, -1)[..., :-1] @ v64)[:, 0]  # [hq, d]
    assert (ours[0].double() - exact).abs().max() <= 1.5 * (written[0].double() - exact).abs().max()
    none = torch.full((hq,), -1e30).bfloat16()
    assert torch.equal(kernels.sink_decode_attention(q, keys, values, batch, window, d ** -0.5, none),
                       kernels.decode_attention(q, keys, values, batch, window, d ** -0.5))

def test_decode_attention_is_the_same_on_one_thread_and_on_the_team(kernels):
    """Heads split across threads (a context long enough to wake the team) compute what one thread computes."""
    if not hasattr(kernels, "lib"):
        pytest.skip("the torch kernels have no team of their own")
    torch.manual_seed(1)
    hq, hkv, s_max, d = 16, 4, 300, 128
    keys, values = torch.randn(1, hkv, s_max, d).bfloat16(), torch.randn(1, hkv, s_max, d).bfloat16()
    q = torch.randn(1, hq, d).bfloat16()
    batch = StepBatch.decode_step([5], [0], [255], 1)  # 256 keys x 16 heads x 128: above the team's threshold
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = kernels.decode_attention(q, keys, values, batch, None, d ** -0.5)
        torch.set_num_threads(max(2, threads))
        team = kernels.decode_attention(q, keys, values, batch, None, d ** -0.5)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, team)
    # and as near the exact attention as torch's kernel (which sums the keys in blocks) is
    k64, v64 = (t[0, :, :256].double().repeat_interleave(hq // hkv, 0) for t in (keys, values))  # [hq, 256, d]
    exact = torch.softmax(q[0].double()[:, None] @ k64.transpose(1, 2) * d ** -0.5, -1) @ v64  # [hq, 1, d]
    torch_error = (TorchKernels().decode_attention(q, keys, values, batch, None, d ** -0.5)[0].double()
                   - exact[:, 0]).abs().max()
    assert (team[0].double() - exact[:, 0]).abs().max() <= 1.5 * torch_error


def test_several_rows_and_views_fall_back_to_torch(kernels):
    w = torch.randn(8, 32).bfloat16()
    x = torch.randn(3, 32).bfloat16()
    assert torch.equal(kernels.linear(x, w), TorchKernels().linear(x, w))
    strided = torch.randn(32, 2).bfloat16()[:, :1].T  # one row, not contiguous
    assert torch.equal(kernels.linear(strided, w), TorchKernels().linear(strided, w))


def test_the_instruction_sets_follow_the_cpus_flags():
    avx2 = frozenset({"avx2", "fma", "f16c", "sse4_2"})
    zen4 = avx2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16"}
    assert native.runnable_isas(avx2) == ["avx2"]
    assert native.runnable_isas(zen4) == ["avx2", "avx512"]
    assert native.runnable_isas(zen4 - {"avx512_bf16"}) == ["avx2"]  # (Cascade Lake: VNNI without BF16)
    assert native.runnable_isas(avx2 | {"avx_vnni"}) == ["avx2", "avx2-vnni"]  # (Alder Lake: AVX-VNNI, no AVX-512)
    assert native.runnable_isas(zen4 | {"avx_vnni"}) == ["avx2", "avx2-vnni", "avx512"]  # (Sapphire Rapids)
    assert native.runnable_isas(frozenset({"sse4_2"})) == []


def test_the_best_library_the_cpu_runs_is_built_and_one_it_cannot_run_is_refused(monkeypatch):
    runnable = native.runnable_isas()
    if not runnable:
        pytest.skip("this CPU runs no native kernels")
    loaded = native.load()
    assert loaded.lib is not None and loaded.isa == runnable[-1]
    assert loaded.lib.moetier_qi_isa().decode() == {"avx2": "avx2", "avx2-vnni": "avx2-vnni",
                                                    "avx512": "avx512-vnni"}[loaded.isa]
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset({"avx2", "fma", "f16c"}))
    refused = native.load("avx512")
    assert refused.lib is None and refused.reason == "this CPU cannot run avx512 (it runs avx2)"


def test_choice_of_kernels():
    assert make_kernels("auto", torch.float32, CPU).name == "torch"  # fp32: torch's sgemv streams already
    assert make_kernels("torch", torch.bfloat16, CPU).name == "torch"
    with pytest.raises(MoetierError, match="unknown kernels"):
        make_kernels("fast", torch.bfloat16, CPU)
    with pytest.raises(MoetierError, match="bf16 weights on the CPU"):
        make_kernels("native", torch.float32, CPU)
    with pytest.raises(MoetierError, match="unknown kernels"):
        EngineConfig(kernels="fast")


def test_without_a_compiler_auto_warns_and_native_refuses(monkeypatch, tmp_path):
    monkeypatch.setenv("MOETIER_CACHE", str(tmp_path))  # nothing built there yet
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    assert native.load().lib is None and "no-such-cc" in native.load().reason
    with pytest.warns(UserWarning, match="slower than the native ones"):
        assert make_kernels("auto", torch.bfloat16, CPU).name == "torch"
    with pytest.raises(MoetierError, match="not available"):
        make_kernels("native", torch.bfloat16, CPU)
    assert not any(p.is_file() for p in tmp_path.rglob("*"))


def test_a_failed_build_leaves_nothing(monkeypatch, tmp_path):
    monkeypatch.setenv("MOETIER_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a compiler that fails
    loaded = native.load()
    assert loaded.lib is None and "failed" in loaded.reason
    assert not any(p.is_file() for p in tmp_path.rglob("*"))


def decode_logits(path, budget: str, kernels: str, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and the logits of every forward step ([steps, V]: the prefill's last token, then each
    decode step) of the engine on `kernels`."""
    config = EngineConfig(expert_memory=MemoryBudget.parse(budget), kernels=kernels)
    with Engine(Store(path), config) as engine:
        assert engine.kernels.name == kernels
        logits = []
        forward = engine.model.forward

        def keep(*args, **kw):
            out = forward(*args, **kw)
            logits.append(out[0].float())
            return out

        engine.model.forward = keep
        tokens = engine.generate([prompt], max_new_tokens=steps, ignore_eos=True).token_ids[0]
    return tokens, torch.stack(logits)


# ("mixtral-window" was a strict xfail: ours parted from transformers at the second token. Transformers' own
# logits tie there within bf16's resolution for that prompt; on a prompt without an early tie they agree.)
BF16_CASES = [("olmoe", {}), ("qwen2_moe", {}), ("mixtral", {}), ("qwen3_moe", {}),
              pytest.param("mixtral", {"sliding_window": 6}, id="mixtral-window")]


def decisive(scores: list[torch.Tensor]) -> int:
    """Steps before the first whose top two logits are within bf16's resolution of the logits (2^-7 of the
    largest): up to there greedy decoding is determined; at a near-tie, sums in another order (torch's bf16 path
    differs between AVX2 and AVX512-BF16 machines) may pick either, and the sequences part legitimately."""
    for step, logits in enumerate(scores):
        top = logits.float()[0].topk(2).values
        if (top[0] - top[1]).item() <= logits.float().abs().max().item() * 2 ** -7:
            return step
    return len(scores)


@pytest.mark.parametrize("family,overrides", BF16_CASES)
def test_bf16_engine_decodes_as_transformers(tiny_store, family, overrides):
    """bf16 exact mode with the native kernels: transformers' greedy tokens at every expert budget, up to the first
    near-tie of transformers' logits (which must come late enough to test something), and each step's logits those
    of torch's kernels up to a bf16 step."""
    ref, path = tiny_store(family, dtype=torch.bfloat16, **overrides)
    for seed in range(1, 11):  # the first prompt whose greedy decoding is decided for 12 steps at least
        torch.manual_seed(seed)
        prompt = torch.randint(3, ref.config.vocab_size, (11,)).tolist()
        with torch.no_grad():
            out = ref.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, pad_token_id=0,
                               output_scores=True, return_dict_in_generate=True)
        n = decisive(out.scores)
        if n >= 12:
            break
    assert n >= 12, f"transformers' own logits tie within 12 steps for every prompt tried (last: step {n})"
    want = out.sequences[0, len(prompt):].tolist()
    for budget in ("100%", "25%"):
        tokens, ours = decode_logits(path, budget, "native", prompt, 24)
        torch_tokens, theirs = decode_logits(path, budget, "torch", prompt, 24)
        assert tokens[:n] == torch_tokens[:n], f"the kernels choose different tokens at {budget}"
        steps = min(len(ours), len(theirs), n + 1)  # the same inputs up to the first near-tie
        assert (ours[:steps] - theirs[:steps]).abs().max().item() <= theirs.abs().max().item() * 2 ** -7, \
            f"logits at {budget}"
        assert tokens[:n] == want[:n], f"greedy tokens differ from transformers' at {budget}"


@pytest.mark.parametrize("rows", [0, 1, 2, 8, 16])
def test_one_tokens_expert_outputs_combine_as_index_add_does(kernels, rows):
    """The reference's index_add_ into a bf16 zero row sums in fp32 and rounds once: bit for bit the same."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(1, 300, generator=g).bfloat16()
    ys = (torch.randn(rows, 300, generator=g) * 10 ** torch.randn(rows, 1, generator=g)).bfloat16()
    token_of = torch.zeros(rows, dtype=torch.long)
    assert torch.equal(kernels.combine(x, token_of, ys), TorchKernels().combine(x, token_of, ys))
    two = torch.randn(2, 300, generator=g).bfloat16()  # more tokens: the reference itself
    token_of = torch.arange(rows) % 2
    assert torch.equal(kernels.combine(two, token_of, ys), TorchKernels().combine(two, token_of, ys))


def test_with_a_bf16_gemm_decode_rows_stay_native_and_a_prefills_go_to_torch():
    """NativeWithGemm (chosen where torch's GEMM has bf16 dot products): up to NATIVE_ROWS rows the native
    kernels' numbers, beyond them torch's own — products, SwiGLU, experts alone and a layer's."""
    loaded = native.load()
    if loaded.lib is None:
        pytest.skip(loaded.reason)
    ours, plain, ref = NativeWithGemm(loaded.lib, loaded.isa), NativeKernels(loaded.lib, loaded.isa), TorchKernels()
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(96, 64, generator=g) / 8).bfloat16()
    gu, d = (torch.randn(64, 64, generator=g) / 8).bfloat16(), (torch.randn(64, 32, generator=g) / 8).bfloat16()
    for rows, want in ((NATIVE_ROWS, plain), (NATIVE_ROWS + 1, ref)):
        x = torch.randn(rows, 64, generator=g).bfloat16()
        assert torch.equal(ours.linear(x, w), want.linear(x, w))
        assert torch.equal(ours.swiglu(x, gu, d), want.swiglu(x, gu, d))
        weights = torch.rand(rows, generator=g).bfloat16()
        a, b = torch.empty_like(x), torch.empty_like(x)
        ours.expert(a, x, gu, d, weights)
        want.expert(b, x, gu, d, weights)
        assert torch.equal(a, b)
    x = torch.randn(NATIVE_ROWS + 4, 64, generator=g).bfloat16()
    weights = torch.rand(x.shape[0], generator=g).bfloat16()
    items = [(gu, d, 0, 3), (gu, d, 3, x.shape[0])]  # a layer: one expert with few tokens, one with many
    a = torch.zeros_like(x)
    ours.expert_layer(a, x, weights, items)
    b, c = torch.empty(3, 64, dtype=torch.bfloat16), torch.empty(x.shape[0] - 3, 64, dtype=torch.bfloat16)
    plain.expert(b, x[:3], gu, d, weights[:3])
    ref.expert(c, x[3:], gu, d, weights[3:])
    assert torch.equal(a, torch.cat([b, c]))


def test_the_gemm_kernels_are_chosen_by_the_cpus_bf16_dot_products(monkeypatch):
    if native.load().lib is None:
        pytest.skip("no native library here")
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset({"avx2", "fma", "f16c", "avx512_bf16"}))
    assert type(make_kernels("auto", torch.bfloat16, CPU)) is NativeWithGemm
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset({"avx2", "fma", "f16c"}))
    assert type(make_kernels("auto", torch.bfloat16, CPU)) is NativeKernels


def test_a_decode_tokens_kv_write_is_the_index_put_bit_for_bit(kernels):
    spec = SimpleNamespace(latent_attention=None, encoder_decoder=None, num_layers=2, num_kv_heads=4, head_dim=32)
    g = torch.Generator().manual_seed(3)
    native_kv, torch_kv = (KVCache(spec, 3, 16, torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(1, spec.num_kv_heads, spec.head_dim, generator=g).bfloat16() for _ in range(2))
    batch = StepBatch.decode_step([5], [2], [9], 3)  # row 2, position 9
    kernels.kv_write(native_kv, 1, batch, k, v)
    TorchKernels().kv_write(torch_kv, 1, batch, k, v)
    for a, b in ((native_kv.k[1], torch_kv.k[1]), (native_kv.v[1], torch_kv.v[1])):
        assert torch.equal(a, b) and a[2, :, 9].abs().sum() > 0 and a.abs().sum() == a[2, :, 9].abs().sum()


def test_a_gpu_gets_torchs_kernels_with_decode_attention_kept_off_cudnn_and_triton_experts_unless_told_torch():
    """(cuDNN's SDPA built a plan per KV length on the H200: more than half of an OLMoE decode step.) The choice of
    backend changes no number here: the same attention as torch's. `auto` takes Triton where it is installed
    (TritonKernels: experts, norms and rotations), torch's ops where not."""
    from moetier.model.batch import StepBatch
    from moetier.model.kernels import CudaKernels, TorchKernels, TritonKernels, make_kernels, triton_installed

    kernels = make_kernels("auto", torch.bfloat16, torch.device("cuda"))
    plain = make_kernels("torch", torch.bfloat16, torch.device("cuda"))  # (torch's ops for the experts too)
    assert isinstance(kernels, CudaKernels) and isinstance(plain, CudaKernels) and not plain.triton
    assert kernels.triton == isinstance(kernels, TritonKernels) == triton_installed()
    assert type(plain) is CudaKernels
    from torch.nn.attention import SDPBackend
    assert SDPBackend.CUDNN_ATTENTION not in kernels.decode_backends
    g = torch.Generator().manual_seed(0)
    q, keys, values = (torch.randn(*shape, generator=g) for shape in ((2, 4, 16), (2, 2, 10, 16), (2, 2, 10, 16)))
    batch = StepBatch.decode_step([1, 2], [0, 1], [5, 7], 2)
    for window in (None, 3):
        want = TorchKernels().decode_attention(q, keys, values, batch, window, 0.25)
        assert torch.allclose(kernels.decode_attention(q, keys, values, batch, window, 0.25), want, atol=1e-6)


AVX2_ONLY = frozenset({"avx", "avx2", "fma", "f16c"})


def test_a_kernel_path_the_cpu_lacks_is_refused_in_one_line_before_anything_loads(monkeypatch, capsys, tmp_path):
    """(The AVX2 library could only be chosen on an AVX-512 machine by hiding CPU flags.)"""
    from moetier.cli import main
    from moetier.errors import MoetierError
    from moetier.model import native
    from moetier.model.kernels import make_kernels, runnable_paths

    monkeypatch.setattr(native, "cpu_flags", lambda: AVX2_ONLY)
    assert runnable_paths() == ["avx2"]
    for name, lacks in (("avx512", "no AVX512 path"), ("amx", "no AVX512 path")):
        with pytest.raises(MoetierError, match=lacks):
            make_kernels(name, torch.bfloat16, torch.device("cpu"))
    assert main(["generate", "--model", str(tmp_path), "--prompt", "x", "--kernels", "avx512"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("moetier: error: --kernels avx512: this CPU has no AVX512 path (it runs avx2)")
    assert err.count("\n") == 2 and "config.json" not in err  # (refused before the model, a bare folder, is read)


@pytest.mark.parametrize("path", ["avx2", "avx2-vnni", "avx512", "amx"])
def test_each_path_the_cpu_runs_is_the_library_it_names(path):
    from moetier.model import native
    from moetier.model.kernels import NativeKernels, NativeWithGemm, make_kernels, runnable_paths

    if path not in runnable_paths():
        pytest.skip(f"this CPU does not run the {path} path (it runs {', '.join(runnable_paths())})")
    kernels = make_kernels(path, torch.bfloat16, torch.device("cpu"))
    assert kernels.isa == ("avx512" if path == "amx" else path)
    assert type(kernels) is (NativeWithGemm if path == "amx" else NativeKernels)
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(96, 256, generator=g).bfloat16(), torch.randn(40, 256, generator=g).bfloat16()
    want = torch.nn.functional.linear(x.float(), w.float())  # (a prefill's 40 rows: the GEMM path for amx)
    got = kernels.linear(x, w).float()
    assert ((got - want).norm() / want.norm()).item() < 1e-2
    assert native.load(kernels.isa).isa == kernels.isa


def test_the_engine_decodes_alike_on_every_path_the_cpu_runs(tiny_store):
    from moetier import Engine
    from moetier.model.kernels import runnable_paths

    _, path = tiny_store("olmoe", dtype=torch.bfloat16)
    outs = {}
    for name in ["torch", *runnable_paths()]:
        with Engine.from_pretrained(path, expert_memory="50%", kernels=name, progress=False) as engine:
            outs[name] = engine.generate([[5, 9, 17, 33]], max_new_tokens=8).token_ids[0]
    assert len(outs) >= 2 and all(ids == outs["torch"] for ids in outs.values()), outs


def test_the_best_library_the_compiler_can_build_is_the_one_taken(monkeypatch, tmp_path):
    """An Alder Lake with a gcc older than 11 (no -mavxvnni): the AVX2 library, not torch's kernels; a library
    built already is taken without asking the compiler."""
    monkeypatch.setattr(native, "default_cache_dir", lambda: tmp_path)  # (nothing built there)
    asked = []
    monkeypatch.setattr(native, "_compiler_takes", lambda compiler, isa: asked.append(isa) or isa != "avx2-vnni")
    assert native.best_buildable("gcc", ["avx2", "avx2-vnni"]) == "avx2" and asked == ["avx2-vnni", "avx2"]
    assert native.best_buildable("gcc", ["avx2", "avx2-vnni", "avx512"]) == "avx512"
    built = native._library_path("gcc", "avx2-vnni")
    built.parent.mkdir(parents=True)
    built.touch()
    asked.clear()
    assert native.best_buildable("gcc", ["avx2", "avx2-vnni"]) == "avx2-vnni" and asked == []
    if shutil.which("gcc"):
        assert native._compiler_takes("gcc", "avx2")  # (the probe itself, on a compiler that takes it)
