"""The `moetier` commands the README and docs/ show a user still exist: each names a command moetier has and only
options that command takes (inline `code` too), and each command of a code block with no placeholder in it parses as
written. Why: a renamed option
broke a documented command silently (a user's copy-paste is the first test it meets); argparse alone, nothing run."""

import argparse
import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from moetier.cli import build_parser
from moetier.errors import ModelNotFoundError

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PLACEHOLDER = re.compile(r"\.\.\.|[\[\]<>]|^[A-Z][A-Z_]+$|\$")  # `...`, [optional], <x>, PATH, $VAR


def code_lines(text: str) -> list[tuple[bool, str]]:
    """Indented code blocks' lines (a trailing backslash joining the next) and inline `code` spans, each with whether
    it is a block's (a command to paste, rather than one named in a sentence)."""
    lines, out = text.split("\n"), []
    i = 0
    while i < len(lines):
        if re.match(r"^ {4,}\S", lines[i]):
            cmd = lines[i].strip()
            while cmd.endswith("\\") and i + 1 < len(lines):
                i += 1
                cmd = cmd[:-1].rstrip() + " " + lines[i].strip()
            out.append((True, cmd))
        i += 1
    return out + [(False, span) for span in re.findall(r"`([^`]+)`", text.replace("\n", " "))]


def moetier_commands(text: str) -> list[tuple[bool, str]]:
    """Each `moetier ...` command in the text, without its shell around it (comments, redirections, pipes), and
    whether a code block holds it."""
    found = []
    for block, line in code_lines(text):
        line = re.sub(r"\s+#.*$", "", line)
        for part in re.split(r"&&|;|\|\|?", line):
            part = re.sub(r"\s\d?>>?\s*\S+|\s&$", "", part.strip()).strip()
            if part.startswith("moetier ") and len(part) > len("moetier "):
                found.append((block, part))
    return found


def all_commands() -> list[tuple[str, bool, str]]:
    return [(path.relative_to(ROOT).as_posix(), block, c) for path in DOCS
            for block, c in moetier_commands(path.read_text())]


PARSER = build_parser()  # (one for every case: ~30 ms each to build, and parsing leaves it as it was)


def command_parser(words: list[str]) -> tuple[argparse.ArgumentParser, list[str], list[str]]:
    """The (sub)parser the leading words name, the words that named it, and the rest."""
    parser, named = PARSER, []
    while words:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs or words[0] not in subs[0].choices:
            break
        parser = subs[0].choices[words[0]]
        named.append(words.pop(0))
    return parser, named, words


COMMANDS = all_commands()


def test_the_docs_show_many_commands():
    assert len(COMMANDS) > 150, "the scan found too few: the docs' format changed under it"
    assert {"README.md", "docs/gguf.md", "docs/serving.md"} <= {f for f, _, _ in COMMANDS}
    assert sum(block for _, block, _ in COMMANDS) > 50


@pytest.mark.parametrize("where,block,command", COMMANDS, ids=[f"{f}:{i}" for i, (f, _, _) in enumerate(COMMANDS)])
def test_each_documented_command_and_option_exists(where, block, command):
    words = shlex.split(command, posix=True)[1:]
    if words[0].startswith("-") or PLACEHOLDER.search(words[0]):  # `moetier --help`, `moetier COMMAND --help`
        return
    parser, named, rest = command_parser(list(words))
    assert named, f"{where}: `{command}`: moetier has no command {words[0]!r}"
    options = set(parser._option_string_actions)
    unknown = [w.split("=")[0] for w in rest if w.startswith("--") and w.split("=")[0] not in options]
    assert not unknown, f"{where}: `{command}`: `moetier {' '.join(named)}` takes no {', '.join(unknown)}"
    if not block or any(PLACEHOLDER.search(w) for w in rest):
        return
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            PARSER.parse_args(words)
        except SystemExit as e:
            assert not e.code, f"{where}: `{command}` does not parse: {err.getvalue().strip()}"
        except ModelNotFoundError:  # a file on the reader's machine (`~/models/...gguf`): --model checks it is there
            assert "--model" in words


def test_the_check_catches_an_option_that_is_gone():
    parser, named, rest = command_parser(["generate", "--expert-memry", "30%"])
    assert named == ["generate"] and "--expert-memry" not in parser._option_string_actions
    assert "--expert-memory" in parser._option_string_actions
    assert moetier_commands("    moetier sim --policy lru \\\n        --expert-memory 10%   # a note\n") == [
        (True, "moetier sim --policy lru --expert-memory 10%")]
