"""`--refit` (moetier/merge/refit.py): a merged expert fitted to its group's outputs, on hand-made experts."""

import numpy as np
import torch

from moetier.merge.merge import MergeSettings, averaged, merge_store
from moetier.merge.plan import FixedRatio
from moetier.merge.refit import group_tokens, refit_down, tune
from moetier.merge.similarity import expert_output
from moetier.store.store import Store
from tests.merge.test_merge import calibration

H, INTER = 8, 12


def expert(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"gate_up_proj": torch.randn(2 * INTER, H, generator=g), "down_proj": torch.randn(H, INTER, generator=g)}


def error(e: dict, members: dict, x: torch.Tensor, shares: np.ndarray) -> float:
    target = sum(torch.from_numpy(shares[:, j:j + 1]).float() * expert_output(members[m], x)
                 for j, m in enumerate(sorted(members)))
    return float((expert_output(e, x) - target).square().sum())


def test_group_tokens_takes_the_rows_routed_to_the_group_and_each_members_share():
    ids = np.array([[0, 1], [2, 3], [1, 2], [3, 0]])
    weights = np.array([[0.6, 0.4], [0.5, 0.5], [0.3, 0.7], [0.9, 0.1]], np.float16)
    rows, shares = group_tokens(ids, weights, [1, 2])
    assert rows.tolist() == [0, 1, 2]
    np.testing.assert_allclose(shares, [[1, 0], [0, 1], [0.3, 0.7]], atol=1e-3)


def test_refitting_comes_closer_to_the_group_than_the_average():
    members = {0: expert(0), 1: expert(1), 2: expert(2)}
    x = torch.randn(200, H, generator=torch.Generator().manual_seed(3))
    shares = np.random.default_rng(4).dirichlet(np.ones(3), size=200)
    avg = averaged(members, (0.5, 0.3, 0.2))
    refit = refit_down(avg, members, x, shares, "swiglu")
    assert error(refit, members, x, shares) < 0.9 * error(avg, members, x, shares)  # (least squares: never worse)
    torch.testing.assert_close(refit["gate_up_proj"], avg["gate_up_proj"], rtol=0, atol=0)  # only down moves


def test_members_alike_but_for_their_down_projections_are_matched_exactly():
    """Shared hidden units: the group's mix is linear in them, so with constant shares the refit finds it — from an
    average of other proportions, with the ridge's pull towards it made negligible."""
    a = expert(5)
    b = dict(a, down_proj=torch.randn(H, INTER, generator=torch.Generator().manual_seed(6)))
    x = torch.randn(100, H, generator=torch.Generator().manual_seed(7))
    shares = np.tile([0.25, 0.75], (100, 1))
    refit = refit_down(averaged({0: a, 1: b}, (0.5, 0.5)), {0: a, 1: b}, x, shares, "swiglu", ridge=1e-9)
    torch.testing.assert_close(refit["down_proj"], 0.25 * a["down_proj"] + 0.75 * b["down_proj"], atol=1e-4, rtol=1e-4)


def test_a_refitted_merge_is_a_store_that_says_so_and_differs_only_in_down_projections(tiny_store, tmp_path):
    _, store = tiny_store("olmoe", num_experts=8)
    trace = calibration(store)
    plain = Store(merge_store(store, tmp_path / "plain", trace, MergeSettings(FixedRatio(0.5), refit="none"),
                              progress=False).path)
    refit = Store(merge_store(store, tmp_path / "refit", trace, MergeSettings(FixedRatio(0.5), refit="down"),
                              progress=False).path)
    assert refit.manifest.config["moetier_merged"]["refit"] == "down"
    assert refit.spec.expert_groups == plain.spec.expert_groups
    moved = 0
    for layer in refit.spec.moe_layers:
        for p in refit.spec.experts_of(layer):
            a, b = plain.read_expert(layer, p), refit.read_expert(layer, p)
            torch.testing.assert_close(a["gate_up_proj"], b["gate_up_proj"], rtol=0, atol=0)
            moved += not torch.equal(a["down_proj"], b["down_proj"])
    assert moved > 0


def test_tuning_every_weight_never_ends_worse_on_held_out_tokens_and_usually_better():
    members = {0: expert(10), 1: expert(11)}
    x = torch.randn(300, H, generator=torch.Generator().manual_seed(12))
    shares = np.random.default_rng(13).dirichlet(np.ones(2), size=300)
    start = refit_down(averaged(members, (0.5, 0.5)), members, x, shares, "swiglu")
    tuned = tune(start, members, x, shares, "swiglu", steps=200, lr=3e-3)
    assert error(tuned, members, x, shares) < 0.95 * error(start, members, x, shares)
    assert not torch.equal(tuned["gate_up_proj"], start["gate_up_proj"])  # every weight moves, not only down
    assert tune(start, members, x, shares, "swiglu", steps=0) is start


def test_bad_refit_is_refused():
    import pytest

    from moetier.errors import MoetierError

    with pytest.raises(MoetierError, match="--refit must be one of none, down, all"):
        MergeSettings(FixedRatio(0.5), refit="everything")
