"""Tools and structured output through the real `openai` client: a tiny model whose chat template renders tools
(Hermes' <tool_call> form, as Qwen's), calls forced by tool_choice and read back, streamed alike; JSON mode and JSON
schemas held by the grammar; refusals where a model cannot do it."""

import json
import shutil

import openai
import pytest

from moetier.serve.app import ChatFormat
from moetier.serve.protocol import ChatRequest
from moetier.serve.tool_calls import HermesCalls
from moetier.store.convert import convert
from tests.serve.conftest import ROOT, Served
from tests.tiny_models import build_tiny

# Qwen2.5's template, shortened: the tools in the system turn, calls and tool answers in Hermes' tags
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>\n{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}"
    "\n</tools>\nFor each call return <tool_call>\n{\"name\": <name>, \"arguments\": <args>}\n</tool_call>"
    "<|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls is defined %}<|im_start|>assistant\n"
    "{%- for tc in message.tool_calls %}<tool_call>\n{\"name\": \"{{ tc.function.name }}\", \"arguments\": "
    "{{ tc.function.arguments | tojson }}}\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response>"
    "<|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 12},
                                                "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                                                "required": ["city", "days"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a", "b"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "what is the weather in paris"}]


@pytest.fixture(scope="module")
def tools_served(tmp_path_factory):
    root = tmp_path_factory.mktemp("tools-model")
    build_tiny("qwen2_moe", root / "hf", vocab_size=8192, eos_token_id=0, bos_token_id=0, pad_token_id=0,
               max_position_embeddings=1024)
    shutil.copy(ROOT / "models/demo-fine/tokenizer.json", root / "hf/tokenizer.json")
    settings = json.loads((ROOT / "models/demo-fine/tokenizer_config.json").read_text())
    (root / "hf/tokenizer_config.json").write_text(json.dumps({**settings, "chat_template": TOOLS_TEMPLATE}))
    s = Served(convert(root / "hf", root / "store", progress=False), max_model_len=640)
    yield s
    s.close()


@pytest.fixture(scope="module")
def demo_served():
    """demo-fine, a trained model: it closes what it opens often enough for JSON mode's answers to end."""
    s = Served(ROOT / "models/demo-fine", max_model_len=1024)
    yield s
    s.close()


def client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0, timeout=60)


def check_weather(call) -> None:
    args = json.loads(call.function.arguments)
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert set(args) == {"city", "days"} and len(args["city"]) <= 12 and 1 <= args["days"] <= 7


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_named_tool_choice_makes_one_call_with_arguments_to_its_schema(tools_served, seed):
    r = client(tools_served).chat.completions.create(
        model="tiny", messages=ASK, tools=[WEATHER, ADD], seed=seed, max_tokens=80,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, parallel_tool_calls=False)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    check_weather(choice.message.tool_calls[0])


def test_required_calls_one_of_the_tools_and_a_stream_says_the_same(tools_served):
    kw = dict(model="tiny", messages=ASK, tools=[WEATHER, ADD], tool_choice="required", seed=7, max_tokens=120,
              parallel_tool_calls=False)  # (one call: a random model rarely ends a list of them)
    whole = client(tools_served).chat.completions.create(**kw)
    calls = whole.choices[0].message.tool_calls
    assert whole.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    assert all(c.function.name in ("get_weather", "add") for c in calls)
    for c in calls:
        json.loads(c.function.arguments)
    streamed, content, reasons = {}, "", []
    for chunk in client(tools_served).chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            reasons.append(choice.finish_reason)
            for tc in choice.delta.tool_calls or []:
                streamed.setdefault(tc.index, []).append((tc.function.name, tc.function.arguments))
    assert content == "" and reasons[-1] == "tool_calls"
    assert [v[0] for _, v in sorted(streamed.items())] == [(c.function.name, c.function.arguments) for c in calls]


def test_tools_are_rendered_for_the_model_and_a_conversation_with_calls_continues(tools_served):
    c = client(tools_served)
    plain = c.chat.completions.create(model="tiny", messages=ASK, max_tokens=1)
    with_tools = c.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], max_tokens=1)
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 40  # the tool's JSON and the instructions
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                             "arguments": "{\"city\": \"Paris\", \"days\": 1}"}}
    turns = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
             {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    after = c.chat.completions.create(model="tiny", messages=turns, tools=[WEATHER], max_tokens=1)
    assert after.usage.prompt_tokens > with_tools.usage.prompt_tokens + 10  # the call and its answer, rendered


def test_a_template_without_tools_is_refused_unless_no_call_is_wanted(demo_served):
    c = client(demo_served)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], max_tokens=2)
    assert e.value.code == "tools_not_supported" and "has no tools" in e.value.message
    r = c.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=2)
    assert r.choices[0].message.tool_calls is None


