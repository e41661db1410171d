"""The scheduler: requests joining and leaving between steps decode as each would alone; rows, pins and reads are
given back; what ends a request ends it."""

import pytest
import torch

from moetier import Engine
from moetier.engine.kv_pool import KVPool
from moetier.engine.request import ABORT, LENGTH, STOP, RequestParams
from moetier.engine.sampling import SamplingParams, sample
from moetier.engine.scheduler import Scheduler
from moetier.errors import MoetierError, PromptTooLongError


def prompts(lengths: list[int], seed: int = 0, vocab: int = 128) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def scheduler(engine: Engine, rows: int = 3, max_len: int = 64, **kw) -> Scheduler:
    spec, model = engine.spec, engine.model
    return Scheduler(model, engine.executor, KVPool(spec, rows, max_len, model.dtype), spec.eos_token_ids, **kw)


def alone(engine: Engine, prompt: list[int], params: RequestParams) -> list[int]:
    s = scheduler(engine, rows=1)
    rid = s.add_request(prompt, params)
    out = []
    while s.has_work:
        out += [o.token for o in s.step() if o.id == rid]
    return out


def run(s: Scheduler, arrivals: dict[int, list[tuple[list[int], RequestParams]]]) -> tuple[dict, dict]:
    """Step `s`, adding each step's arrivals before it: ({request: tokens}, {request: finish reason})."""
    tokens, reasons, step, ids = {}, {}, 0, []
    while s.has_work or any(k >= step for k in arrivals):
        for prompt, params in arrivals.get(step, []):
            ids.append(s.add_request(prompt, params))
        for o in s.step():
            tokens.setdefault(o.id, [])
            if o.token is not None:
                tokens[o.id].append(o.token)
            if o.finished:
                reasons[o.id] = o.request.finish_reason
        step += 1
    return {i: tokens.get(i, []) for i in ids}, reasons


@pytest.fixture(scope="module")
def engine(tiny_store):
    _, path = tiny_store("olmoe")
    with Engine.from_pretrained(path, expert_memory="40%", progress=False) as e:
        yield e


def test_requests_joining_between_steps_decode_as_each_alone(engine):
    ps = prompts([5, 11, 7, 9, 4])
    greedy = [RequestParams(SamplingParams(n), ignore_eos=True) for n in (12, 6, 9, 10, 3)]
    sampled = RequestParams(SamplingParams(8, temperature=1.2, seed=5), ignore_eos=True)  # its own generator
    arrivals = {0: [(ps[0], greedy[0]), (ps[1], greedy[1])], 3: [(ps[2], greedy[2])], 4: [(ps[3], sampled)],
                9: [(ps[4], greedy[4])]}
    s = scheduler(engine, rows=3)
    got, reasons = run(s, arrivals)
    want = [alone(engine, p, params) for p, params in [(ps[0], greedy[0]), (ps[1], greedy[1]), (ps[2], greedy[2]),
                                                        (ps[3], sampled), (ps[4], greedy[4])]]
    assert list(got.values()) == want
    assert set(reasons.values()) == {LENGTH}
    assert s.kv.free == 3 and not s.requests and not s.running
    assert not engine.executor.residency._pinned["in-use"] and not engine.executor.in_flight


def test_max_running_holds_newcomers_back_until_a_row_frees(engine):
    ps = prompts([6, 6, 6], seed=1)
    s = scheduler(engine, rows=3, max_running=2)
    ids = [s.add_request(p, RequestParams(SamplingParams(n), ignore_eos=True)) for p, n in zip(ps, (3, 8, 4))]
    first = s.step()  # the prefill of the first two
    assert [o.id for o in first] == ids[:2] and len(s.waiting) == 1
    seen_running = []
    while s.has_work:
        s.step()
        seen_running.append(len(s.running))
    assert max(seen_running) <= 2 and s.kv.free == 3


