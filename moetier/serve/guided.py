"""What a chat request's `tools`, `tool_choice` and `response_format` ask of the output, checked before anything
runs: the form calls are read back in (moetier/serve/tool_calls.py) and the grammar the output is held to
(moetier/engine/grammar.py) — or a 400 saying why it cannot be done for this model."""

from __future__ import annotations

from moetier.engine.chat_template import ChatTemplate
from moetier.engine.grammar import Grammar, GrammarError
from moetier.serve.protocol import ApiError, ChatRequest
from moetier.serve.tool_calls import call_format


def call_reader(body: ChatRequest, template: ChatTemplate, model: str):
    """The form this model's calls are read in, where the request lets it call tools (None: none read). Tools the
    template cannot show the model are refused, unless tool_choice is "none" (then nothing depends on them)."""
    if body.tools is None:
        return None
    if not template.takes_tools:
        if body.tool_choice == "none":
            return None
        raise ApiError(400, f"{model}'s chat template has no tools: the model would never see them (use a model "
                            f"whose template renders `tools`, or drop tools)", code="tools_not_supported",
                       param="tools")
    reader = call_format(template.source)
    if reader is None and body.calls_tools:
        raise ApiError(400, f"{model}'s chat template renders tools, but moetier does not know how this model "
                            f"writes a call (it reads Hermes-style <tool_call> JSON: Qwen2.5, Qwen3)",
                       code="tools_not_supported", param="tools")
    return reader if body.calls_tools else None


def output_grammar(body: ChatRequest, reader) -> Grammar | None:
    """The grammar the answer is held to: calls alone where tool_choice forces one, the response_format's JSON, or
    none."""
    forced = body.forced_tools
    json_format = body.response_format is not None and body.response_format.type != "text"
    if forced is not None and json_format:
        raise ApiError(400, "tool_choice forces a call and response_format asks for JSON: the answer cannot be both",
                       param="response_format")
    try:
        if forced is not None:
            return reader.grammar(forced, body.parallel_tool_calls is not False)
        if not json_format:
            if body.parallel_tool_calls is False:
                raise ApiError(400, "parallel_tool_calls false is honoured where tool_choice forces the call "
                                    "(required, or a named function); with auto the model decides how many",
                               param="parallel_tool_calls")
            return None
        f = body.response_format
        if f.type == "json_object":
            return Grammar.json_object()
        return Grammar.json_schema(f.json_schema.schema_, f"the JSON schema {f.json_schema.name!r}")
    except GrammarError as e:
        raise ApiError(400, str(e).split("\n")[0], param="response_format" if forced is None else "tools") from None
