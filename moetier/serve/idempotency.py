"""`Idempotency-Key`: a header a client may send with a request it may retry, so that a retry does not run the
request twice. The same key with the same body runs once: a retry while the first runs waits for its answer, a
retry after it gets the same answer (the last KEEP keys' whole answers are kept). The same key with another body is
a 422. A streamed answer is not kept — its tokens went to the first connection —: a retry of a streamed request
whose key was seen is a 409. Both say `x-should-retry: false` (the `openai` client obeys it).

A request whose client went away before its answer was whole leaves no answer: its key is freed, and the retry
runs it (the first was aborted when its client went: moetier/serve/app.py)."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass

from moetier.serve.protocol import ApiError

KEEP = 256
NO_RETRY = {"x-should-retry": "false"}


class Abandoned(Exception):
    """The first request under a key ended without an answer to give (its client went): run it again."""


@dataclass
class Entry:
    fingerprint: str  # the body's digest
    stream: bool
    answer: asyncio.Future  # the whole answer (a dict), or the ApiError it ended with


class Idempotency:
    def __init__(self, keep: int = KEEP) -> None:
        self.keep = keep
        self.entries: OrderedDict[str, Entry] = OrderedDict()

    def claim(self, key: str, fingerprint: str, stream: bool) -> asyncio.Future | None:
        """None: the caller runs the request (and settles it); else the first one's answer, to wait for."""
        entry = self.entries.get(key)
        if entry is None:
            self.entries[key] = Entry(fingerprint, stream, asyncio.get_running_loop().create_future())
            while len(self.entries) > self.keep:
                self.entries.popitem(last=False)
            return None
        if entry.fingerprint != fingerprint:
            raise ApiError(422, "this Idempotency-Key came with another request body", code="idempotency_key_reused",
                           headers=NO_RETRY)
        if stream or entry.stream:
            raise ApiError(409, "a streamed request with this Idempotency-Key has run or is running (a stream is not "
                                "kept to be sent again)", code="idempotency_key_in_use", headers=NO_RETRY)
        return entry.answer

    def settle(self, key: str, answer: dict) -> None:
        entry = self.entries.get(key)
        if entry is not None and not entry.answer.done():
            entry.answer.set_result(answer)

    def fail(self, key: str, error: BaseException) -> None:
        """The request ended without an answer: an ApiError is every retry's answer too; anything else (its client
        gone, a cancellation) frees the key for the retry to run."""
        entry = self.entries.get(key)
        if entry is None or entry.answer.done():
            return
        if not isinstance(error, ApiError):
            del self.entries[key]
            error = Abandoned()
        entry.answer.set_exception(error)
        entry.answer.exception()  # (retrieved: no "never retrieved" warning where nobody waits)
