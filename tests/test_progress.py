"""Progress bars in a log (a file or a pipe): a few whole lines, never tqdm's carriage-return redraws (which piled
up into one long line per refresh); on a terminal, tqdm's own."""

import io

from moetier.progress import tqdm


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_in_a_log_a_bar_is_a_few_whole_lines():
    log = io.StringIO()
    for _ in tqdm(range(1000), desc="work", file=log, mininterval=0):
        pass
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue() and 2 <= len(lines) <= 5
    assert lines[0].startswith("work:   0%") and "1000/1000" in lines[-1]
    log = io.StringIO()
    with tqdm(total=7, desc="manual", file=log, leave=False) as bar:
        for _ in range(7):
            bar.update()
    assert "\r" not in log.getvalue() and len(log.getvalue().splitlines()) <= 5
    log = io.StringIO()
    for _ in tqdm(iter(range(30)), desc="count", file=log):
        pass
    assert log.getvalue().splitlines()[-1].startswith("count: 30it")


def test_on_a_terminal_it_is_tqdms_bar():
    term = Terminal()
    for _ in tqdm(range(50), file=term, mininterval=0):
        pass
    assert term.getvalue().count("\r") >= 50
