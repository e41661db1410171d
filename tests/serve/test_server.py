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
    stream = client(served).completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0, stream=True,
                                               stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == reference.engine.tokenizer.decode(
        reference(p, 12))
    assert chunks[-1].usage.completion_tokens == len(reference(p, 12))
    unasked = list(client(served).completions.create(model="tiny", prompt=p, max_tokens=3, temperature=0,
                                                     stream=True))
    assert all(c.usage is None for c in unasked)  # (OpenAI's: usage only when stream_options asks for it)
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


JSON = st.recursive(st.none() | st.booleans() | st.integers(-2, 10 ** 6) | st.integers(-2 ** 70, 2 ** 70)
                    | st.floats() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
                    max_leaves=10)
FIELDS = ["prompt", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "logprobs", "echo", "n", "model",
          "messages", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias",
          "stream_options", "response_format", "max_completion_tokens"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=6), chat=st.booleans())
def test_no_generated_body_gets_a_5xx(served, body, chat):
    if isinstance(body.get("max_tokens"), int) and not isinstance(body.get("max_tokens"), bool):
        body["max_tokens"] = min(body["max_tokens"], 4)  # (a valid one runs: keep it short)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    # (Python's json writes nan and inf as NaN and Infinity, which the server's json reads, as clients may send)
    r = httpx.post(served.url + path, content=json.dumps(body), headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code < 500, (body, r.text)
    if r.status_code >= 400:
        assert "error" in r.json()


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("field,value", [
    ("response_format", {"type": "json_object"}), ("tools", [{"type": "function", "function": {"name": "f"}}]),
    ("tool_choice", "auto"), ("best_of", 2), ("suffix", "!"), ("functions", []), ("parallel_tool_calls", True),
    ("logit_bias", {"x": 1}), ("stream_options", {"include_usage": True, "continuous_usage_stats": True}),
])
def test_a_field_the_server_does_not_honour_is_refused_by_name(served, field, value, chat):
    """Chat honours response_format (tests/serve/test_guided.py); tools, tool_choice and parallel_tool_calls are
    refused here for their own reasons (a template without tools; no tools given), each naming the field."""
    if field == "suffix" and chat:
        field = "modalities"
    if field == "response_format" and chat:
        field, value = "prediction", {"type": "content", "content": "x"}
    body = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    r = httpx.post(served.url + path, json={**body, field: value, "max_tokens": 2}, timeout=60)
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"]


def test_image_content_is_refused_and_text_parts_are_read(served):
    image = {"type": "image_url", "image_url": {"url": "https://example.com/x.png"}}
    r = httpx.post(served.url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, image]}], "max_tokens": 2})
    assert r.status_code == 400 and "messages.0.content" in r.json()["error"]["message"]
    r = httpx.post(served.url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "max_tokens": 2})
    assert r.status_code == 200


def outcomes(served, outcome: str) -> float:
    for line in httpx.get(served.url + "/metrics").text.splitlines():
        if line.startswith(f'moetier_requests_total{{outcome="{outcome}"}}'):
            return float(line.split()[-1])
    return 0.0


def test_found_wrong_seed_max_tokens_models_health_and_negative_ids(served):
    before = outcomes(served, "invalid")
    r = httpx.post(served.url + "/v1/completions", json={"prompt": "x", "seed": 2 ** 64, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed"
    assert outcomes(served, "invalid") == before + 1  # (/metrics counts it)
    r = httpx.post(served.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                               "max_tokens": 0})
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
    assert client(served).models.retrieve("tiny").id == "tiny"
    assert httpx.get(served.url + "/v1/models/gpt-9").status_code == 404
    assert httpx.head(served.url + "/health").status_code == 200
    r = httpx.post(served.url + "/v1/completions", json={"prompt": [5, -3], "max_tokens": 2})
    assert r.status_code == 400 and "token ids must be whole numbers >= 0" in r.json()["error"]["message"]


def test_a_client_waiting_for_a_whole_answer_that_goes_away_is_aborted(served):
    before = outcomes(served, "abort")
    with pytest.raises(httpx.TimeoutException):
        httpx.post(served.url + "/v1/completions", timeout=0.3, json={
            "prompt": "once upon a time", "max_tokens": 80, "n": 8, "logprobs": 20, "ignore_eos": True})
    assert served.idle(timeout=5)
    assert outcomes(served, "abort") > before


def test_sampling_fields_are_honoured(served, reference):
    c = client(served)
    tok = reference.engine.tokenizer
    # a prompt whose greedy answer repeats a token (what the penalties act on)
    p = next(q for q in prompts(30, seed=4) if len(set(reference(q, 40))) < len(reference(q, 40)))
    plain = c.completions.create(model="tiny", prompt=p, max_tokens=40, temperature=0).choices[0].text
    assert plain == tok.decode(reference(p, 40))
    spread = c.completions.create(model="tiny", prompt=p, max_tokens=40, temperature=0,
                                  presence_penalty=2).choices[0].text
    assert spread != plain
    forced = c.completions.create(model="tiny", prompt=p, max_tokens=5, temperature=0, logit_bias={"42": 100})
    assert served.engine.tokenizer.encode(forced.choices[0].text) == [42] * 5
    draws = {c.completions.create(model="tiny", prompt=p, max_tokens=12, temperature=1.0).choices[0].text
             for _ in range(3)}
    assert len(draws) > 1  # unseeded: different answers
    seeded = {c.completions.create(model="tiny", prompt=p, max_tokens=12, temperature=1.0, seed=5,
                                   extra_body={"top_k": 20, "min_p": 0.01, "repetition_penalty": 1.3}).choices[0].text
              for _ in range(2)}
    assert len(seeded) == 1
