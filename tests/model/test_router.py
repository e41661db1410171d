"""The softmax router's choice in one native call (NativeSoftmaxRouter, csrc/route.c) against torch's ops
(SoftmaxRouter.route): torch.topk's experts in its order, ties broken as it breaks them; scores within a few ulps
and the weights with them; the native kernels route through it on every path."""

import pytest
import torch

from moetier.config import RouterSpec
from moetier.model import native
from moetier.model.kernels import make_kernels
from moetier.model.router import GroupLimitedRouter, NativeSoftmaxRouter, SoftmaxRouter, make_router
from tests.model.isas import isa_params


@pytest.fixture(scope="module", params=isa_params())
def lib(request):
    """The native library built for each instruction set this CPU runs (the others skipped with the reason)."""
    loaded = native.load(request.param)
    assert loaded.lib is not None, loaded.reason
    return loaded.lib


SPECS = [RouterSpec(), RouterSpec(norm_topk_prob=True), RouterSpec(scaling_factor=2.5),
         RouterSpec(norm_topk_prob=True, fp32_weights=True)]  # OLMoE, Qwen, scaled, Mixtral


@pytest.mark.parametrize("spec", SPECS, ids=["olmoe", "renormalised", "scaled", "mixtral"])
@pytest.mark.parametrize("logits_dtype", [torch.bfloat16, torch.float32])
def test_the_native_choice_is_torchs_up_to_ties_and_last_bits(lib, spec, logits_dtype):
    torch.manual_seed(0)
    logits = (torch.randn(2000, 64) * 3).to(logits_dtype)
    k = 8
    scores, ids, weights = NativeSoftmaxRouter(spec, k, None, lib).route(logits, torch.bfloat16)
    ref_scores, ref_ids, ref_weights = SoftmaxRouter(spec, k, None).route(logits, torch.bfloat16)
    assert weights.dtype == ref_weights.dtype and ids.dtype == torch.int64 and scores.dtype == torch.float32
    ulps = (scores.view(torch.int32) - ref_scores.view(torch.int32)).abs()
    assert ulps.max().item() <= 16 and (scores - ref_scores).abs().max().item() < 1e-6
    assert torch.equal(ids, ref_ids)
    # each weight torch's, up to the scores' last bits (and one bf16 rounding of them)
    tolerance = (2 ** -8 if weights.dtype == torch.bfloat16 else 1e-6) * spec.scaling_factor
    assert (weights.float() - ref_weights.float()).abs().max().item() <= tolerance
    assert torch.all(weights[:, :-1].float() >= weights[:, 1:].float())  # descending, as torch.topk's


@pytest.mark.parametrize("num_experts,k", [(64, 8), (60, 4), (16, 4), (8, 2), (128, 8), (100, 30), (64, 64),
                                           (64, 1), (512, 8), (1024, 4)])  # (the last three: torch's partial sort)
def test_ties_are_broken_as_torch_breaks_them(lib, num_experts, k):
    """Logits rounded to whole numbers tie at almost every row; bf16 logits tie at the k-th place in ~2%."""
    torch.manual_seed(num_experts + k)
    whole = (torch.randn(3000, num_experts) * 2).round().bfloat16()
    for logits in (whole, (torch.randn(3000, num_experts) * 3).bfloat16()):
        _, ids, _ = NativeSoftmaxRouter(RouterSpec(), k, None, lib).route(logits, torch.bfloat16)
        _, ref_ids, _ = SoftmaxRouter(RouterSpec(), k, None).route(logits, torch.bfloat16)
        assert torch.equal(ids, ref_ids)
    # (the ties were there: the k-th best whole-number logit is shared with one not chosen in most rows)
    top = whole.float().topk(min(k + 1, num_experts), dim=-1).values
    assert k == num_experts or (top[:, k - 1] == top[:, k]).float().mean() > 0.2


def test_a_hand_made_tie_keeps_torchs_order(lib):
    logits = torch.tensor([[0.5, 2.0, 1.0, 2.0, 1.0, 1.0, -3.0]], dtype=torch.bfloat16)
    scores, ids, weights = NativeSoftmaxRouter(RouterSpec(), 4, None, lib).route(logits, torch.bfloat16)
    assert torch.equal(ids, torch.topk(torch.softmax(logits.float(), dim=-1), 4).indices)
    assert set(ids[0, :2].tolist()) == {1, 3} and len(set(ids[0, 2:].tolist()) & {2, 4, 5}) == 2
    assert weights[0, 0] == weights[0, 1] and weights[0, 2] == weights[0, 3]
    assert torch.allclose(scores, torch.softmax(logits.float(), dim=-1), atol=1e-7)


