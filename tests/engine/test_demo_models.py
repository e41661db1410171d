"""The shipped demo models: they load in transformers and in moetier, agree with each other, and write
recognisable English."""

import re

import pytest
import torch

from moetier import Engine
from moetier.model.batch import StepBatch
from moetier.model.kv_cache import KVCache
from moetier.resolve import builtin_models
from train.corpus import code_documents, detokenise, prose_documents, read_book

NAMES = ["demo-fine", "demo-coarse", "demo-deep"]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    made = {name: Engine.from_pretrained(name, expert_memory="30%", cache_dir=cache, progress=False) for name in NAMES}
    yield made
    for e in made.values():
        e.close()


def held_out_text() -> str:  # Alice is a validation book: never trained on
    lines = read_book("carroll-alice.txt").splitlines()[20:60]
    return "\n".join(detokenise(line) for line in lines)


@pytest.mark.parametrize("name", NAMES)
def test_demo_model_agrees_with_transformers(engines, name):
    from transformers import AutoModelForCausalLM

    engine = engines[name]
    ref = AutoModelForCausalLM.from_pretrained(builtin_models()[name], dtype=torch.float32).eval()
    ids = engine.tokenizer.encode(held_out_text())[:160]
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0].argmax(-1)
    kv = KVCache(engine.spec, 1, len(ids), engine.model.dtype)
    ours = engine.model.forward(StepBatch.prefill([ids], [0]), kv, all_logits=True).argmax(-1)
    # the store is bf16 and the reference runs in fp32, so a few near-ties may flip
    assert (ours == expected).float().mean().item() >= 0.9


@pytest.mark.parametrize("name", NAMES)
def test_demo_model_writes_english(engines, name):
    words = set(re.findall(r"[a-z]+", " ".join(prose_documents().values()).lower()))
    text = engines[name].generate("It was a fine morning, and", max_new_tokens=40).texts[0]
    generated = re.findall(r"[a-z]+", text.lower())
    assert len(generated) >= 10
    assert sum(w in words for w in generated) / len(generated) >= 0.8, text


@pytest.mark.parametrize("name", NAMES)
def test_demo_model_writes_python_like_code(engines, name):
    words = set(re.findall(r"[A-Za-z_]+", " ".join(code_documents().values())))
    text = engines[name].generate("def read_config(path):\n", max_new_tokens=48).texts[0]
    generated = re.findall(r"[A-Za-z_]+", text)
    assert len(generated) >= 8
    assert sum(w in words for w in generated) / len(generated) >= 0.8, text
    assert any(k in generated for k in ("return", "self", "if", "for", "def", "import")), text
