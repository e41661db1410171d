"""Chat templates render as transformers renders them (its Jinja settings, filters and globals)."""

import pytest
from transformers import PreTrainedTokenizerFast

from moetier.engine.chat_template import ChatTemplate, ChatTemplateError
from tests.serve.conftest import CHATML, ROOT

# trim_blocks/lstrip_blocks, loop controls, tojson without HTML escaping, raise_exception, the special tokens
RICH = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}{% continue %}{% endif %}"
        "{% if m['role'] not in ['user', 'assistant'] %}{{ raise_exception('bad role') }}{% endif %}\n"
        "  [{{ m['role'] }}] {{ m['content'] | tojson }}{{ eos_token }}\n"
        "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")
MESSAGES = [{"role": "system", "content": "ignored <b>"}, {"role": "user", "content": "héllo \"you\" <&>"},
            {"role": "assistant", "content": "hi"}, {"role": "user", "content": "again"}]


@pytest.mark.parametrize("source", [CHATML, RICH])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_renders_as_transformers(source, add_generation_prompt):
    hf = PreTrainedTokenizerFast(tokenizer_file=str(ROOT / "models/demo-fine/tokenizer.json"), bos_token="<s>",
                                 eos_token="</s>")
    want = hf.apply_chat_template(MESSAGES, chat_template=source, tokenize=False,
                                  add_generation_prompt=add_generation_prompt)
    ours = ChatTemplate.from_settings({"chat_template": source, "bos_token": "<s>",
                                       "eos_token": {"content": "</s>"}})
    assert ours.render(MESSAGES, add_generation_prompt) == want


def test_named_templates_broken_ones_and_refusals():
    assert ChatTemplate.from_settings({}) is None
    named = ChatTemplate.from_settings({"chat_template": [{"name": "tool_use", "template": "T"},
                                                          {"name": "default", "template": "D{{ messages|length }}"}]})
    assert named.render(MESSAGES) == "D4"
    broken = ChatTemplate.from_settings({"chat_template": "{% for %}"})  # made, refused only when used
    with pytest.raises(ChatTemplateError, match="does not compile"):
        broken.render(MESSAGES)
    with pytest.raises(ChatTemplateError, match="bad role"):
        ChatTemplate(RICH).render([{"role": "tool", "content": "x"}])
    with pytest.raises(ChatTemplateError):  # the sandbox: no reaching into Python's insides
        ChatTemplate("{{ messages.__class__.__mro__ }}").render(MESSAGES)
