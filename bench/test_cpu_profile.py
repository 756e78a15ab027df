"""``bench/cpu_profile.py`` charges each process's (and each daemon thread's) CPU to stages in
the proportions of its own py-spy samples, by the innermost frame that names a stage. The
samples here are py-spy's raw format as ``py-spy record --subprocesses --threads`` writes it."""

from __future__ import annotations

import pytest

from bench.cpu_profile import COMMIT, MODEL, OTHER, by_stage, parse_raw

DAEMON = 'process 10:"python -m inboxd run -c x.yaml"'
WORKER = DAEMON + ';process 11:"python -m inboxd.decode.worker_child"'
RAW = "\n".join([
    f"{WORKER};thread (11): MainThread;main (inboxd/decode/worker_child.py);"
    "decode_image (inboxd/decode/pillow.py);Image.resize (PIL/Image.py) 30",
    f"{WORKER};thread (11): MainThread;main (inboxd/decode/worker_child.py);"
    "decode_image (inboxd/decode/pillow.py);ImageFile.load (PIL/ImageFile.py) 60",
    f"{WORKER};thread (11): MainThread;main (inboxd/decode/worker_child.py);"
    "read_and_hash (inboxd/files/reading.py) 10",
    f"{DAEMON};thread (10): inboxd-model_0;run (threading.py);"
    "forward (inboxd/models/model.py) 5",
    f"{DAEMON};thread (10): MainThread;run_forever (asyncio/base_events.py) 5",
])


def test_samples_are_charged_to_the_innermost_stage_they_name() -> None:
    samples = parse_raw(RAW)
    assert samples[("decode_workers", "process")] == {"resize": 30, "decode": 60,
                                                      "read + hash": 10}
    assert samples[("daemon", "model")] == {MODEL: 5}
    assert samples[("daemon", "event loop")] == {OTHER: 5}


def test_ticks_split_by_each_threads_own_samples() -> None:
    stages = by_stage({"daemon": 30.0, "decode_workers": 100.0, "commit": 2.0},
                      {"model": 20.0, "event loop": 4.0, "python": 5.0},
                      parse_raw(RAW))
    assert stages["decode"] == pytest.approx(60.0)
    assert stages["resize"] == pytest.approx(30.0)
    assert stages["read + hash"] == pytest.approx(10.0)
    # The model thread, plus an unnamed thread (a runtime's intra-op pool) py-spy cannot see.
    assert stages[MODEL] == pytest.approx(25.0)
    # The event loop and 1 ms of threads that ended; the commit process, without samples,
    # is charged to what it does.
    assert stages[OTHER] == pytest.approx(4.0 + 1.0)
    assert stages[COMMIT] == pytest.approx(2.0)
    assert sum(stages.values()) == pytest.approx(132.0)
