"""OpenAI's request bodies (the fields moetier honours; others are accepted and ignored, as OpenAI-compatible
servers do) and the pieces of its answers."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

TokenIds = list[Annotated[int, Field(ge=0)]]
Stop = str | list[str] | None


class Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=0)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: Stop = None
    stream: bool = False
    n: int = Field(default=1, ge=1, le=8)
    user: str | None = None
    ignore_eos: bool = False  # (vLLM's extension: keep generating past end-of-sequence, for benchmarks)

    def stops(self) -> tuple[str, ...]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return tuple(s for s in stop if s)


class CompletionRequest(Sampling):
    prompt: str | list[str] | TokenIds | list[TokenIds]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)
    max_tokens: int | None = Field(default=16, ge=0)  # OpenAI's default for completions

    def prompts(self) -> list[str | list[int]]:
        """Each prompt: text, or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(t, int) for t in p):
            return [list(p)]
        return list(p)


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict] | None = None

    def plain(self) -> dict:
        """As a chat template reads it: text content (the text parts of a list joined)."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.get("text", "") for part in content if isinstance(part, dict)
                              and part.get("type", "text") == "text")
        return {**self.model_dump(exclude_none=True), "content": content or ""}


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    stream_options: dict | None = None

    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def error_body(message: str, kind: str, code: str | None = None, param: str | None = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
