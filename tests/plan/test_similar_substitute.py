"""CoMoE's similar-expert substitution (§III-D) as pure logic on hand-made routes: a mispredicted (missing)
low-priority expert is replaced by the most similar expert at hand; the token's first expert and important ones
load; a substitute must be similar enough; prompts run as routed."""

import numpy as np
import pytest

from moetier.errors import MoetierError
from moetier.plan.layer_plan import LayerPlan
from moetier.plan.on_demand import OnDemandStage
from moetier.plan.route import DECODE, PREFILL, RouteResult
from moetier.plan.similar_substitute import SimilarSubstitution
from tests.handmade_plan import resident as cache

E = 6
# expert 3 is most like 5 (0.9), then 4 (0.7); expert 2 like 4 (0.6); everything else 0.1
SIM = np.full((E, E), 0.1, np.float32)
np.fill_diagonal(SIM, 1.0)
for a, b, s in ((3, 5, 0.9), (3, 4, 0.7), (2, 4, 0.6)):
    SIM[a, b] = SIM[b, a] = s


def route(ids, weights, phase=DECODE):
    ids, w = np.array([ids], np.int64), np.array([weights], np.float32)
    scores = np.zeros((1, E), np.float32)
    np.put_along_axis(scores, ids, w, axis=1)
    return RouteResult(0, 1, ids, w, scores, phase)


def run(r, rt, **kw):
    stage = SimilarSubstitution(similarity={0: SIM}, **kw).stage(r, "bf16")
    return stage(LayerPlan.exact(rt, "bf16"))


def test_a_missing_low_priority_expert_runs_as_its_most_similar_cached_one():
    plan = run(cache(0, 4, 5), route([0, 1, 3], [0.6, 0.3, 0.1]))  # 3 missing, 0.1 < an even share (1/3)
    assert plan.assign_ids.tolist() == [[0, 1, 5]]  # 3 -> 5 (0.9); 1 (0.3) is below 1/3 too but like nothing
    assert plan.assign_weights[0].tolist() == pytest.approx([0.6, 0.3, 0.1])  # the replaced expert's weight
    assert [ld.expert for ld in OnDemandStage(cache(0, 4, 5))(plan).loads] == [1]


def test_the_first_expert_and_important_ones_load_whatever_is_cached():
    # 3 is the token's first: it loads though 5 (0.9 alike) is cached; 2 (0.45 < an even share, 0.5) runs as 4
    plan = run(cache(4, 5), route([3, 2], [0.55, 0.45]))
    assert plan.assign_ids.tolist() == [[3, 4]]
    plan = run(cache(4, 5), route([3, 2], [0.55, 0.45]), share=0.8)  # the bar 0.8 · 1/2 = 0.4: 2 is important
    assert plan.assign_ids.tolist() == [[3, 2]]


def test_a_substitute_must_be_similar_enough_and_not_already_run():
    assert run(cache(0, 4), route([0, 1, 2], [0.5, 0.3, 0.2])).assign_ids.tolist() == [[0, 1, 4]]  # 2 -> 4 (0.6)
    assert run(cache(0, 4), route([0, 1, 2], [0.5, 0.3, 0.2]), min_similarity=0.65).assign_ids.tolist() == \
        [[0, 1, 2]]
    # 3 and 2 missing, both low: 3 takes 5, 2 takes 4
    assert run(cache(0, 4, 5), route([0, 3, 2], [0.6, 0.2, 0.2])).assign_ids.tolist() == [[0, 5, 4]]
    # one candidate for two: the first low one (in column order) takes it, the other loads
    assert run(cache(0, 4), route([0, 3, 2], [0.6, 0.2, 0.2])).assign_ids.tolist() == [[0, 4, 2]]


def test_prompts_run_as_routed_and_bad_settings_are_refused():
    rt = route([0, 1, 3], [0.6, 0.3, 0.1], phase=PREFILL)
    assert run(cache(0, 4, 5), rt).assign_ids.tolist() == [[0, 1, 3]]
    with pytest.raises(MoetierError):
        SimilarSubstitution(min_similarity=2.0)
    with pytest.raises(ValueError, match="similarity"):
        SimilarSubstitution().stage(cache(0), "bf16")


def test_the_similarity_file_is_read_checked_and_refused_by_name(tmp_path):
    """policies/similarity.json: saved and read back; a missing file, a damaged one and one of another shape are
    refused, each naming the command that writes it."""
    from moetier.policy_files import load_similarity, policy_file, save_similarity

    save_similarity(policy_file(tmp_path, "similarity"), {0: SIM, 2: SIM}, 0.5, "t")
    read = load_similarity(tmp_path, (0, 2), E)
    np.testing.assert_allclose(read[2], SIM, atol=1e-4)
    with pytest.raises(MoetierError, match="moetier train similarity"):
        load_similarity(tmp_path / "none", (0, 2), E)
    with pytest.raises(MoetierError, match="moetier train similarity"):
        load_similarity(tmp_path, (0, 1), E)  # another model's layers
    policy_file(tmp_path, "similarity").write_text("{not json")
    with pytest.raises(MoetierError, match="damaged"):
        load_similarity(tmp_path, (0, 2), E)


def test_an_engine_refuses_similar_substitution_without_its_file_before_the_dense_weights_load(tiny_store,
                                                                                                monkeypatch):
    from moetier.config import MemoryBudget
    from moetier.engine.engine import Engine, EngineConfig
    from moetier.store.store import Store

    _, path = tiny_store("mixtral")
    monkeypatch.setattr(Store, "load_dense", lambda *a, **k: pytest.fail("the dense weights were loaded"))
    with pytest.raises(MoetierError, match="moetier train similarity"):
        Engine(Store(path), EngineConfig(expert_memory=MemoryBudget.parse("50%"), substitution=SimilarSubstitution()))
