"""What the commands share: the default model, the help format, and reading prompts."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
from pathlib import Path

from moetier.errors import MoetierError

DEFAULT_MODEL = "demo-deep"  # shipped in models/: the best text of the three (held-out perplexity 84 against 106-108)


class Parser(argparse.ArgumentParser):
    """argparse, refusing as every moetier error does: one line and a hint, exit status 1 (argparse's own prints
    the whole usage and exits 2). A value that starts with `-` and a digit (`--expert-memory -5%`, `--seed -1`) is
    a value, so the option's own check names what is wrong with it, not "expected one argument"."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # argparse's private pattern for "a negative number, not an option" (its own: -5 and -.5, not -5%; and -inf,
        # -nan, so the option's own check says what is wrong with them)
        self._negative_number_matcher = re.compile(r"^-(\.?\d|inf|nan)", re.IGNORECASE)

    def error(self, message: str):
        self.exit(1, f"moetier: error: {message}\n  hint: `{self.prog} --help` lists the options\n")


class HELP(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help line shows its default, unless there is none (None, empty, or a flag: `--x` off and
    `--no-x` on say nothing by default)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        flag = action.nargs == 0 and isinstance(action.const, bool)  # store_true / store_false
        if action.default is None or action.default is False or action.default == "" or flag:
            return action.help or ""
        return super()._get_help_string(action)


def command(sub, name: str, help: str, **kw) -> argparse.ArgumentParser:
    """A subcommand whose --help lists every option with its default."""
    return sub.add_parser(name, help=help, description=kw.pop("description", help), formatter_class=HELP, **kw)


def checked(check):
    """An argparse type: the text as given, once `check` accepts it — its MoetierError (a message and a hint) refused
    as the options are read (moetier.cli.main prints it), before anything is imported for the command's work."""

    def parse(text: str) -> str:
        check(text)
        return text

    return parse


def count(minimum: int = 1, maximum: int | None = None):
    """An argparse type: a whole number in [minimum, maximum], refused in argparse's one line otherwise."""

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if n < minimum or (maximum is not None and n > maximum):
            bound = f"between {minimum} and {maximum}" if maximum is not None else f"at least {minimum}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {n}")
        return n

    return parse


SEED = count(0, 2**63 - 1)  # what numpy's and torch's generators take


def out_folder(path: str | Path, option: str = "--out") -> Path:
    """An output folder, checked before any work: an existing one must be a folder, a new one must be makeable
    under a folder. Made when the results are written (`make_folder`)."""
    path = Path(path)
    if not str(path).strip():
        raise MoetierError(f"{option} is empty", hint="give a folder path")
    for p in [path, *path.parents]:
        if p.exists():
            if not p.is_dir():
                where = "is a file" if p == path else f"cannot be made: {p} is a file"
                raise MoetierError(f"{option} {path} {where}", hint="give a folder path")
            break
    return path


def make_folder(path: Path) -> Path:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise MoetierError(f"cannot make the folder {path}: {e.strerror or e}", hint="give another --out") from None
    return path


def write_plot(draw, path: str | Path) -> bool:
    """`draw(path)` writes a plot beside results already printed; a plot that cannot be written (a read-only
    folder, a full disk) is a one-line warning, not the loss of what was computed."""
    path = Path(path)
    if not path.name or path.is_dir():
        print(f"moetier: warning: cannot write the plot {path}: it is a folder (give a file path)", file=sys.stderr)
        return False
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}.png")  # whole or absent; PNG whatever the name says
    try:
        draw(tmp)
        os.replace(tmp, path)
        return True
    except OSError as e:
        with contextlib.suppress(OSError):  # on a read-only folder nothing was made
            tmp.unlink(missing_ok=True)
        print(f"moetier: warning: cannot write the plot {path}: {e.strerror or e}", file=sys.stderr)
        return False


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


def finite(low: float, high: float):
    """An argparse type: a finite number in [low, high] (nan and inf refused in argparse's one line)."""

    def parse(text: str) -> float:
        try:
            x = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not (low <= x <= high):  # (False for nan)
            raise argparse.ArgumentTypeError(f"must be a finite number between {low:g} and {high:g}, got {text}")
        return x

    return parse


def logit_bias(text: str) -> tuple[int, float]:
    """`ID=BIAS` (llama.cpp's --logit-bias writes ID+BIAS or ID-BIAS, also read)."""
    m = re.fullmatch(r"\s*(\d+)\s*(=\s*)?([+-]?[0-9.]+(?:e[+-]?\d+)?)\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not TOKEN_ID=BIAS (e.g. 15043=-100)")
    return int(m.group(1)), finite(-100, 100)(m.group(3))


def add_sampling_options(p, temperature: float = 0.8, top_k: int = 40, top_p: float = 0.95,
                         min_p: float = 0.05) -> None:
    """How new tokens are chosen (moetier/engine/sampling.py); the defaults are llama.cpp's."""
    p.add_argument("--temperature", type=finite(0, 100), default=temperature,
                   help="softmax temperature; 0 is greedy (exact mode's tokens)")
    p.add_argument("--top-k", type=count(0), default=top_k, help="keep the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=finite(1e-9, 1), default=top_p,
                   help="keep the most likely tokens whose mass reaches p, in (0, 1]")
    p.add_argument("--min-p", type=finite(0, 1), default=min_p,
                   help="keep tokens at least this share as likely as the most likely one (0: off)")
    p.add_argument("--repeat-penalty", type=finite(1e-6, 100), default=1.0,
                   help="divide (multiply, if negative) the logits of tokens seen in the last --repeat-last-n by "
                        "this (1: off)")
    p.add_argument("--repeat-last-n", type=count(-1), default=64,
                   help="tokens of prompt and output the repeat penalty looks at (-1: all)")
    p.add_argument("--presence-penalty", type=finite(-2, 2), default=0.0,
                   help="subtract this from the logit of every token the output holds (OpenAI's)")
    p.add_argument("--frequency-penalty", type=finite(-2, 2), default=0.0,
                   help="subtract this times its count in the output from each token's logit (OpenAI's)")
    p.add_argument("--logit-bias", type=logit_bias, action="append", default=None, metavar="ID=BIAS",
                   help="add BIAS (-100 to 100) to token ID's logit; repeatable")
    p.add_argument("--seed", type=SEED, default=None,
                   help="sampling seed, for the same text again (default: fresh randomness each run)")


def sampling_args(args: argparse.Namespace) -> dict:
    """add_sampling_options' values as Engine.generate's keyword arguments."""
    return {"temperature": args.temperature, "top_p": args.top_p, "seed": args.seed, "top_k": args.top_k,
            "min_p": args.min_p, "repetition_penalty": args.repeat_penalty,
            "repetition_window": args.repeat_last_n, "presence_penalty": args.presence_penalty,
            "frequency_penalty": args.frequency_penalty, "logit_bias": dict(args.logit_bias or ())}
