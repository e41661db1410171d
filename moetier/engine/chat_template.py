"""A model's chat template (`chat_template` in tokenizer_config.json, or a chat_template.jinja beside it), rendered
as transformers renders it: a sandboxed Jinja environment with trim_blocks and lstrip_blocks, loop controls, its
`tojson` (no HTML escaping), `raise_exception` and `strftime_now`, and the special tokens by name."""

from __future__ import annotations

import json
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from moetier.errors import MoetierError

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class ChatTemplateError(MoetierError):
    pass


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str] | None = None) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        self.template, self.error, self.source, self.variables = None, None, source, frozenset()
        try:
            self.template = env.from_string(source)
            self.variables = frozenset(jinja2.meta.find_undeclared_variables(env.parse(source)))
        except jinja2.exceptions.TemplateError as e:  # said when a chat needs it, not to every command
            self.error = f"the model's chat template does not compile: {e}"
        self.special_tokens = dict(special_tokens or {})

    @property
    def takes_tools(self) -> bool:
        """The template renders a `tools` list (transformers' convention for tool definitions)."""
        return "tools" in self.variables

    @classmethod
    def from_settings(cls, settings: dict, jinja_file: str | None = None) -> ChatTemplate | None:
        """The template tokenizer_config.json names (a string, or the "default" of a list of named ones), or the
        text of chat_template.jinja; None if there is none."""
        source = jinja_file or settings.get("chat_template")
        if isinstance(source, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        if not isinstance(source, str) or not source:
            return None
        return cls(source, {name: _token_text(settings.get(name)) for name in SPECIAL_TOKENS
                            if _token_text(settings.get(name)) is not None})

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        """The conversation as the prompt text the model was trained on, ending where the assistant's answer
        starts (`add_generation_prompt`)."""
        if self.template is None:
            raise ChatTemplateError(self.error)
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        **self.special_tokens, **extra)
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"the chat template refused these messages: {e}") from None


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json gives it: text, or an AddedToken's {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None
