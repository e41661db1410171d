"""OpenAI's request bodies — the fields moetier honours, and no others: a field it does not honour
(`best_of`, `suffix`, `functions`, ...) is refused with a 400 naming it, never accepted and ignored — and the pieces
of its answers. Sampling fields beyond OpenAI's are vLLM's names (`top_k`, `min_p`,
`repetition_penalty`, `ignore_eos`)."""

from __future__ import annotations

import json
from typing import Annotated, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

TokenIds = list[Annotated[int, Field(ge=0)]]
Stop = str | list[str] | None
MAX_SEED = 2**63 - 1
Name = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]  # a function's or schema's name, as OpenAI's


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False  # a stream's last chunk carries the usage


class Sampling(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=0)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)  # vLLM's: -1 or 0, every token
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=100.0)  # over the last 64 tokens (sampling.py)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)  # None: fresh randomness (different answers)
    stop: Stop = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=8)
    user: str | None = None  # (who is asking, as OpenAI has it: it changes no answer)
    ignore_eos: bool = False  # (vLLM's extension: keep generating past end-of-sequence, for benchmarks)

    @model_validator(mode="after")
    def _stream_options_with_a_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is for a streamed answer: give stream true (or drop stream_options)")
        return self

    def stops(self) -> tuple[str, ...]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return tuple(s for s in stop if s)

    @property
    def stream_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def bias(self) -> tuple[tuple[int, float], ...]:
        """logit_bias as (token id, bias) pairs (its keys are token ids as text, as OpenAI sends them)."""
        out = []
        for key, value in (self.logit_bias or {}).items():
            if not key.strip().isdigit():
                raise ValueError(f"logit_bias: {key!r} is not a token id")
            out.append((int(key), value))
        return tuple(sorted(out))


class CompletionRequest(Sampling):
    prompt: str | list[str] | TokenIds | list[TokenIds]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)
    max_tokens: int | None = Field(default=16, ge=0)  # OpenAI's default for completions

    @field_validator("prompt", mode="before")
    @classmethod
    def _token_ids(cls, value):
        """A negative token id said as such (the union's first branch, text, would say "not a valid string")."""
        rows = value if isinstance(value, list) and value and all(isinstance(r, list) for r in value) else [value]
        for row in rows:
            if isinstance(row, list):
                for t in row:
                    if isinstance(t, int) and not isinstance(t, bool) and t < 0:
                        raise ValueError(f"token ids must be whole numbers >= 0, got {t}")
        return value

    def prompts(self) -> list[str | list[int]]:
        """Each prompt: text, or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(t, int) for t in p):
            return [list(p)]
        return list(p)


class TextPart(BaseModel):
    """A part of a message's content: text is all a language model reads (an image, audio or a file is refused)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None  # (handed to the chat template, which may use it)
    tool_calls: list[ToolCall] | None = None  # an assistant's calls, earlier in the conversation
    tool_call_id: str | None = None  # a tool's answer: to which call

    @model_validator(mode="after")
    def _roles(self):
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only an assistant message has tool_calls")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs the tool_call_id it answers")
        return self

    def plain(self) -> dict:
        """As a chat template reads it: text content (the text parts of a list joined); a call's arguments as an
        object where they are JSON (as transformers hands them to templates)."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        out = {**self.model_dump(exclude_none=True), "content": content or ""}
        if self.tool_calls is not None:
            out["tool_calls"] = [{**c.model_dump(), "function": {"name": c.function.name,
                                                                 "arguments": _json_or_text(c.function.arguments)}}
                                 for c in self.tool_calls]
        return out


def _json_or_text(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Name
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments (none: an object of anything)
    strict: bool | None = None  # (the arguments are always held to `parameters` when a call is forced)


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: Name
    description: str | None = None
    schema_: dict = Field(default_factory=dict, alias="schema")  # (empty: any JSON value)
    strict: bool | None = None  # (the output is always held to the schema)


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given with type json_schema, and only then")
        return self


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = Field(default=None, min_length=1)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _tools(self):
        if self.tools is None and (self.tool_choice not in (None, "none") or self.parallel_tool_calls is not None):
            raise ValueError("tool_choice and parallel_tool_calls need tools")
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) < len(names):
            raise ValueError("two tools have one name")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(f"tool_choice names {self.tool_choice.function.name!r}, which is not among the tools")
        return self

    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def calls_tools(self) -> bool:
        """Tools given and calls possible: the output is read for calls."""
        return self.tools is not None and self.tool_choice != "none"

    @property
    def forced_tools(self) -> list[Tool] | None:
        """The tools a call must be made to (tool_choice required: any; named: that one), else None."""
        if self.tool_choice == "required":
            return list(self.tools)
        if isinstance(self.tool_choice, NamedToolChoice):
            return [t for t in self.tools if t.function.name == self.tool_choice.function.name]
        return None


class ApiError(Exception):
    """A refusal (or a failure) as OpenAI's error body with its status."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.kind, self.code, self.param, self.headers = status, kind, code, param, headers

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(str(self), self.kind, self.code, self.param), self.status,
                            headers=self.headers)


def error_body(message: str, kind: str, code: str | None = None, param: str | None = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
