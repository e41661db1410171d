"""CpuShare as pure logic on hand-made machine states: threads follow the cores other processes leave."""

from moetier.engine.cpu_share import CHECK_EVERY, CpuShare, runnable_elsewhere


def drive(others: list[int], cores: int = 4, threads: int = 4) -> list[int]:
    """The thread count after each check, the machine showing `others` runnable threads at successive checks."""
    seen, calls = [], iter(others)
    share = CpuShare(cores=cores, elsewhere=lambda: next(calls), set_threads=seen.append, threads=threads)
    counts = []
    for _ in others:
        for _ in range(CHECK_EVERY):
            share()
        counts.append(share.current)
    return counts, seen


def test_threads_follow_the_cores_others_leave_and_come_back():
    counts, calls = drive([0, 1, 3, 7, 2, 0])
    assert counts == [4, 4, 1, 1, 2, 4]  # fewer after two looks in a row, more at once; never below one
    assert calls == [1, 2, 4]  # set only when it changes


def test_a_lone_look_at_a_busy_machine_changes_nothing():
    counts, calls = drive([0, 2, 0, 3, 0, 1, 0])
    assert counts == [4] * 7 and calls == []


def test_a_machine_that_cannot_say_leaves_the_threads_alone():
    def no_proc():
        raise OSError("no /proc")

    seen = []
    share = CpuShare(cores=2, elsewhere=no_proc, set_threads=seen.append, threads=2)
    for _ in range(3 * CHECK_EVERY):
        share()
    assert seen == [] and share.current == 2


def test_restore_gives_back_the_threads_it_started_with():
    calls = []
    share = CpuShare(cores=2, elsewhere=lambda: 2, set_threads=calls.append, threads=2)
    for _ in range(CHECK_EVERY + 1):  # two looks
        share()
    assert share.current == 1
    share.restore()
    assert calls == [1, 2] and share.current == 2


def test_this_machine_is_read():
    assert runnable_elsewhere() >= 0
