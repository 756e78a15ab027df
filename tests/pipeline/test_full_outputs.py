"""The wait for room in a full output folder (``pipeline/full_outputs.py``): one warning
however many stages hold, probes that back off to their cap, one record when writing resumes.
The probe is faked at the filesystem boundary; tests/guarantees/test_full_disk.py fills real
filesystems."""

from __future__ import annotations

import asyncio
import errno
import logging
from collections.abc import Callable
from pathlib import Path

import pytest
from inboxd.config import load_config
from inboxd.files.durable import TmpDir
from inboxd.files.lifecycle import Lifecycle
from inboxd.pipeline import full_outputs
from inboxd.pipeline.full_outputs import FullOutputs

from tests.conftest import write_config

FULL = OSError(errno.ENOSPC, "No space left on device")


async def run_now(work: Callable[[], None]) -> None:
    work()


def events(caplog: pytest.LogCaptureFixture, name: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "inboxd_event", "") == name]


def test_many_holders_one_warning_backed_off_probes_one_resume(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    config = load_config(write_config(tmp_path, retry={"backoff_initial_ms": 1,
                                                       "output_probe_max_ms": 8}))
    probed: list[TmpDir] = []

    def probe(tmp_dir: TmpDir) -> None:
        probed.append(tmp_dir)
        if len(probed) <= 6:
            raise OSError(FULL.errno, FULL.strerror)

    monkeypatch.setattr(full_outputs, "probe_room", probe)
    delays: list[float] = []
    real_sleep = asyncio.sleep

    async def sleep(delay_s: float) -> None:  # asyncio's own, for the scenario's sleep(0) too
        if delay_s:
            delays.append(delay_s)
        await real_sleep(0)

    monkeypatch.setattr(full_outputs.asyncio, "sleep", sleep)

    async def scenario() -> FullOutputs:
        outputs = FullOutputs(config, run_now)
        holders = [asyncio.create_task(outputs.hold(tmp_path / "results", FULL))
                   for _ in range(5)]
        await asyncio.sleep(0)
        assert outputs.full and "No space left on device" in outputs.status()
        await asyncio.gather(*holders)
        assert not outputs.full
        outputs.wrote()
        outputs.wrote()  # a second write is no second resume
        return outputs

    with caplog.at_level(logging.INFO, logger="inboxd"):
        outputs = asyncio.run(scenario())
    [warning] = events(caplog, "output_full")
    assert str(tmp_path / "results") in warning.getMessage()
    assert len(events(caplog, "output_resumed")) == 1
    assert (outputs.waits, outputs.probes) == (1, 7)
    assert {tmp.path for tmp in probed} == {tmp_path / "results" / ".tmp" / "default"}
    assert delays == [0.001, 0.002, 0.004, 0.008, 0.008, 0.008, 0.008]  # capped
    assert outputs.waited_s() == 0


def test_a_probe_that_meets_another_error_ends_the_wait(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only a folder still full keeps inboxd waiting; any other error is the retried write's
    to meet (and handle as it handles it)."""
    config = load_config(write_config(tmp_path, retry={"backoff_initial_ms": 1}))

    def probe(tmp_dir: TmpDir) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(full_outputs, "probe_room", probe)

    async def scenario() -> None:
        outputs = FullOutputs(config, run_now)
        await asyncio.wait_for(outputs.hold(tmp_path / "failed", FULL), 5)
        assert not outputs.full

    asyncio.run(scenario())


def test_a_full_inbox_filesystem_is_probed_where_the_group_cannot_plant_a_link(
        tmp_path: Path) -> None:
    """A claim refused for room is probed in ``.processing/.tmp/<instance>``, walked as the
    daemon's own folders: the group can swap ``.processing`` for one with links in it."""
    lifecycle = Lifecycle(load_config(write_config(tmp_path)))
    probe = lifecycle.tmp_dir_of(str(tmp_path / "inbox" / ".processing"))
    assert (probe.root, probe.parts, probe.own) == (tmp_path / "inbox",
                                                    (".processing", ".tmp", "default"), True)
    assert lifecycle.tmp_dir_of(str(tmp_path / "results")).own is False
