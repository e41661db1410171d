"""Errors a user can act on: each says what is wrong and what to do about it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


class MoetierError(Exception):
    """Base class. The CLI prints the message and exits non-zero without a traceback."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        message, hint = one_line(message), None if hint is None else one_line(hint)
        self.hint = hint
        super().__init__(message if hint is None else f"{message}\n  hint: {hint}")


def one_line(text: str) -> str:
    """`text` with any control character a user's input brought in (a newline in a path) written as its escape, so
    an error stays one line."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


class ModelNotFoundError(MoetierError):
    pass


class UnsupportedModelError(MoetierError):
    pass


class CheckpointError(MoetierError):
    pass


class StoreError(MoetierError):
    pass


class ChecksumError(StoreError):
    pass


class BudgetError(MoetierError):
    pass


class PromptTooLongError(MoetierError):
    pass


class MalformedError(MoetierError):
    pass


@contextmanager
def parsing(what: str, error: type[MoetierError] = MalformedError, hint: str | None = None) -> Iterator[None]:
    """Turn the KeyError, TypeError or ValueError that reading a malformed document raises into `error`, naming
    the document: `with parsing(f"{path}", StoreError): ...`."""
    try:
        yield
    except MoetierError:
        raise
    except KeyError as e:
        raise error(f"{what}: missing field {e.args[0]!r}", hint=hint) from None
    except (TypeError, ValueError, AttributeError, IndexError, OverflowError, ZeroDivisionError) as e:
        raise error(f"{what}: malformed ({e})", hint=hint) from None


def integer(value, name: str, minimum: int | None = None) -> int:
    """`value` if it is an integer (not a bool, not a float) of at least `minimum`; ValueError otherwise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")
    return value
