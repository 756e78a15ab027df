"""The wait before a held-open file is claimed again: doubling, capped, per inode, bounded."""

from __future__ import annotations

from inboxd.pipeline.held_files import HeldFiles


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def test_each_give_back_doubles_the_wait_up_to_the_cap() -> None:
    clock = Clock()
    held = HeldFiles(capacity=8, initial_s=0.5, max_s=3.0, clock=clock)
    waits = []
    for _ in range(5):
        waits.append(held.given_back("/in/a.jpg", 7))
        assert held.not_before("/in/a.jpg", 7) == clock.now_s + waits[-1]
        clock.now_s += waits[-1]
        assert held.not_before("/in/a.jpg", 7) is None  # due now
    assert waits == [0.5, 1.0, 2.0, 3.0, 3.0]


def test_another_file_under_the_name_or_a_quiet_spell_starts_over() -> None:
    clock = Clock()
    held = HeldFiles(capacity=8, initial_s=0.5, max_s=3.0, clock=clock)
    held.given_back("/in/a.jpg", 7)
    held.given_back("/in/a.jpg", 7)
    assert held.not_before("/in/a.jpg", 8) is None  # a new inode: not this file's wait
    assert held.given_back("/in/a.jpg", 8) == 0.5
    clock.now_s += 60
    assert held.given_back("/in/a.jpg", 8) == 0.5


def test_the_memory_is_bounded_oldest_forgotten_first() -> None:
    clock = Clock()
    held = HeldFiles(capacity=3, initial_s=1.0, max_s=8.0, clock=clock)
    for n in range(10):
        held.given_back(f"/in/{n}.jpg", n)
    assert held.size == 3
    assert held.not_before("/in/0.jpg", 0) is None and held.not_before("/in/9.jpg", 9)
    held.resize(1)
    assert held.size == 1
