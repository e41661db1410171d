"""Progress bars: tqdm's on a terminal; in a file or a pipe (a log), a few whole lines instead — when the work
starts, at each quarter of it, and when it ends — not tqdm's redraws, which there pile up every refresh into one
long line of carriage returns. Every long job of moetier's uses this `tqdm` (same arguments)."""

from __future__ import annotations

import sys

from tqdm import tqdm as _tqdm

QUARTERS = 4  # lines at most between the first and the last, in a log


def _is_terminal(file) -> bool:
    try:
        return bool(file.isatty())
    except (AttributeError, ValueError):  # a closed or file-less stream
        return False


class tqdm(_tqdm):  # noqa: N801 (a drop-in for tqdm.tqdm)
    def __init__(self, *args, **kwargs) -> None:
        file = kwargs.get("file") or sys.stderr
        self._lines = not _is_terminal(file)
        self._said = -1  # the last quarter a line was written for
        if self._lines:
            kwargs["mininterval"] = 0  # (display decides when a line is due)
        super().__init__(*args, **kwargs)

    def display(self, msg=None, pos=None):
        if not self._lines:
            return super().display(msg, pos)
        if msg is not None:  # (a clearing or a message of tqdm's own: nothing, in a log)
            return True
        quarter = QUARTERS * self.n // self.total if self.total else (0 if self.n == 0 else self._said)
        if quarter > self._said or (self.n == 0 and self._said < 0):
            self._said = quarter
            self.fp.write(self.__str__().strip() + "\n")
            getattr(self.fp, "flush", lambda: None)()
        return True

    def clear(self, nolock=False):
        if not self._lines:
            super().clear(nolock)

    def moveto(self, n):
        if not self._lines:
            super().moveto(n)

    def close(self):
        if not self._lines or getattr(self, "disable", True):
            return super().close()
        if self.total is None and self.n:  # (no total, so no quarters: the count once, at the end)
            self.fp.write(self.__str__().strip() + "\n")
        self.disable = True  # (tqdm's own close would redraw and clear: the lines are written already)
        self._decr_instances(self)
