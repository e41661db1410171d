"""`moetier serve` and `moetier chat` as commands: refusals before anything loads, SIGTERM draining the requests in
flight, and the terminal chat's turns, history and /reset."""

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from moetier.cli import main
from tests.serve.conftest import free_port


@pytest.mark.parametrize("args,says", [
    (["--host", "0.0.0.0"], "needs an API key"),
    (["--port", "0"], "--port"),
    (["--max-model-len", "100000"], "context window"),
    (["--max-running", "0"], "--max-running"),
    (["--replicas", "2"], "add --ray"),
    (["--speculate", "-1"], "--speculate takes"),
])
def test_serve_refuses_before_loading(text_store, capsys, args, says):
    assert main(["serve", "--model", str(text_store), *args]) == 1
    err = capsys.readouterr().err
    assert err.startswith("moetier: error:") and says in err and "expert cache" not in err


@pytest.mark.parametrize("command", ["serve", "chat"])
def test_the_engine_options_of_serve_and_chat_reach_the_engine(command):
    from moetier.cli import build_parser
    from moetier.cli.serve import engine_config

    args = build_parser().parse_args([command, "--cache-partition", "per-layer", "--speculate", "3", "--policy", "lfu"])
    config = engine_config(args)
    assert config["cache_partition"] == "per-layer" and config["policy"] == "lfu"
    assert config["speculation"].tokens == 3


def test_serve_on_ray_refuses_without_ray_serve_or_replicas(text_store, capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("ray", "grpc") else real(name, *a))
    assert main(["serve", "--model", str(text_store), "--ray", "--port", str(free_port())]) == 1
    assert "pip install 'moetier[ray]'" in capsys.readouterr().err


def test_serve_refuses_a_port_in_use(text_store, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert main(["serve", "--model", str(text_store), "--port", str(s.getsockname()[1])]) == 1
    err = capsys.readouterr().err
    assert "cannot listen" in err and "expert cache" not in err


def test_sigterm_finishes_the_requests_in_flight_then_exits(text_store):
    port = free_port()
    env = {**os.environ, "MOETIER_API_KEY": ""}
    proc = subprocess.Popen([sys.executable, "-m", "moetier.cli", "serve", "--model", str(text_store), "--port", str(port),
                             "--max-model-len", "96"], stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "the server did not come up"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        body = {"prompt": "once upon a time", "max_tokens": 60, "stream": True, "temperature": 0}
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            first = next(lines)
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        assert first.startswith("data: ") and rest[-1] == "data: [DONE]"
        assert '"finish_reason": "length"' in rest[-2] or '"finish_reason": "stop"' in rest[-2]
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def test_chat_keeps_history_resets_and_stops(text_store):
    from moetier import Engine
    from moetier.cli.chat import run_chat

    lines = iter(["once upon a time", "and then", "/reset", "", "once upon a time", "/exit"])
    out = []
    seen = []
    with Engine.from_pretrained(text_store, expert_memory="50%", progress=False) as engine:
        chat = engine.chat

        def spy(messages, *a, **kw):
            seen.append([m["content"] for m in messages])
            return chat(messages, *a, **kw)

        engine.chat = spy
        run_chat(engine, 6, {"temperature": 0.0, "seed": 0}, system="be brief", read=lambda _: next(lines),
                 write=out.append)
    assert seen[0] == ["be brief", "once upon a time"]
    assert seen[1][:2] == ["be brief", "once upon a time"] and seen[1][-1] == "and then" and len(seen[1]) == 4
    assert seen[2] == seen[0]  # after /reset, the same first turn
    assert "(a new conversation)\n" in out


def test_a_message_longer_than_the_context_window_is_refused_and_the_conversation_goes_on(text_store, capsys):
    from moetier import Engine
    from moetier.cli.chat import run_chat

    with Engine.from_pretrained(text_store, expert_memory="50%", progress=False) as engine:
        huge = "the " * (engine.spec.max_position_embeddings + 10)
        lines = iter(["once upon a time", huge, "and then", "/exit"])
        seen = []
        chat = engine.chat

        def spy(messages, *a, **kw):
            seen.append([m["content"] for m in messages])
            return chat(messages, *a, **kw)

        engine.chat = spy
        run_chat(engine, 4, {"temperature": 0.0}, read=lambda _: next(lines), write=lambda _: None)
    assert "moetier: error: the message is" in capsys.readouterr().err
    assert len(seen) == 2 and seen[1][0] == "once upon a time" and seen[1][-1] == "and then"  # kept, without it


def test_chat_without_a_template_says_so(tiny_store, capsys):
    _, path = tiny_store("olmoe")
    assert main(["chat", "--model", str(path)]) == 1
    assert "chat template" in capsys.readouterr().err