@pytest.mark.parametrize("body, message", [
    ({"tool_choice": "auto"}, "need tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among the tools"),
    ({"tools": [WEATHER, WEATHER]}, "two tools have one name"),
    ({"tools": [WEATHER], "parallel_tool_calls": False}, "parallel_tool_calls false is honoured where"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot be both"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "not a grammar"),
    ({"response_format": {"type": "json_schema"}}, "json_schema is given with type json_schema"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "needs the tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "only an assistant message"),
])
def test_what_cannot_be_honoured_is_a_400_saying_why(tools_served, body, message):
    with pytest.raises(openai.BadRequestError) as e:
        client(tools_served).chat.completions.create(**{"model": "tiny", "messages": ASK, "max_tokens": 2, **body})
    assert message in e.value.message


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_a_json_schema_holds_a_random_models_answer(tools_served, seed):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                               "tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                                        "maxItems": 3}},
              "required": ["name", "age", "tags"], "additionalProperties": False}
    r = client(tools_served).chat.completions.create(
        model="tiny", messages=ASK, seed=seed, max_tokens=120,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    assert r.choices[0].finish_reason == "stop"
    obj = json.loads(r.choices[0].message.content)
    assert set(obj) == {"name", "age", "tags"} and len(obj["name"]) <= 16 and 0 <= obj["age"] <= 120
    assert set(obj["tags"]) <= {"a", "b"} and len(obj["tags"]) <= 3


def test_json_mode_answers_parse_for_ten_sampled_requests(demo_served):
    """Ten sampled answers in JSON mode, each a JSON object. The room is the model's whole context, yet at 1.0 a
    small model can write a string that outlasts it (on a Sapphire Rapids the longest of twenty took 428 tokens; on a
    Zen 3, whose kernels sum in another order, one of twenty ran out): such an answer ends "length", as OpenAI's
    can, and is still the start of an object; at most one of the ten may. (Ten: twenty took 31-41 s of a Zen 3.)"""
    c = client(demo_served)
    ask = [{"role": "user", "content": "Give me a JSON object."}]
    answers = [c.chat.completions.create(model="tiny", messages=ask, seed=seed, temperature=1.0, max_tokens=1000,
                                         response_format={"type": "json_object"}).choices[0]
               for seed in range(10)]
    assert {a.finish_reason for a in answers} <= {"stop", "length"}
    finished = [a for a in answers if a.finish_reason == "stop"]
    assert len(finished) >= 9, [a.finish_reason for a in answers]
    assert all(isinstance(json.loads(a.message.content), dict) for a in finished)
    assert all(a.message.content.startswith('{"') or a.message.content == "{}" for a in answers)


def test_calls_are_read_back_from_hermes_blocks_and_a_stream_holds_back_a_tag():
    h = HermesCalls()
    text = 'Let me look. <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    parsed = h.parse(text + ' and <tool_call>not json</tool_call>')
    assert parsed.content == "Let me look.  and <tool_call>not json</tool_call>"
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [("add", {"a": 1, "b": 2})]
    assert h.parse("no calls").calls == () and h.parse("  ").content is None
    assert h.held_from("abc <tool") == 4 and h.held_from("abc <tool_call>{") == 4 and h.held_from("abc <") == 4
    assert h.held_from("a < b") == 5
    body = ChatRequest.model_validate({"messages": ASK, "tools": [ADD]})
    message, reason = ChatFormat(None, body, "m", h)._message(text, "stop")
    assert reason == "tool_calls" and message["content"] == "Let me look."
    assert message["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'}
    assert ChatFormat(None, body, "m", h)._message(text, "length")[1] == "length"


def test_a_template_that_renders_tools_in_a_form_moetier_does_not_read_is_refused():
    from moetier.engine.chat_template import ChatTemplate
    from moetier.serve.guided import call_reader
    from moetier.serve.protocol import ApiError

    other = ChatTemplate("{% for t in tools %}{{ t | tojson }}{% endfor %}[TOOL_CALLS]{{ messages[0].content }}")
    body = ChatRequest.model_validate({"messages": ASK, "tools": [WEATHER]})
    with pytest.raises(ApiError, match="does not know how this model writes a call") as e:
        call_reader(body, other, "m")
    assert e.value.status == 400 and e.value.code == "tools_not_supported"
    assert call_reader(ChatRequest.model_validate({"messages": ASK, "tools": [WEATHER], "tool_choice": "none"}),
                       other, "m") is None  # (no call wanted: nothing to read)
