"""OpenAI's request bodies — the fields moetier honours, and no others: a field it does not honour
(`response_format`, `tools`, `best_of`, `suffix`, ...) is refused with a 400 naming it, never accepted and ignored —
and the pieces of its answers. Sampling fields beyond OpenAI's are vLLM's names (`top_k`, `min_p`,
`repetition_penalty`, `ignore_eos`)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

TokenIds = list[Annotated[int, Field(ge=0)]]
Stop = str | list[str] | None
MAX_SEED = 2**63 - 1


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


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart] | None = None
    name: str | None = None  # (handed to the chat template, which may use it)

    def plain(self) -> dict:
        """As a chat template reads it: text content (the text parts of a list joined)."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {**self.model_dump(exclude_none=True), "content": content or ""}


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    max_completion_tokens: int | None = Field(default=None, ge=0)

    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def error_body(message: str, kind: str, code: str | None = None, param: str | None = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
