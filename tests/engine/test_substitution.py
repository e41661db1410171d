"""SMoE's substitution in the real engine: off or at α 0 it is exact mode; on, it computes what its plans say; its α
can be tuned to a TPOT budget."""

import pytest
import torch

from moetier import Engine
from moetier.config import MemoryBudget
from moetier.engine.engine import EngineConfig
from moetier.errors import MoetierError
from moetier.plan.substitute import Substitution
from moetier.sim.replay import PlanLog
from moetier.store.store import Store


def prompts(vocab: int = 128) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (7, 12, 9)]


def engine(path, substitution=None, memory="50%", **kw):
    config = EngineConfig(expert_memory=MemoryBudget.parse(memory), substitution=substitution, **kw)
    return Engine(Store(path), config)


def generate(path, substitution=None, batch=False, **kw):
    with engine(path, substitution, **kw) as e:
        if batch:
            return e.generate(prompts(), max_new_tokens=10, ignore_eos=True)
        return [e.generate([p], max_new_tokens=10, ignore_eos=True) for p in prompts()]


@pytest.mark.parametrize("batch", [False, True])
def test_alpha_zero_is_exact_mode(tiny_store, batch):
    _, path = tiny_store("qwen2_moe", num_hidden_layers=4)
    exact, zero = generate(path, batch=batch), generate(path, Substitution(alpha=0.0), batch=batch)
    ids = (lambda out: out.token_ids) if batch else (lambda outs: [o.token_ids for o in outs])
    assert ids(zero) == ids(exact)


def test_substitution_reads_less_and_runs_the_substitutes_it_planned(tiny_store):
    _, path = tiny_store("qwen2_moe", num_hidden_layers=4)
    exact = generate(path, batch=True)
    with engine(path, Substitution(alpha=0.6)) as e:
        log = PlanLog()
        e.executor.layer_step.hooks.append(log)
        out = e.generate(prompts(), max_new_tokens=10, ignore_eos=True)
    dec = out.stats["decode"]
    assert dec["substituted"] > 0 and out.stats["prefill"]["substituted"] == 0
    assert dec["bytes_read"] < exact.stats["decode"]["bytes_read"]
    for plan in log.plans:  # every assigned expert ran, from a slot that held it, and nothing else did
        assert sorted(r.expert for r in plan.runs) == plan.experts
        changed = plan.assign_ids != plan.route.topk_ids
        sub_scores = plan.route.scores[changed.nonzero()[0], plan.assign_ids[changed]]
        old_scores = plan.route.scores[changed.nonzero()[0], plan.route.topk_ids[changed]]
        assert (sub_scores <= old_scores).all()  # a substitute scores no more than what it replaced


def test_the_tpot_budget_sets_alpha_and_a_substitution_free_engine_refuses(tiny_store):
    _, path = tiny_store("qwen2_moe", num_hidden_layers=4)
    with engine(path, Substitution(alpha=0.0)) as e:
        loose = e.tune_substitution(10.0, [prompts()[0]], tokens=4, alphas=(0.0, 0.3))
        assert loose.met and loose.alpha == 0.0 and e.executor.substitution.alpha == 0.0
        tight = e.tune_substitution(1e-9, [prompts()[0]], tokens=4, alphas=(0.0, 0.3))
        assert not tight.met and e.executor.substitution.alpha == tight.alpha
        assert "cannot be met" in tight.describe()
    with engine(path) as e, pytest.raises(MoetierError, match="no alpha to tune"):
        e.tune_substitution(0.08, [prompts()[0]])
