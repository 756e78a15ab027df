"""Crash safety: SIGKILL the real daemon at random moments during a flood, then let it drain.

Every input must end with exactly one outcome (a complete result whose sha256 is the input's,
with the source in done/; or the source in failed/ with its .error.json), no partial JSON, no
temp file left, nothing left in processing/; and the search index holds one row per result
file, with its sha256.

The CI version is short; the long one (≥ 1,000 files, ≥ 20 kills) is ``make soak``. The seed is
printed and can be replayed: ``INBOXD_SOAK_SEED=1234 make soak``.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import time
from pathlib import Path

import pytest
from inboxd.config import INDEX_FILENAME

from tests.conftest import DaemonProcess, make_image, wait_until, write_config
from tests.index_check import assert_index_matches_results


def soak(tmp_path: Path, files: int, kills: int, seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    print(f"soak: {files} files, {kills} kills, seed {seed}")
    config = write_config(tmp_path, inbox={"settle_ms": 0, "rescan_interval_s": 2},
                          capacity={"event_buffer": 64, "queue": 2, "preprocess_cache": 8},
                          shutdown={"grace_s": 5})
    inbox = tmp_path / "inbox"
    expected: dict[str, str] = {}
    for n in range(files):
        path = make_image(inbox / f"d{n % 7}" / f"f{n:05}.png", size=(24, 24),
                          color=(n % 256, (n // 256) % 256, 77))
        expected[f"d{n % 7}/f{n:05}.png"] = hashlib.sha256(path.read_bytes()).hexdigest()

    for kill in range(kills):
        daemon = DaemonProcess(config)
        try:
            if rng.random() < 0.2:
                # Sometimes during start-up (recovery, model load), not only mid-flood.
                wait_until(lambda d=daemon: d.lines, 60, "any output")
            else:
                daemon.wait_for("ready", 120)
                # The kill moment is the test's input, not a wait for an event.
                time.sleep(rng.uniform(0.0, 2.5))
        finally:
            daemon.proc.send_signal(signal.SIGKILL)
            daemon.proc.wait(30)
        print(f"  kill {kill + 1}: {len(list((tmp_path / 'results').rglob('*.json')))} results")

    final = DaemonProcess(config, command="once")
    assert final.proc.wait(600) in (0, 1), final.output()
    return check_outcomes(tmp_path, expected)


def check_outcomes(root: Path, expected: dict[str, str]) -> dict[str, int]:
    results, done, failed = root / "results", root / "done", root / "failed"
    completed = failed_count = 0
    for name, sha in expected.items():
        result_path = results / f"{name}.json"
        has_result = result_path.exists()
        in_failed = (failed / name).exists()
        assert has_result != in_failed, f"{name}: result={has_result} failed={in_failed}"
        if has_result:
            result = json.loads(result_path.read_text())  # a partial file would not parse
            assert result["sha256"] == sha, name
            assert (done / name).exists(), f"{name}: result without the source in done/"
            completed += 1
        else:
            assert (failed / f"{name}.error.json").exists(), name
            failed_count += 1
    done_files = [p for p in done.rglob("*") if p.is_file()]
    assert len(done_files) == completed, "a source moved twice (name.1.png) means redone"
    inbox = root / "inbox"
    assert [p for p in inbox.rglob("*") if p.is_file() and p.suffix == ".png"] == []
    stray = [p for p in results.rglob("*") if p.is_file() and not p.name.endswith(".json")
             and not p.name.startswith(INDEX_FILENAME)]  # the index, its -wal and -shm
    stray += [p for p in (results / ".tmp").rglob("*") if p.is_file()]
    assert stray == [], f"temp files left: {stray[:5]}"
    # After every kill, the index still equals the result files (rows = results, same sha256s).
    assert assert_index_matches_results(results) == completed
    return {"inputs": len(expected), "completed": completed, "failed": failed_count,
            "lost": 0, "duplicates": 0}


@pytest.mark.daemon
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigkill_at_random_moments_loses_nothing_short(tmp_path: Path) -> None:
    seed = int(os.environ.get("INBOXD_SOAK_SEED", "20261130"))
    figures = soak(tmp_path, files=200, kills=5, seed=seed)
    assert figures["completed"] == 200, figures


@pytest.mark.daemon
@pytest.mark.soak
@pytest.mark.timeout(3600)
def test_sigkill_at_random_moments_loses_nothing_long(tmp_path: Path) -> None:
    seed = int(os.environ.get("INBOXD_SOAK_SEED", str(random.randrange(1 << 30))))
    figures = soak(tmp_path, files=1200, kills=24, seed=seed)
    print(f"soak figures: {figures}")
    assert figures["completed"] == 1200, figures
