"""`moetier serve --ray` (moetier/serve/ray_serve.py) on a local Ray cluster of 2 engine replicas: 16 concurrent
requests answered as a single server answers them; a replica killed mid-run fails its requests cleanly and the
other keeps serving. Skipped where Ray (the `moetier[ray]` extra, with Ray Serve) is not installed."""

import concurrent.futures
import importlib.util
import time

import httpx
import openai
import pytest

from tests.serve.conftest import free_port, prompts

pytestmark = pytest.mark.skipif(importlib.util.find_spec("ray") is None or importlib.util.find_spec("grpc") is None,
                                reason="Ray Serve is not installed (pip install 'moetier[ray]')")


@pytest.fixture(scope="module")
def cluster(text_store):
    import ray
    from ray import serve

    from moetier.serve.ray_serve import build

    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build(str(text_store), 2, {"expert_memory": "50%"},
                    {"model_name": "tiny", "max_model_len": 256, "max_running": 4}, cpus_per_replica=0.5),
              name="moetier", route_prefix="/")
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the Ray Serve application did not come up"
        time.sleep(0.5)
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


def test_two_replicas_answer_sixteen_concurrent_requests_as_one_server(cluster, reference):
    c = openai.OpenAI(base_url=cluster + "/v1", api_key="none", max_retries=0, timeout=120)
    asked = prompts(16, seed=11)

    def one(p):
        return c.completions.create(model="tiny", prompt=p, max_tokens=8, temperature=0).choices[0].text

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(one, asked))
    tok = reference.engine.tokenizer
    assert answers == [tok.decode(reference(p, 8)) for p in asked]
    chat = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": asked[0]}], max_tokens=4,
                                     temperature=0, stream=True)
    assert "".join(x.choices[0].delta.content or "" for x in chat if x.choices)
    r = httpx.post(cluster + "/v1/completions", json={"prompt": "x", "max_tokens": -1}, timeout=60)
    assert r.status_code == 400 and "error" in r.json()  # (the replica's own refusal, passed through)


def test_a_replica_killed_mid_run_fails_its_requests_cleanly_and_the_other_serves(cluster):
    import threading

    import ray
    from ray import serve

    from moetier.serve.ray_serve import REPLICA_HEADER

    replicas = {a["name"]: a for a in ray.util.list_named_actors(all_namespaces=True) if "#engine#" in a["name"]}
    assert len(replicas) == 2, replicas
    asked = [{"prompt": p, "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True}
             for p in prompts(4, seed=12)]  # (new prompts: the router may spread them over both replicas, or not)
    started, lines, served = threading.Barrier(len(asked) + 1), [[] for _ in asked], [None] * len(asked)

    def stream(i: int) -> None:
        with httpx.stream("POST", cluster + "/v1/completions", json=asked[i], timeout=120) as r:
            served[i] = r.headers.get(REPLICA_HEADER)
            it = r.iter_lines()
            lines[i].append(next(it))
            started.wait(60)  # every stream is decoding: now one replica goes
            lines[i].extend(it)

    answers = [None, None]  # whole answers asked beside the streams: in flight when the replica goes

    def ask_whole(i: int) -> None:
        body = {"prompt": prompts(2, seed=13)[i], "max_tokens": 200, "temperature": 0, "ignore_eos": True}
        answers[i] = httpx.post(cluster + "/v1/completions", json=body, timeout=120)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(asked))]
    for t in threads:
        t.start()
    started.wait(60)
    # the whole answers join once the streams are placed (so that the router spreads those as it would alone)
    wholes = [threading.Thread(target=ask_whole, args=(i,)) for i in range(len(answers))]
    for t in wholes:
        t.start()
    threads += wholes
    time.sleep(0.5)
    assert set(served) <= set(replicas), served  # every answer names the replica that gave it
    victim = replicas[served[0]]  # (the one serving the first stream: whichever way the router spread them)
    ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]), no_restart=False)
    for t in threads:
        t.join(120)
    for by, x in zip(served, lines):  # the victim's streams end with an error event, the other's whole
        assert any(("replica_gone" if by == victim["name"] else '"finish_reason": "length"') in line for line in x)
        assert [line for line in x if line][-1] == "data: [DONE]", x[-3:]
    for r in answers:  # each whole answer: served by the other replica, or the victim's clean 503
        assert (r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
                and r.headers[REPLICA_HEADER] in replicas) or (
            r.status_code == 503 and r.json()["error"]["code"] == "replica_gone"), (r.status_code, r.text[:200])
    after = httpx.post(cluster + "/v1/completions", json={"prompt": "hello", "max_tokens": 4, "temperature": 0},
                       timeout=120)
    assert after.status_code == 200 and after.json()["choices"][0]["text"] is not None
    assert serve.status().applications["moetier"].status in ("RUNNING", "DEPLOYING")


def test_the_router_gets_text_to_match_or_the_path():
    from moetier.serve.ray_serve import ForwardedChat, forwarded

    chat = forwarded("POST", "/v1/chat/completions", [], b'{"messages": [{"role": "user", "content": "hi"}]}')
    assert isinstance(chat, ForwardedChat) and chat.messages[0]["content"] == "hi" and not chat.stream
    assert forwarded("POST", "/v1/completions", [], b'{"prompt": "abc", "stream": true}').prompt == "abc"
    for body in (b'{"prompt": [1, 2, 3]}', b'{"prompt": ""}', b"not json", b"",
                 b'{"messages": [{"role": "user", "content": [{"type": "text", "text": ""}]}]}'):
        path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
        assert forwarded("POST", path, [], body).prompt == path  # (no text: the router would divide by zero)
