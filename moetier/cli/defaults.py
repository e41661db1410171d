"""What the commands share: the default model, the help format, and reading prompts."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from moetier.errors import MoetierError

DEFAULT_MODEL = "demo-fine"  # shipped in models/


class HELP(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help line shows its default, unless there is none (None, or an unset flag)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False:
            return action.help or ""
        return super()._get_help_string(action)


def command(sub, name: str, help: str, **kw) -> argparse.ArgumentParser:
    """A subcommand whose --help lists every option with its default."""
    return sub.add_parser(name, help=help, description=kw.pop("description", help), formatter_class=HELP, **kw)


def check_utf8(text: str, what: str) -> str:
    """Command-line text arrives with undecodable bytes as surrogates; refuse it with where the bad byte is."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise MoetierError(f"{what} is not valid UTF-8 text (byte {ord(text[e.start]) & 0xff:#04x} at character "
                           f"{e.start})", hint="pass UTF-8 text, or put it in a file and fix its encoding") from None
    return text


def decode_utf8(data: bytes, what: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise MoetierError(f"{what} is not valid UTF-8 text (byte {data[e.start]:#04x} at offset {e.start})",
                           hint="convert it to UTF-8 (e.g. `iconv -t utf-8`)") from None


def read_text_file(path: str | Path, what: str) -> str:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise MoetierError(f"cannot read {what} {path}: {e.strerror}") from None
    return decode_utf8(data, f"{what} {path}")


def _one_prompt(text: str) -> str:
    """A prompt read from a file or stdin: its text less one final newline (as llama.cpp's -f does)."""
    return text[:-1] if text.endswith("\n") else text


def read_prompts(prompts: list[str] | None, prompt_files: list[str] | None) -> list[str]:
    """`--prompt TEXT` (repeatable; `-` reads stdin) and `--prompt-file PATH` (repeatable, one prompt per file),
    checked before any model is loaded."""
    out = []
    for p in prompts or []:
        if p == "-":
            out.append(_one_prompt(decode_utf8(sys.stdin.buffer.read(), "the prompt on stdin")))
        else:
            out.append(check_utf8(p, "--prompt"))
    out += [_one_prompt(read_text_file(f, "prompt file")) for f in prompt_files or []]
    if not out:
        raise MoetierError("no prompt given", hint="--prompt TEXT, --prompt - (read stdin), or --prompt-file PATH")
    empty = [i for i, p in enumerate(out) if not p]
    if empty:
        raise MoetierError(f"prompt {empty[0]} is empty", hint="give some text to continue")
    return out
