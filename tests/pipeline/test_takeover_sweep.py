"""The pipeline's side of taking over dead instances (``pipeline/takeover_sweep.py``): at start-up a
run returns what a dead instance had claimed, counts it and says so; and a file that crashes
whichever instance takes it still ends in failed/ instead of going round the inbox."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import make_image
from tests.fakes import pipeline_for


def test_start_up_takes_over_a_dead_instance_and_processes_its_files(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    processing = tmp_path / "inbox" / ".processing"
    make_image(processing / "a" / "sub" / "left.png")
    (processing / "a.lock").write_bytes(b"12345")  # a died: nobody holds its lock
    pipeline = pipeline_for(tmp_path, instance="b", inbox={"settle_ms": 0})
    with caplog.at_level(logging.INFO, logger="inboxd"):
        asyncio.run(pipeline.process_backlog())
    assert (tmp_path / "results" / "sub" / "left.png.json").exists()
    assert pipeline.stats.counters.taken_over == 1
    assert pipeline.report.log_stats()["TAKEN_OVER"] == 1
    taken = [r for r in caplog.records if getattr(r, "inboxd_event", "") == "instance_taken_over"]
    assert len(taken) == 1
    assert taken[0].inboxd_fields["DEAD_INSTANCE"] == "a"  # type: ignore[attr-defined]
    assert taken[0].inboxd_fields["RETURNED"] == 1  # type: ignore[attr-defined]
    assert not (processing / "a").exists()


def test_a_file_that_crashes_each_instance_in_turn_still_fails(tmp_path: Path) -> None:
    """a crashes on it and stops; b takes a's files over at its start-up, claims it, crashes
    on it too; c's start-up takes b's over: crashed twice, it goes to failed/."""
    make_image(tmp_path / "inbox" / "killer.png")
    for instance in ("a", "b", "c"):
        pipeline = pipeline_for(tmp_path, instance=instance, inbox={"settle_ms": 0})
        if instance != "c":
            async def crash(batch: Any) -> None:
                raise RuntimeError("a bug that this file triggers")
            pipeline.result_writer._write = crash  # type: ignore[method-assign]
        asyncio.run(pipeline.process_backlog())
        assert (pipeline.crashed is not None) == (instance != "c")
    report = json.loads((tmp_path / "failed" / "killer.png.error.json").read_text())
    assert "crashed 2 times" in report["reason"] and report["instance"] == "b"
    assert not list((tmp_path / "results").glob("*.json"))
    assert not list((tmp_path / "inbox" / ".processing").rglob("*.png"))