def test_a_step_that_admits_nothing_drains_and_a_model_is_swapped_only_when_nothing_runs(engine):
    """What the server does for a switch of variant: the running finish, newcomers wait, then `use`."""
    s = scheduler(engine)
    first = s.add_request(prompts([5])[0], RequestParams(SamplingParams(3), ignore_eos=True))
    s.step()  # its prefill
    s.add_request(prompts([4], seed=2)[0], RequestParams(SamplingParams(2), ignore_eos=True))
    with pytest.raises(MoetierError, match="only when no request is running"):
        s.use(engine.model, engine.executor)
    while s.running:
        assert all(o.id == first for o in s.step(admit=False))  # the newcomer is not admitted
    assert len(s.waiting) == 1
    s.use(engine.model, engine.executor)
    assert [o.id for o in s.step()] == [first + 1]  # admitted once the model is in place


def test_abort_frees_the_row_and_the_others_go_on(engine):
    ps = prompts([5, 8], seed=2)
    params = RequestParams(SamplingParams(10), ignore_eos=True)
    s = scheduler(engine, rows=2)
    a, b = (s.add_request(p, params) for p in ps)
    s.step()
    s.step()
    assert s.abort(a) and not s.abort(a)
    outs = s.step()
    assert outs[0].id == a and outs[0].token is None and outs[0].finished and outs[0].request.finish_reason == ABORT
    assert s.kv.free == 1 and [r.id for r in s.running] == [b]
    rest = []
    while s.has_work:
        rest += [o.token for o in s.step() if o.id == b]
    assert len(rest) == 10 - 3
    waiting = s.add_request(ps[0], params)
    assert s.abort(waiting) and not s.waiting and s.kv.free == 2  # a waiting one never took a row


def test_eos_max_tokens_and_the_rows_length_end_requests(engine):
    p = prompts([6], seed=3)[0]
    free = alone(engine, p, RequestParams(SamplingParams(12), ignore_eos=True))
    s = scheduler(engine, rows=2, max_len=len(p) + 5)
    s.eos = frozenset({free[2]})
    got, reasons = run(s, {0: [(p, RequestParams(SamplingParams(12))),
                               (p, RequestParams(SamplingParams(12), ignore_eos=True))]})
    (eos_id, eos_out), (ctx_id, ctx_out) = got.items()
    assert eos_out == free[:free.index(free[2]) + 1] and reasons[eos_id] == STOP
    assert ctx_out == free[:6] and reasons[ctx_id] == LENGTH and s.stats.stopped_at_context == [ctx_id]


def test_a_prefill_packs_at_most_max_prefill_tokens_but_a_long_prompt_still_runs(engine):
    ps = prompts([10, 10, 30], seed=4)
    s = scheduler(engine, rows=3, max_prefill_tokens=25)
    for p in ps:
        s.add_request(p, RequestParams(SamplingParams(2), ignore_eos=True))
    assert len(s.step()) == 2 and len(s.step()) == 1  # 10 + 10, then the 30 alone


def test_logprobs_are_the_models_log_softmax(engine):
    ps = prompts([7], seed=5)
    params = RequestParams(SamplingParams(3), ignore_eos=True, logprobs=2, echo_logprobs=True)
    s = scheduler(engine, rows=1)
    rid = s.add_request(ps[0], params)
    request = s.requests[rid]
    while s.has_work:
        s.step()
    from moetier.model.batch import StepBatch
    from moetier.model.kv_cache import KVCache

    full = ps[0] + request.output[:-1]
    kv = KVCache(engine.spec, 1, 64, engine.model.dtype)
    logits = engine.model.forward(StepBatch.prefill([full], [0]), kv, all_logits=True).float()  # [N, V]
    logp = torch.log_softmax(logits, -1)
    want_prompt = [logp[i, t].item() for i, t in enumerate(ps[0][1:])]
    assert request.prompt_logprobs[0] is None
    assert [lp.logprob for lp in request.prompt_logprobs[1:]] == pytest.approx(want_prompt, abs=1e-4)
    n = len(ps[0])
    assert [lp.logprob for lp in request.logprobs] == pytest.approx(
        [logp[n - 1 + j, t].item() for j, t in enumerate(request.output)], abs=1e-4)
    assert all(lp.top[0][0] == lp.token for lp in request.logprobs)  # greedy: the chosen is the likeliest
    assert all(len(lp.top) == 2 for lp in request.logprobs + request.prompt_logprobs[1:])


