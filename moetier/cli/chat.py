"""`moetier chat`: a conversation in the terminal, streamed as it is generated. The history is kept within the
context window (the oldest turns leave first; a system message stays); /reset starts again; Ctrl-C stops the
answer being written, not the program (Ctrl-D or /exit ends it)."""

from __future__ import annotations

import sys

from moetier.engine.engine import Engine
from moetier.errors import MoetierError

HELP = "/reset starts a new conversation, /exit (or Ctrl-D) ends; Ctrl-C stops an answer"


def fit_history(engine: Engine, messages: list[dict], max_new_tokens: int) -> list[dict]:
    """The latest turns whose rendered prompt leaves `max_new_tokens` of the context window (a system message
    first is kept); refused if the last message alone does not fit."""
    context = engine.spec.max_position_embeddings
    system = messages[:1] if messages and messages[0]["role"] == "system" else []
    turns = messages[len(system):]
    while turns:
        prompt = engine.tokenizer.encode(engine.tokenizer.chat_template.render(system + turns), add_bos=False)
        if len(prompt) + max_new_tokens <= context or len(turns) == 1:
            if len(prompt) >= context:
                raise MoetierError(f"the message is {len(prompt)} tokens with the template; the context window is "
                                   f"{context}", hint="write a shorter message")
            return system + turns
        turns = turns[2:] if len(turns) > 2 else turns[-1:]  # drop the oldest exchange
    return system


def streamer(parts: list[str], write):
    """on_text for one answer: written as it comes, and kept (what the history records)."""
    def on_text(delta: str) -> None:
        parts.append(delta)
        write(delta)
        sys.stdout.flush()
    return on_text


def run_chat(engine: Engine, max_new_tokens: int, sampling: dict, system: str | None = None, read=input,
             write=sys.stdout.write) -> None:
    """`sampling`: Engine.chat's keyword arguments (a seed, if any, moves on by one each turn)."""
    if engine.tokenizer is None or engine.tokenizer.chat_template is None:
        raise MoetierError(f"{engine.store.path} has no chat template",
                           hint="chat needs the model's chat template; `moetier generate` continues plain text")
    start = [{"role": "system", "content": system}] if system else []
    messages = list(start)
    print(f"moetier chat: {HELP}", file=sys.stderr)
    turn = 0
    while True:
        try:
            line = read("> ")
        except EOFError:
            write("\n")
            return
        except KeyboardInterrupt:  # at the prompt: a new line, as a shell does
            write("\n")
            continue
        text = line.strip()
        if text in ("/exit", "/quit"):
            return
        if text == "/reset":
            messages = list(start)
            write("(a new conversation)\n")
            continue
        if not text:
            continue
        try:
            messages = fit_history(engine, messages + [{"role": "user", "content": text}], max_new_tokens)
        except MoetierError as e:  # this message is refused; the conversation goes on without it
            print(f"moetier: error: {e}", file=sys.stderr)
            continue
        parts: list[str] = []
        seed = sampling.get("seed")
        try:
            engine.chat(messages, max_new_tokens, on_text=streamer(parts, write),
                        **{**sampling, "seed": None if seed is None else seed + turn})
        except KeyboardInterrupt:
            write(" [stopped]")
        write("\n")
        turn += 1
        messages.append({"role": "assistant", "content": "".join(parts)})
