"""The record budget: token buckets per priority class, counted summaries, checked in
``logs.emit`` before a record is made, and kept by a real daemon's stderr under a flood."""

from __future__ import annotations

import logging
import signal
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest
import torch
from inboxd import log_budget, logs

from support.models import NullModel
from tests.byo_models import export
from tests.conftest import (
    DaemonProcess,
    line_fields,
    make_image,
    run_interleaved,
    wait_until,
    write_config,
)


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def test_a_burst_passes_then_the_rate_and_a_summary_counts_the_rest() -> None:
    clock = FakeClock()
    budget = log_budget.RecordBudget(burst=10, rate_per_s=2.0, summary_interval_s=5.0,
                                     clock=clock)
    admitted = [budget.admit(logging.INFO, "completed") for _ in range(15)]
    assert admitted.count(True) == 10
    clock.now_s = 1.0
    assert budget.summary() is None  # the first summary one interval after the first drop
    assert [budget.admit(logging.INFO, "completed") for _ in range(3)] == [True, True, False]
    clock.now_s = 5.0
    summary = budget.summary()
    assert summary is not None
    assert summary.fields == {"SUPPRESSED": 6, "SUPPRESSED_TOTAL": 6, "SUPPRESSED_COMPLETED": 6}
    assert summary.message == "log rate limit: suppressed 6 records (completed=6)"
    clock.now_s = 100.0
    assert budget.summary() is None  # nothing new held back


def test_stats_lifecycle_and_errors_are_never_held_back() -> None:
    budget = log_budget.RecordBudget(burst=1, rate_per_s=0.0, clock=FakeClock())
    assert budget.admit(logging.INFO, "completed")
    for event in ("stats", "started", "ready", "reloaded", "stopping", "stopped"):
        assert all(budget.admit(logging.INFO, event) for _ in range(100))
    # An episode's start and end, however long the flood between them used the budget.
    for event in ("deferred", "watching", "model_unavailable", "model_available",
                  "model_connected", "recovered", "metrics", "gpu_decode", "no_cuda", "faults"):
        assert all(budget.admit(logging.WARNING, event) for _ in range(3)), event
        assert all(budget.admit(logging.INFO, event) for _ in range(3)), event
    assert all(budget.admit(logging.ERROR, "completed") for _ in range(100))
    assert not budget.admit(logging.INFO, "completed")


def test_priority_classes_have_budgets_of_their_own() -> None:
    """Like journald: a flood of info lines must not use up the warnings' budget."""
    budget = log_budget.RecordBudget(burst=5, rate_per_s=0.0, clock=FakeClock())
    for _ in range(100):
        budget.admit(logging.INFO, "completed")
    assert [budget.admit(logging.WARNING, "failed") for _ in range(6)] == [*[True] * 5, False]


def test_threads_logging_at_once_are_each_counted_once() -> None:
    """The daemon logs from its event loop, decode and claim threads. Python switches threads
    every 5 ms, so two admits almost never interleave; at 1 us they do, and without the budget's
    lock tokens and counts are lost (seen: 4 runs out of 4 failed)."""
    budget = log_budget.RecordBudget(burst=1000, rate_per_s=0.0, clock=FakeClock())
    admitted: list[int] = []

    def flood() -> None:
        admitted.append(sum(budget.admit(logging.INFO, "completed") for _ in range(5000)))

    run_interleaved([flood] * 4)
    assert sum(admitted) == 1000
    summary = budget.summary(force=True)
    assert summary is not None and summary.fields["SUPPRESSED"] == 19_000


