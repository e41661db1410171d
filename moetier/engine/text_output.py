"""A request's output as text, for stop strings and streaming: deltas of complete characters, held back while
they could still be the start of a stop string, and the text cut where a stop string begins."""

from __future__ import annotations

from moetier.engine.tokenizer import Tokenizer


class TextOutput:
    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer, self.stop = tokenizer, stop
        self.text = ""  # the output so far (whole characters; cut at a stop string once one appears)
        self.sent = 0  # characters handed out by `delta`
        self.stopped = False
        self._hold = max((len(s) for s in stop), default=1) - 1  # characters a stop string could still complete

    def update(self, ids: list[int], final: bool = False) -> bool:
        """The output is now `ids` (`final`: and it ends there, so an incomplete character at its end stays, as
        decoding the whole output shows it): True if a stop string appeared (the text is cut where it begins)."""
        text = self.tokenizer.decode(ids)
        if text.endswith("\ufffd") and not final:  # an incomplete UTF-8 sequence: wait for the rest of it
            return False
        start = max(0, len(self.text) - self._hold)  # a stop string ending in the new text starts here or later
        self.text = text
        cuts = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
        if cuts:
            self.text, self.stopped = text[:min(cuts)], True
        return self.stopped

    def delta(self, final: bool = False) -> str:
        """Text not handed out yet, less what could be the start of a stop string (all of it once `final`)."""
        end = len(self.text) if final or self.stopped else len(self.text) - self._hold
        end = max(self.sent, end)
        out, self.sent = self.text[self.sent:end], end
        return out
