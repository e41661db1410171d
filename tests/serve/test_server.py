"""`moetier serve`'s API through the real `openai` client: answers equal the engine's alone, streaming, logprobs,
stop strings, usage, concurrency, and every bad input a 4xx."""

import concurrent.futures
import json

import httpx
import openai
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.serve.conftest import MAX_MODEL_LEN, Served, prompts


def client(served: Served, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=served.url + "/v1", api_key=key, max_retries=0, timeout=60)


def test_completions_equal_the_engine_alone_with_usage(served, reference):
    tok = reference.engine.tokenizer
    for p in prompts(3):
        r = client(served).completions.create(model="tiny", prompt=p, max_tokens=10, temperature=0)
        want = reference(p, 10)
        assert r.choices[0].text == tok.decode(want)
        assert r.usage.prompt_tokens == len(tok.encode(p)) and r.usage.completion_tokens == len(want)
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
        assert r.choices[0].finish_reason == ("stop" if want[-1] == 0 else "length")
    ids = tok.encode(prompts(1, seed=9)[0])  # a prompt as token ids, and several prompts at once
    r = client(served).completions.create(model="tiny", prompt=[ids, ids[:3]], max_tokens=5, temperature=0)
    assert [c.text for c in r.choices] == [tok.decode(reference(ids, 5)), tok.decode(reference(ids[:3], 5))]


def test_streaming_gives_the_same_text_then_usage(served, reference):
    p = prompts(1, seed=1)[0]
    stream = client(served).completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == reference.engine.tokenizer.decode(
        reference(p, 12))
    assert chunks[-1].usage.completion_tokens == len(reference(p, 12))
    with httpx.stream("POST", served.url + "/v1/completions", json={"prompt": p, "max_tokens": 3, "stream": True},
                      timeout=60) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)


def test_chat_uses_the_template_and_equals_engine_chat(served, reference):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "once upon a time"}]
    r = client(served).chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == reference.engine.chat(messages, max_new_tokens=10)
    rendered = reference.engine.tokenizer.chat_template.render(messages)
    assert rendered.endswith("<|im_start|>assistant\n")
    assert r.usage.prompt_tokens == len(reference.engine.tokenizer.encode(rendered, add_bos=False))
    stream = client(served).chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                                    stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == r.choices[0].message.content


def test_logprobs_and_echo_score_the_prompt(served, reference):
    engine = reference.engine
    p = prompts(1, seed=2)[0]
    ids = engine.tokenizer.encode(p)
    r = client(served).completions.create(model="tiny", prompt=ids, max_tokens=1, temperature=0, echo=True,
                                          logprobs=1)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == len(ids) + 1 and lp.token_logprobs[0] is None
    from moetier.model.batch import StepBatch
    from moetier.model.kv_cache import KVCache

    logits = engine.model.forward(StepBatch.prefill([ids], [0]), KVCache(engine.spec, 1, 64, engine.model.dtype),
                                  all_logits=True).float()
    want = torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist()
    assert lp.token_logprobs[1:len(ids)] == pytest.approx(want, abs=1e-4)
    assert r.choices[0].text.startswith(engine.tokenizer.decode(ids))
    greedy = [max(top.values()) == chosen for top, chosen in zip(lp.top_logprobs[1:], lp.token_logprobs[1:])]
    assert greedy[-1]  # the generated token is the greedy one
    chat = client(served).chat.completions.create(model="tiny", messages=[{"role": "user", "content": p}],
                                                  max_tokens=3, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.logprob == pytest.approx(c.top_logprobs[0].logprob) for c in content)


