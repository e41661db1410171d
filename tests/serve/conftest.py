"""A tiny fp32 model with a real tokenizer (demo-fine's) and a chat template, served in-process on a free
loopback port, and what the engine answers alone, for comparison."""

import json
import shutil
import socket
import threading
import time
from pathlib import Path

import pytest
import torch

from moetier import Engine
from moetier.store.convert import convert
from tests.tiny_models import build_tiny

ROOT = Path(__file__).resolve().parents[2]
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
          "{% endif %}")
MAX_MODEL_LEN = 96


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def text_store(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("serve-model")
    build_tiny("qwen2_moe", root / "hf", vocab_size=8192, eos_token_id=0, bos_token_id=0, pad_token_id=0)
    shutil.copy(ROOT / "models/demo-fine/tokenizer.json", root / "hf/tokenizer.json")
    settings = json.loads((ROOT / "models/demo-fine/tokenizer_config.json").read_text())
    (root / "hf/tokenizer_config.json").write_text(json.dumps({**settings, "chat_template": CHATML}))
    return convert(root / "hf", root / "store", progress=False)


class Served:
    """A server running in this process: its URL, its engine loop, and a way to stop it."""

    def __init__(self, store: Path, api_key: str | None = None, max_running: int = 3, max_queue: int = 8,
                 max_body_bytes: int = 1 << 20, max_model_len: int = MAX_MODEL_LEN) -> None:
        import uvicorn

        from moetier.serve.app import ServeSettings, make_app
        from moetier.serve.engine_loop import EngineLoop
        from moetier.serve.metrics import Metrics

        self.engine = Engine.from_pretrained(store, expert_memory="50%", progress=False)
        self.loop = EngineLoop(self.engine, max_running, max_model_len, 64, Metrics())
        self.loop.start()
        settings = ServeSettings("tiny", max_model_len, api_key, max_queue, max_running, max_body_bytes)
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(make_app(self.loop, settings), host="127.0.0.1", port=self.port,
                                                    log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"

    def idle(self, timeout: float = 10.0) -> bool:
        """Nothing left in the engine: no request, every KV row free, no pin, no read in flight."""
        s, deadline = self.loop.scheduler, time.monotonic() + timeout
        while time.monotonic() < deadline:
            ex = self.engine.executor
            if (not s.requests and not s.running and not s.waiting and s.kv.free == s.kv.rows
                    and not ex.residency._pinned["in-use"] and not ex.in_flight and self.loop.in_flight == 0):
                return True
            time.sleep(0.05)
        return False

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.loop.stop()
        self.engine.close()


@pytest.fixture(scope="module")
def served(text_store):
    s = Served(text_store)
    yield s
    s.close()


@pytest.fixture(scope="module")
def reference(text_store):
    """The engine alone, greedy: (prompt ids or text, max tokens) -> the token ids it generates."""
    engine = Engine.from_pretrained(text_store, expert_memory="50%", progress=False)
    cache = {}

    def run(prompt, max_tokens: int) -> list[int]:
        key = (json.dumps(prompt), max_tokens)
        if key not in cache:
            cache[key] = engine.generate([prompt], max_new_tokens=max_tokens).token_ids[0]
        return cache[key]

    run.engine = engine
    yield run
    engine.close()


def prompts(n: int, seed: int = 0) -> list[str]:
    words = "the of a little red man house went to and he she said once upon time river king old".split()
    g = torch.Generator().manual_seed(seed)
    return [" ".join(words[i] for i in torch.randint(0, len(words), (int(torch.randint(3, 12, (1,), generator=g)),),
                                                     generator=g).tolist()) for _ in range(n)]
