"""The ``started`` record says which per-device profile is in force, and the pipeline is built
with it: the real start-up (model loaded and warmed on the CPU), with the profile decision
faked to "gpu" at its one boundary for the second test."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from typing import Any

import pytest
from inboxd import logs
from inboxd.config import load_config
from inboxd.models import device
from inboxd.service.runner import Service

from tests.conftest import write_config


def started_fields(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                   **sections: Any) -> tuple[dict[str, Any], Any]:
    service = Service(load_config(write_config(tmp_path, **sections)), None)
    with caplog.at_level(logging.INFO, logger="inboxd"):
        pipeline = asyncio.run(service.load())
    pipeline.engine.close()
    pipeline.preprocessor.close()
    pipeline.lifecycle.unlock_instance()
    [record] = [r for r in caplog.records if getattr(r, "inboxd_event", None) == "started"]
    return logs.record_fields(record), pipeline


def test_on_the_cpu_the_record_says_cpu_and_nothing_changes(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    fields, pipeline = started_fields(tmp_path, caplog)
    assert fields["PROFILE"] == "cpu" and fields["PROFILE_DEFAULTS"] == "none"
    assert pipeline.queue.maxsize == 1 and pipeline.config.batch.max_size == 4


def test_a_gpu_profile_reaches_the_record_and_the_pipeline(
        tmp_path: Path, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device, "profile_for", lambda _device: "gpu")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    # batch set in the YAML: it wins (and keeps the CPU warm-up of this test small).
    fields, pipeline = started_fields(tmp_path, caplog, batch={"max_size": 4})
    assert fields["PROFILE"] == "gpu"
    assert fields["PROFILE_DEFAULTS"] == ("preprocess.workers=14,capacity.queue=28,"
                                          "capacity.preprocess_cache=128,"
                                          "capacity.preprocess_cache_mb=1024")
    assert pipeline.config.batch.max_size == 4 and pipeline.queue.maxsize == 28
    assert pipeline.decode_pool.workers == 14 and pipeline.preprocess_cache.capacity == 128
