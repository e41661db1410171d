"""Constrained decoding (moetier/engine/grammar.py): a matcher's mask on hand-made text, the grammar's end as the
request's, a constrained request beside a free one in one batch, the model's own log-probabilities kept."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from moetier import Engine
from moetier.engine.grammar import Grammar, GrammarError, GrammarTokenizer, Matcher
from moetier.engine.kv_pool import KVPool
from moetier.engine.request import STOP, RequestParams
from moetier.engine.sampling import SamplingParams
from moetier.engine.scheduler import Scheduler
from moetier.engine.tokenizer import Tokenizer
from moetier.errors import MoetierError
from moetier.serve.protocol import Tool
from moetier.serve.tool_calls import HermesCalls

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["name", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_file(ROOT / "models/demo-fine/tokenizer.json")


@pytest.fixture(scope="module")
def vocabulary(tokenizer):
    return GrammarTokenizer(tokenizer.to_json(), 8192, [0])


def feed(matcher: Matcher, ids: list[int]) -> None:
    for t in ids:
        assert matcher.allowed()[t], f"token {t} was not allowed"
        matcher.accept(t)


def test_a_json_object_starts_with_a_brace_and_ends_where_the_object_does(tokenizer, vocabulary):
    m = Matcher(Grammar.json_object(), vocabulary)
    first = m.allowed().nonzero()[0]
    assert len(first) > 0 and all(tokenizer.decode_token(int(t)).startswith("{") for t in first)
    ids = tokenizer.encode('{"a": [1, true, "x"]}', add_bos=False)
    feed(m, ids[:-1])
    assert not m.done and not m.allowed()[0]  # end-of-sequence only once the object is whole
    feed(m, ids[-1:])
    assert m.done and m.allowed()[0]
    with pytest.raises(GrammarError, match="breaks a JSON object"):
        Matcher(Grammar.json_object(), vocabulary).accept(tokenizer.encode("x", add_bos=False)[0])


def test_the_mask_puts_what_may_not_follow_at_minus_infinity(tokenizer, vocabulary):
    m = Matcher(Grammar.json_schema(SCHEMA), vocabulary)
    feed(m, tokenizer.encode('{"name": "ab", "n": ', add_bos=False))
    logits = torch.zeros(8192)
    m.mask_(logits)
    ok = torch.isfinite(logits).nonzero().flatten().tolist()
    assert ok and all(tokenizer.decode_token(t).strip()[:1].isdigit() for t in ok)  # n's digit, nothing else


def test_a_bad_schema_is_refused_in_one_line():
    with pytest.raises(GrammarError, match="not a grammar moetier can hold output to: Invalid type: objectx"):
        Grammar.json_schema({"type": "objectx"})
    with pytest.raises(GrammarError, match="must be a JSON object"):
        Grammar.json_schema([1])


def test_parallel_calls_take_several_blocks_one_call_exactly_one(tokenizer, vocabulary):
    tool = Tool.model_validate({"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}}})
    block = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    many = Matcher(HermesCalls().grammar([tool], parallel=True), vocabulary)
    feed(many, tokenizer.encode(block, add_bos=False))
    assert not many.done and many.allowed()[0]  # it may end here, or call again
    feed(many, tokenizer.encode("\n" + block, add_bos=False))
    one = Matcher(HermesCalls().grammar([tool], parallel=False), vocabulary)
    feed(one, tokenizer.encode(block, add_bos=False))
    assert one.done


@pytest.fixture(scope="module")
def engine():
    with Engine.from_pretrained(ROOT / "models/demo-fine", expert_memory="100%", progress=False) as e:
        yield e


def test_generate_holds_every_output_to_the_schema(engine):
    out = engine.generate(["Once upon a time", "def f(x):"], max_new_tokens=60, temperature=1.0, seed=4,
                          grammar=Grammar.json_schema(SCHEMA))
    for text in out.texts:
        obj = json.loads(text)
        assert set(obj) == {"name", "n"} and len(obj["name"]) <= 12 and 0 <= obj["n"] <= 9


def test_a_held_request_beside_a_free_one_leaves_it_as_it_runs_alone_and_keeps_the_models_logprobs(engine):
    spec, model = engine.spec, engine.model
    prompt = engine.tokenizer.encode("The king said")
    free = RequestParams(SamplingParams(12), ignore_eos=True)
    held = RequestParams(SamplingParams(40), logprobs=1, grammar=Grammar.json_schema(SCHEMA))

    def run(batch: list[RequestParams]) -> list:
        s = Scheduler(model, engine.executor, KVPool(spec, len(batch), 128, model.dtype), spec.eos_token_ids,
                      engine.tokenizer)
        ids, done = [s.add_request(prompt, p) for p in batch], {}
        while s.has_work:
            for o in s.step():
                done[o.id] = o.request
        return [done[i] for i in ids]

    (alone,), (beside, h) = run([free]), run([free, held])
    assert beside.output == alone.output
    assert h.finish_reason == STOP and set(json.loads(engine.tokenizer.decode(h.output))) == {"name", "n"}
    # greedy under the mask: were log-probabilities taken after it, each token would be its own top-1; they are the
    # model's own, so where the grammar overruled the model the top-1 is another token
    assert any(e.top[0][0] != e.token for e in h.logprobs) and all(e.logprob <= 0 for e in h.logprobs)


def test_a_mask_with_nothing_allowed_is_refused_and_a_grammar_needs_a_tokenizer(tokenizer, vocabulary, engine,
                                                                                 monkeypatch):
    m = Matcher(Grammar.json_object(), vocabulary)
    with pytest.raises(GrammarError, match="breaks"):
        m.accept(tokenizer.encode("x", add_bos=False)[0])
    assert m.allowed().nonzero()[0].tolist() == [0]  # (a matcher in error allows end-of-sequence alone)
    monkeypatch.setattr(Matcher, "allowed", lambda self: np.zeros(8192, bool))
    with pytest.raises(GrammarError, match="no token may come next"):  # (never drawn from an all -inf row)
        m.mask_(torch.zeros(8192))
    spec, model = engine.spec, engine.model
    bare = Scheduler(model, engine.executor, KVPool(spec, 1, 64, model.dtype), spec.eos_token_ids)  # no tokenizer
    with pytest.raises(MoetierError, match="needs the model's tokenizer"):
        bare.add_request([5, 6, 7], RequestParams(SamplingParams(4), grammar=Grammar.json_object()))