def test_stop_strings_cut_the_text(served, reference):
    tok = reference.engine.tokenizer
    p = prompts(1, seed=3)[0]
    full = tok.decode(reference(p, 20))
    stop = full[len(full) // 2:len(full) // 2 + 3]
    r = client(served).completions.create(model="tiny", prompt=p, max_tokens=20, temperature=0, stop=[stop, "@@@"])
    assert r.choices[0].text == full[:full.index(stop)] and r.choices[0].finish_reason == "stop"
    stream = client(served).completions.create(model="tiny", prompt=p, max_tokens=20, temperature=0, stop=stop,
                                               stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == full[:full.index(stop)]


def test_eight_clients_four_requests_each(text_store, reference):
    served = Served(text_store, max_running=3, max_queue=6)
    try:
        jobs = [(p, 4 + i % 5) for i, p in enumerate(prompts(32, seed=4))]
        tok = reference.engine.tokenizer
        want = {(p, n): tok.decode(reference(p, n)) for p, n in jobs}

        def one_client(mine):
            answers = []
            for p, n in mine:
                try:
                    r = client(served).completions.create(model="tiny", prompt=p, max_tokens=n, temperature=0)
                    answers.append((p, n, r.choices[0].text))
                except openai.RateLimitError as e:
                    assert e.response.headers.get("retry-after")
                    answers.append((p, n, None))
            return answers

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            results = [a for got in pool.map(one_client, [jobs[i::8] for i in range(8)]) for a in got]
        answered = [(p, n, text) for p, n, text in results if text is not None]
        assert len(results) == 32 and len(answered) >= 8
        assert all(text == want[(p, n)] for p, n, text in answered)
        assert served.idle()
        assert httpx.get(served.url + "/health").json() == {"status": "ok"}
        r = client(served).completions.create(model="tiny", prompt=jobs[0][0], max_tokens=jobs[0][1], temperature=0)
        assert r.choices[0].text == want[jobs[0]]  # still serving
        metrics = httpx.get(served.url + "/metrics").text
        assert "moetier_requests_total" in metrics and "moetier_time_to_first_token_seconds_bucket" in metrics
    finally:
        served.close()


def test_a_client_that_goes_away_is_aborted(served):
    with httpx.stream("POST", served.url + "/v1/completions", timeout=60,
                      json={"prompt": "once upon a time", "max_tokens": 80, "stream": True}) as r:
        next(r.iter_lines())
    assert served.idle()


BAD = [
    (b"{not json", 400),
    (json.dumps([1, 2]).encode(), 400),
    (json.dumps({"prompt": 5}).encode(), 400),
    (json.dumps({"prompt": "x", "max_tokens": -1}).encode(), 400),
    (json.dumps({"prompt": "x", "max_tokens": 10 ** 9}).encode(), 400),
    (json.dumps({"prompt": "x", "max_tokens": "many"}).encode(), 400),
    (json.dumps({"prompt": "x", "model": "gpt-9"}).encode(), 404),
    (json.dumps({"prompt": ""}).encode(), 400),
    (json.dumps({"prompt": []}).encode(), 400),
    (json.dumps({"prompt": [[]]}).encode(), 400),
    (json.dumps({"prompt": [10 ** 6]}).encode(), 400),
    (json.dumps({"prompt": "the " * (2 * MAX_MODEL_LEN)}).encode(), 400),
    (json.dumps({"prompt": "x", "temperature": -1}).encode(), 400),
    (json.dumps({"prompt": "x", "top_p": 0}).encode(), 400),
    (json.dumps({"prompt": "x", "logprobs": 99}).encode(), 400),
    (b'{"prompt": "x", "temperature": Infinity}', 400),  # (Python's json reads it; the range check refuses it)
    (json.dumps({"prompt": "x", "stop": [""] * 2, "max_tokens": 2}).encode(), 200),
]


@pytest.mark.parametrize("body,status", BAD)
def test_bad_bodies_are_4xx_with_an_openai_error(served, body, status):
    r = httpx.post(served.url + "/v1/completions", content=body, headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == status, r.text
    if status >= 400:
        assert set(r.json()["error"]) >= {"message", "type"}


def test_chat_refusals(served):
    for body in ({"messages": []}, {"messages": [{"role": "wizard", "content": "x"}]}, {"messages": "hi"}):
        r = httpx.post(served.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400 and "error" in r.json()
    assert httpx.get(served.url + "/v1/nothing").status_code == 404
    assert httpx.get(served.url + "/v1/completions").status_code == 405
    models = httpx.get(served.url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny"]


def test_api_key_and_body_limit(text_store):
    served = Served(text_store, api_key="s3cret", max_body_bytes=2000)
    try:
        with pytest.raises(openai.AuthenticationError):
            client(served, "wrong").completions.create(model="tiny", prompt="x", max_tokens=1)
        r = httpx.post(served.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        ok = client(served, "s3cret").completions.create(model="tiny", prompt="the", max_tokens=2)
        assert ok.usage.completion_tokens >= 1
        r = httpx.post(served.url + "/v1/completions", headers={"authorization": "Bearer s3cret"},
                       json={"prompt": "x" * 5000, "max_tokens": 1})
        assert r.status_code == 413 and "error" in r.json()
        assert httpx.get(served.url + "/health").status_code == 200  # (no key needed to ask if it is up)
    finally:
        served.close()


JSON = st.recursive(st.none() | st.booleans() | st.integers(-2, 10 ** 6) | st.floats(allow_nan=False, allow_infinity=False) | st.text(
    max_size=8), lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=10)
FIELDS = ["prompt", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "logprobs", "echo", "n", "model",
          "messages"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=6), chat=st.booleans())
def test_no_generated_body_gets_a_5xx(served, body, chat):
    if isinstance(body.get("max_tokens"), int) and not isinstance(body.get("max_tokens"), bool):
        body["max_tokens"] = min(body["max_tokens"], 4)  # (a valid one runs: keep it short)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    r = httpx.post(served.url + path, json=body, timeout=60)
    assert r.status_code < 500, (body, r.text)
    if r.status_code >= 400:
        assert "error" in r.json()