class Made(logging.Filter):
    """Every record the inboxd logger is handed, that is every record made."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        self.records.append(record)
        return False  # made is enough: nothing is written


@pytest.fixture
def made() -> Iterator[Made]:
    level = logs.log.level
    logs.log.setLevel(logging.INFO)
    seen = Made()
    logs.log.addFilter(seen)
    yield seen
    logs.log.removeFilter(seen)
    logs.log.setLevel(level)


def test_emit_holds_a_record_back_before_it_is_made(monkeypatch: pytest.MonkeyPatch,
                                                   made: Made) -> None:
    clock = FakeClock()
    monkeypatch.setattr(logs, "budget", log_budget.RecordBudget(
        burst=3, rate_per_s=0.0, summary_interval_s=5.0, clock=clock))
    for n in range(10):
        logs.emit(logging.INFO, "completed", f"completed f{n}.jpg", path=f"f{n}.jpg")
    assert [r.getMessage() for r in made.records] == [f"completed f{n}.jpg" for n in range(3)]
    clock.now_s = 5.0
    logs.emit(logging.INFO, "stats", "stats", completed=10)
    summary, stats = made.records[3:]
    assert (summary.inboxd_event, summary.inboxd_fields) == (  # type: ignore[attr-defined]
        "suppressed", {"SUPPRESSED": 7, "SUPPRESSED_TOTAL": 7, "SUPPRESSED_COMPLETED": 7})
    assert stats.inboxd_event == "stats"  # type: ignore[attr-defined]


def test_a_completed_record_is_made_only_when_the_budget_passes_it(
        monkeypatch: pytest.MonkeyPatch, made: Made, tmp_path: Path) -> None:
    """Per file, the ``completed`` record's words (the answer's top outcome), message and
    fields are made only for the records the budget lets through, and carry the outcome."""
    from inboxd.config import load_config
    from inboxd.files.lifecycle import Lifecycle
    from inboxd.item import WorkItem
    from inboxd.pipeline import outcomes as outcomes_module
    from inboxd.pipeline.outcomes import Outcomes
    from inboxd.pipeline.retry_list import RetryList
    from inboxd.stats import Stats

    monkeypatch.setattr(logs, "budget", log_budget.RecordBudget(
        burst=2, rate_per_s=0.0, summary_interval_s=5.0, clock=FakeClock()))
    made_words: list[str] = []

    def top_outcome(answer: dict[str, object]) -> str:
        made_words.append(str(answer["label"]))
        return f"saw {answer['label']}"

    monkeypatch.setattr(outcomes_module, "top_outcome", top_outcome)
    config = load_config(write_config(tmp_path))

    async def no_io(work: object) -> None:
        raise AssertionError("completed() does no io")

    async def requeue(item: WorkItem) -> None:
        raise AssertionError("completed() requeues nothing")

    outcomes = Outcomes(config, Lifecycle(config), Stats(), RetryList(4, requeue), no_io)
    for n in range(5):
        item = WorkItem(tmp_path, f"f{n}.jpg", f"f{n}.jpg", str(tmp_path / f"f{n}.jpg"))
        item.name, item.sha256 = item.key, f"{n:064x}"
        outcomes.admitted()
        outcomes.completed(item, answer={"label": f"cat{n}"})
    assert outcomes.stats.counters.completed == 5
    assert made_words == ["cat0", "cat1"]  # the three held back were never made
    assert [(r.getMessage(), r.inboxd_fields["OUTCOME"], r.funcName)  # type: ignore[attr-defined]
            for r in made.records] == [(f"completed f{n}.jpg: saw cat{n}", f"saw cat{n}",
                                        "completed") for n in range(2)]


def test_what_is_held_back_at_the_end_is_summarised_when_flushed(
        monkeypatch: pytest.MonkeyPatch, made: Made) -> None:
    monkeypatch.setattr(logs, "budget", log_budget.RecordBudget(
        burst=0, rate_per_s=0.0, clock=FakeClock()))
    logs.flush_suppressed()
    assert made.records == []  # nothing held back, nothing to say
    for _ in range(4):
        logs.emit(logging.WARNING, "failed", "failed x.jpg")
    logs.flush_suppressed()
    [summary] = made.records
    assert summary.inboxd_fields["SUPPRESSED_FAILED"] == 4  # type: ignore[attr-defined]


@pytest.mark.daemon
@pytest.mark.slow
def test_a_real_daemons_stderr_keeps_to_the_budget_and_accounts_for_every_file(
        tmp_path: Path) -> None:
    """3,000 tiny files through a null model: far more ``completed`` lines a second than the
    budget's 100 after its burst of 1,000. The lines written plus those the ``suppressed``
    summaries count are every file, the last summary coming as the daemon exits."""
    files = 3000
    torch.manual_seed(0)
    program = export(NullModel().eval(), tmp_path / "null.pt2", size=32)
    labels = tmp_path / "labels.txt"
    labels.write_text("".join(f"c{i}\n" for i in range(10)))
    config = write_config(
        tmp_path, inbox={"settle_ms": 0},
        model={"export": str(program), "labels": str(labels), "device": "cpu",
               "input": {"resize": 32, "crop": 32}},
        batch={"max_size": 64, "max_delay_ms": 10}, capacity={"queue": 64, "preprocess_cache": 128})
    for n in range(files):
        make_image(tmp_path / "inbox" / f"f{n:04}.png", size=(8, 8), color=(n % 256, 9, 9))
    daemon = DaemonProcess(config)
    wait_until(lambda: sum(1 for _ in (tmp_path / "done").glob("*.png")) == files, 240,
               "every file done")
    assert daemon.stop(signal.SIGTERM) == 0, daemon.output()

    lines = daemon.records("completed")
    summaries = [line_fields(line) for line in daemon.records("suppressed")]
    held_back = sum(int(s.get("SUPPRESSED_COMPLETED", 0)) for s in summaries)
    assert len(lines) + held_back == files, (len(lines), held_back)
    assert held_back > 0, "every line was written: no budget on stderr"
    assert int(summaries[-1]["SUPPRESSED_TOTAL"]) == sum(int(s["SUPPRESSED"]) for s in summaries)
    # A line's time is to the millisecond: the budget's bound from the first line to the last.
    first_s, last_s = (_seconds(line) for line in (lines[0], lines[-1]))
    print(f"{len(lines)} completed lines in {last_s - first_s:.2f} s, {held_back} held back, "
          f"{len(summaries)} summaries")
    assert len(lines) <= log_budget.BUCKET_BURST + log_budget.BUCKET_RATE_PER_S * (
        last_s - first_s) + 1
    # 3,000 files overflow the event buffer (1,024): the episode is told, start and end.
    assert daemon.records("deferred") and daemon.records("watching"), daemon.output()[-2000:]


def _seconds(line: str) -> float:
    """``2026-11-30T07:40:01.123Z ...`` → its time, in seconds since the epoch."""
    return datetime.fromisoformat(line.split()[0]).timestamp()
