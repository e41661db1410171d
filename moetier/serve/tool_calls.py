"""How a model writes a tool call, read back from its output, and the grammar that forces one.

A chat template that takes `tools` tells the model how to call them; the model then writes its calls in its
family's own form. Known here: Hermes' — `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block
a call, as Qwen2.5, Qwen3 (and their MoE models) and Hermes write them — recognised by its tag in the template. A
template that renders tools but writes calls in another form is refused (a 400 saying so), not guessed at.

`tool_choice` "required" (or a named function) holds the output to calls — each block a JSON object naming one of
the tools with arguments to its `parameters` schema (moetier/engine/grammar.py) — one call, or one or more where
`parallel_tool_calls` allows."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from moetier.engine.grammar import Grammar, json_piece


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # JSON text
    id: str

    def openai(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


@dataclass(frozen=True)
class Parsed:
    content: str | None  # the text outside the calls (None if there is none)
    calls: tuple[Call, ...]


class HermesCalls:
    """`<tool_call>` blocks holding {"name": ..., "arguments": ...} JSON."""

    name = "hermes"
    start, end = "<tool_call>", "</tool_call>"
    _block = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

    def writes(self, template_source: str) -> bool:
        return self.start in template_source

    def parse(self, text: str) -> Parsed:
        """The calls in `text` and what is left. A block that is not a call (not JSON, no name) stays text, as does
        one left open (the output ended inside it)."""
        calls, kept, at = [], [], 0
        for m in self._block.finditer(text):
            call = _call(m.group(1))
            if call is None:
                continue
            kept.append(text[at:m.start()])
            calls.append(call)
            at = m.end()
        kept.append(text[at:])
        content = "".join(kept).strip()
        return Parsed(content or None, tuple(calls))

    def held_from(self, text: str) -> int:
        """Where text that may belong to a call begins (streamed content stops there): the first start tag, or a
        tail that could be the start of one."""
        i = text.find(self.start)
        if i >= 0:
            return i
        for n in range(min(len(self.start) - 1, len(text)), 0, -1):
            if self.start.startswith(text[-n:]):
                return len(text) - n
        return len(text)

    def grammar(self, tools: list, parallel: bool) -> Grammar:
        """Output that is calls alone: one block (or several, `parallel`) each calling one of `tools` (OpenAI Tool
        objects) with arguments to its schema."""
        objects = [{"type": "object", "properties": {"name": {"const": t.function.name},
                                                     "arguments": t.function.parameters or {"type": "object"}},
                    "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
        call = json_piece(objects[0] if len(objects) == 1 else {"anyOf": objects})
        block = r'"<tool_call>\n" call "\n</tool_call>"'
        start = f"start: {block} (\"\\n\" {block})*" if parallel else f"start: {block}"
        names = ", ".join(t.function.name for t in tools)
        return Grammar.lark(f"{start}\ncall: {call}\n", f"a call of {names}")


def _call(text: str) -> Call | None:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return Call(obj["name"], arguments, f"call_{uuid.uuid4().hex[:24]}")


FORMATS = (HermesCalls(),)


def call_format(template_source: str):
    """The form the template's model writes calls in, or None."""
    return next((f for f in FORMATS if f.writes(template_source)), None)