def test_renormalised_weights_sum_to_one_and_scaling_multiplies(lib):
    torch.manual_seed(1)
    logits = torch.randn(5, 16)
    _, _, w = NativeSoftmaxRouter(RouterSpec(norm_topk_prob=True, fp32_weights=True), 3, None, lib).route(
        logits, torch.bfloat16)
    assert torch.allclose(w.sum(dim=-1), torch.ones(5), atol=1e-6)
    _, _, plain = NativeSoftmaxRouter(RouterSpec(fp32_weights=True), 3, None, lib).route(logits, torch.bfloat16)
    _, _, scaled = NativeSoftmaxRouter(RouterSpec(fp32_weights=True, scaling_factor=2.5), 3, None, lib).route(
        logits, torch.bfloat16)
    assert torch.equal(scaled, plain * 2.5)


def test_what_the_native_call_cannot_take_routes_through_torch(lib):
    router = NativeSoftmaxRouter(RouterSpec(), 2, None, lib)
    logits = torch.randn(3, 8, dtype=torch.float64)
    for got, want in zip(router.route(logits, torch.float64), SoftmaxRouter(RouterSpec(), 2, None).route(
            logits, torch.float64)):
        assert torch.equal(got, want)


def test_the_native_kernels_route_through_it_and_only_a_plain_softmax_router(lib):
    kernels = make_kernels("auto", torch.bfloat16, torch.device("cpu"))
    router = make_router(RouterSpec(), 2, kernels.linear, getattr(kernels, "lib", None))
    assert isinstance(router, NativeSoftmaxRouter) == (getattr(kernels, "lib", None) is not None)
    assert type(make_router(RouterSpec(), 2)) is SoftmaxRouter  # torch's kernels
    grouped = RouterSpec(kind="group-limited", num_groups=2, topk_groups=1)
    assert type(make_router(grouped, 2, lib=lib)) is GroupLimitedRouter


def merged_weights(groups: list[int]) -> dict[str, torch.Tensor]:
    g = torch.tensor(groups)
    return {"router.groups": g, "router.absent": g != torch.arange(len(groups))}


@pytest.mark.parametrize("norm", [False, True])
def test_a_merged_router_sums_each_groups_probabilities_into_its_principal(norm):
    """Experts 0-1 merged into 0, 2-3 into 3, 4 alone: the groups' sums ranked, top-2, renormalised if the family
    does; a merged-away id is never chosen, even where every group's sum underflows."""
    spec = RouterSpec(norm_topk_prob=norm)
    router = make_router(spec, 2, merged=True)
    w = {"router": torch.eye(5), **merged_weights([0, 0, 3, 3, 4])}
    x = torch.tensor([[2.0, 1.9, 0.0, 0.1, 2.5]])  # expert 4 alone is the best single expert
    probs = torch.softmax(x, dim=-1)
    scores, ids, weights = router(x, w)
    sums = [probs[0, :2].sum(), probs[0, 2:4].sum(), probs[0, 4]]
    assert ids.tolist() == [[0, 4]] and scores[0, 1] == 0 and scores[0, 2] == 0
    torch.testing.assert_close(scores[0, [0, 3, 4]], torch.stack(sums))
    expected = torch.stack([sums[0], sums[2]])
    torch.testing.assert_close(weights[0], expected / expected.sum() if norm else expected)
    _, ids, _ = router(torch.tensor([[-1e4, -1e4, 0.0, 0.0, -1e4]]), w)  # two groups' sums are exactly 0
    assert set(ids[0].tolist()) <= {0, 3, 4} and 3 in ids[0].tolist()


def test_a_merged_router_with_every_expert_its_own_group_is_the_plain_one():
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(6, 16, generator=g), {"router": torch.randn(8, 16, generator=g)}
    plain = SoftmaxRouter(RouterSpec(norm_topk_prob=True), 3)(x, w)
    merged = make_router(RouterSpec(norm_topk_prob=True), 3, merged=True)(x, {**w, **merged_weights(list(range(8)))})
    for a, b in zip(plain, merged):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