def test_bad_requests_are_refused_when_added(engine):
    s = scheduler(engine, rows=1, max_len=16)
    with pytest.raises(MoetierError, match="empty"):
        s.add_request([], RequestParams())
    with pytest.raises(MoetierError, match="outside the vocabulary"):
        s.add_request([1, 10_000], RequestParams())
    with pytest.raises(PromptTooLongError, match="--max-model-len"):
        s.add_request(list(range(3, 19)), RequestParams())
    with pytest.raises(MoetierError, match="tokenizer"):
        s.add_request([5, 6], RequestParams(stop=("x",)))
    assert not s.has_work and s.kv.free == 1


def test_in_bf16_on_the_native_kernels_a_batch_decodes_as_each_alone(tiny_store):
    """A server's sequences in bf16: every product, norm and attention of a decode batch row is what that row
    computes alone, so greedy answers do not depend on who else runs."""
    _, path = tiny_store("olmoe", dtype=torch.bfloat16)
    with Engine.from_pretrained(path, expert_memory="100%", progress=False, kernels="native") as engine:
        ps = prompts([5, 9, 7, 3], seed=7)
        params = [RequestParams(SamplingParams(n), ignore_eos=True) for n in (14, 6, 10, 8)]
        got, _ = run(scheduler(engine, rows=3), {0: [(ps[0], params[0]), (ps[1], params[1])],
                                                 2: [(ps[2], params[2])], 5: [(ps[3], params[3])]})
        assert list(got.values()) == [alone(engine, p, q) for p, q in zip(ps, params)]


@pytest.mark.parametrize("config", [
    dict(policy="lfu-seq", prefetch="hobbit", predictor="stacked-gates"),
    dict(policy="arc", prefetch="smoe", predictor="stacked-gates"),
    dict(policy="lru", substitution="batch-aware"),
])
def test_policies_predictors_and_substitution_take_a_batch_whose_members_change(tiny_store, config):
    """Requests joining and leaving under every stage that keeps state across layers or steps: nothing assumes a
    fixed batch (shapes, per-sequence state), every request ends, nothing is left pinned or reading; where the
    stages change no output (prefetch, eviction), each answer is what it is alone."""
    from moetier.plan.substitute import Substitution

    _, path = tiny_store("olmoe")
    kw = dict(config)
    exact = "substitution" not in kw
    if "substitution" in kw:
        kw["substitution"] = Substitution(0.5)
    with Engine.from_pretrained(path, expert_memory="40%", progress=False, **kw) as engine:
        ps = prompts([6, 9, 4, 7], seed=11)
        params = [RequestParams(SamplingParams(n), ignore_eos=True) for n in (9, 4, 7, 5)]
        s = scheduler(engine, rows=2)
        got, reasons = run(s, {0: [(ps[0], params[0])], 1: [(ps[1], params[1]), (ps[2], params[2])],
                               6: [(ps[3], params[3])]})
        assert [len(t) for t in got.values()] == [9, 4, 7, 5] and set(reasons.values()) == {LENGTH}
        assert s.kv.free == 2 and not engine.executor.residency._pinned["in-use"]
        if exact:
            assert list(got.values()) == [alone(engine, p, q) for p, q in zip(ps, params)]


def test_greedy_takes_the_first_maximum_as_argmax_of_the_logits_dtype_does():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50304, generator=g).bfloat16()
    logits[1, [7, 9000]] = 100.0  # a tie: the first one wins
    logits[2, -1] = 100.0
    params = [SamplingParams(temperature=0.0)] * 4
    assert sample(logits, params, [g] * 4) == logits.argmax(dim=-1).tolist()
    assert sample(logits, params, [g] * 4)[1:3] == [7, 50303]
