"""pipeline.stalls: what counts as standing still, with a fake clock."""

from __future__ import annotations

import math

from inboxd.pipeline.stalls import FROZEN_GAP_S, SHOWN_AFTER_S, Stall, StallClock


class Clock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def test_work_that_waits_while_nothing_moves_counts_from_the_last_move() -> None:
    clock = Clock()
    stalls = StallClock(clock)
    stalls.look((1, 2), waiting=True)
    for _ in range(10):
        clock.now_s += 2
        stalls.look((1, 2), waiting=True)
    assert clock.now_s - stalls.since(stalls.moved_s) == 20
    clock.now_s += 2
    stalls.look((1, 3), waiting=True)  # a counter moved
    assert clock.now_s - stalls.since(stalls.moved_s) == 0


def test_nothing_waiting_is_never_a_stall() -> None:
    clock = Clock()
    stalls = StallClock(clock)
    for _ in range(10):
        clock.now_s += 2
        stalls.look((1, 2), waiting=False)
    assert clock.now_s - stalls.since(stalls.moved_s) == 0


def test_a_gap_in_the_daemon_s_own_running_starts_every_count_again() -> None:
    clock = Clock()
    stalls = StallClock(clock)
    started_s = clock.now_s
    stalls.look((0,), waiting=True)
    clock.now_s += FROZEN_GAP_S + 60  # Ctrl-Z, a cgroup freeze: nobody looked
    stalls.look((0,), waiting=True)
    assert stalls.since(started_s) == clock.now_s, "the frozen minute is nobody's stall"
    clock.now_s += 2
    stalls.look((0,), waiting=True)
    assert clock.now_s - stalls.since(started_s) == 2


def test_a_stall_is_shown_early_and_overdue_at_its_limit() -> None:
    assert not Stall("commit", SHOWN_AFTER_S - 1, 30).shown
    assert Stall("commit", SHOWN_AFTER_S, 30).shown
    assert not Stall("commit", 29, 30).overdue and Stall("commit", 30, 30).overdue
    assert Stall("model", 1, 0.5).shown, "past its limit, shown however short"
    healing = Stall("decode worker 7", 1e6)
    assert healing.limit_s == math.inf and not healing.overdue
    assert str(Stall("commit", 40.4, 30, " (stopped)")) == "commit stalled 40 s (stopped)"
