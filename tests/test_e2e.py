"""End to end: the real daemon process, real watchfiles on real folders, the real model."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from inboxd.pipeline.watcher import STARTUP_RESCAN_S

from tests.conftest import (
    drop,
    last_stats,
    make_image,
    read_json,
    wait_until,
    write_config,
)


@pytest.mark.daemon
def test_dropped_photo_gets_a_result_and_moves_to_done(tmp_path: Path, daemon_factory) -> None:
    config = write_config(tmp_path)
    daemon = daemon_factory(config)
    daemon.wait_for("ready")
    from support.photos import photo_paths

    cat = photo_paths()["chelsea"]
    drop(cat, tmp_path / "inbox", "pets/cat.png")

    result_path = tmp_path / "results" / "pets" / "cat.png.json"
    wait_until(result_path.exists, 30, "the result JSON")
    wait_until((tmp_path / "done" / "pets" / "cat.png").exists, 10, "the source in done/")
    result = read_json(result_path)
    assert result["source"] == "pets/cat.png"
    assert result["model"] == "efficientnet_lite0"
    assert result["device"] == "cpu"
    import hashlib

    assert result["sha256"] == hashlib.sha256(cat.read_bytes()).hexdigest()
    assert len(result["top_k"]) == 5
    assert 281 <= result["top_k"][0]["index"] <= 285, result["top_k"][0]
    assert set(result["top_k"][0]) == {"label", "index", "score"}
    assert set(result["timings_ms"]) >= {"queue_wait", "preprocess", "inference", "total"}
    # The weights' sha256: results of retrained weights can be told apart.
    from inboxd.models.efficientnet_lite import builtin_weights_path

    weights = builtin_weights_path().read_bytes()
    assert result["model_sha256"] == hashlib.sha256(weights).hexdigest()
    # The completed line says what the model saw (journalctl -u inboxd -f shows it).
    top = result["top_k"][0]
    line = daemon.wait_for("completed")[0]
    assert f"completed pets/cat.png: {top['label']} {top['score']:.2f}" in line, line
    assert not (tmp_path / "inbox" / "pets" / "cat.png").exists()
    # Every stage's thread has its name in the kernel, for top -H and ps -L.
    task = Path(f"/proc/{daemon.proc.pid}/task")
    names = {(thread / "comm").read_text().strip() for thread in task.iterdir()}
    assert {"io_0", "preprocess_0", "model_0", "decode-spawn_0"} <= names, names
    assert daemon.stop() == 0


@pytest.mark.daemon
@pytest.mark.slow
def test_bad_image_fails_alone_and_the_daemon_keeps_serving(tmp_path: Path, daemon_factory) -> None:
    config = write_config(tmp_path)
    daemon = daemon_factory(config)
    daemon.wait_for("ready")
    inbox = tmp_path / "inbox"
    (inbox / "broken.jpg").write_bytes(b"this is not a JPEG at all")
    report_path = tmp_path / "failed" / "broken.jpg.error.json"
    wait_until(report_path.exists, 30, "the error report")
    report = read_json(report_path)
    assert report["permanent"] is True
    assert "not an image" in report["reason"]
    assert (tmp_path / "failed" / "broken.jpg").read_bytes() == b"this is not a JPEG at all"
    daemon.wait_for("failed", 10)  # the warning line, logged once the report is filed

    make_image(tmp_path / "good.png")
    drop(tmp_path / "good.png", inbox)
    wait_until((tmp_path / "results" / "good.png.json").exists, 30, "a later good file's result")
    assert daemon.proc.poll() is None
    assert daemon.stop() == 0


@pytest.mark.daemon
@pytest.mark.slow
def test_sigterm_drains_and_leaves_nothing_claimed(tmp_path: Path, daemon_factory) -> None:
    config = write_config(tmp_path, capacity={"queue": 2, "event_buffer": 8})
    inbox = tmp_path / "inbox"
    for n in range(60):
        make_image(inbox / f"img{n:03}.png", color=(n * 4, 10, 200))
    daemon = daemon_factory(config)
    daemon.wait_for("completed")
    assert daemon.stop(signal.SIGTERM) == 0
    processing = inbox / ".processing" / "default"
    assert list(processing.rglob("*")) == [], "claimed files went back to the inbox"
    results = {p.name.removesuffix(".json") for p in (tmp_path / "results").glob("*.json")}
    left = {p.name for p in inbox.glob("*.png")}
    assert results | left == {f"img{n:03}.png" for n in range(60)}
    assert results.isdisjoint(left)
    assert "[stopped]" in daemon.output()


@pytest.mark.daemon
@pytest.mark.slow
def test_once_processes_the_backlog_and_reports_failures(tmp_path: Path) -> None:
    config = write_config(tmp_path, capacity={"event_buffer": 4})
    inbox = tmp_path / "inbox"
    for n in range(12):
        make_image(inbox / "deep" / f"{n}.jpg", fmt="JPEG")
    (inbox / "zero.png").write_bytes(b"")
    done = subprocess.run([sys.executable, "-m", "inboxd", "once", "-c", str(config)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr  # one file failed
    assert "12 completed, 1 failed" in done.stdout
    assert len(list((tmp_path / "results" / "deep").glob("*.jpg.json"))) == 12
    assert "empty file" in read_json(tmp_path / "failed" / "zero.png.error.json")["reason"]

    # Nothing left: a second run succeeds with nothing to do.
    again = subprocess.run([sys.executable, "-m", "inboxd", "once", "-c", str(config)],
                           cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0
    assert "0 completed, 0 failed" in again.stdout


@pytest.mark.daemon
def test_submit_copies_atomically_into_the_inbox(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    source = make_image(tmp_path / "elsewhere" / "photo.png")
    first = subprocess.run([sys.executable, "-m", "inboxd", "submit", str(source), str(source),
                            "-c", str(config)], cwd=tmp_path, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    names = sorted(p.name for p in (tmp_path / "inbox").iterdir())
    # A second submit never overwrites the first: it takes a free variant of the name.
    assert len(names) == 2 and "photo.png" in names, names
    assert all(name.startswith("photo.") and name.endswith(".png") for name in names)
    for name in names:
        assert (tmp_path / "inbox" / name).read_bytes() == source.read_bytes()


@pytest.mark.daemon
@pytest.mark.slow
@pytest.mark.timeout(900)  # its own wait allows 900 s: a slow shared machine is not a failure
def test_flood_with_tiny_capacities_keeps_every_bound(tmp_path: Path, daemon_factory) -> None:
    """3,000 files against capacities of a few items: each file gets exactly one outcome, no
    layer ever holds more than its capacity, and the overflow path (deferred) really ran."""
    total = 3000
    capacity = {"event_buffer": 16, "queue": 2, "preprocess_cache": 4, "retry_list": 4}
    config = write_config(tmp_path, capacity=capacity, batch={"max_size": 8},
                          # No timer rescans: draining the deferred backlog must not need them.
                          inbox={"rescan_interval_s": 3600, "settle_ms": 0})
    daemon = daemon_factory(config)
    daemon.wait_for("ready")
    inbox = tmp_path / "inbox"
    seed = make_image(tmp_path / "seed.png", size=(32, 32))
    data = seed.read_bytes()
    for n in range(total):
        tmp = inbox / f".{n}.tmp"
        tmp.write_bytes(data)
        os.rename(tmp, inbox / f"f{n:05}.png")

    results = tmp_path / "results"
    wait_until(lambda: sum(n.endswith(".json") for n in os.listdir(results)) >= total, 900,
               "every result")
    # The watcher paused while the backlog waited on disk and watches again now: a file
    # dropped after its early rescan can only be found by it (no timer rescans).
    assert daemon.records("deferred") and "watcher pauses" in daemon.records("deferred")[0]
    # Told once per episode, not once per scan (hundreds here, each deferring again); the
    # last episode's end may still be on its way.
    wait_until(lambda: len(daemon.records("deferred")) <= len(daemon.records("watching")), 60,
               f"as many [watching] as [deferred] ({len(daemon.records('deferred'))})")
    time.sleep(STARTUP_RESCAN_S + 1)
    os.rename(make_image(tmp_path / "late.png", size=(32, 32), color=(9, 9, 9)),
              inbox / "late.png")
    wait_until(lambda: (results / "late.png.json").exists(), 30, "the watcher to see late.png")
    assert daemon.stop() == 0
    names = {f"f{n:05}.png" for n in range(total)} | {"late.png"}
    assert {p.name.removesuffix(".json") for p in results.glob("*.json")} == names
    assert {p.name for p in (tmp_path / "done").iterdir()} == names
    assert not [p for p in (tmp_path / "failed").rglob("*") if p.is_file()]

    stats = last_stats(daemon.records("stats"))
    assert int(stats["COMPLETED"]) == total + 1
    assert int(stats["DEFERRED"]) > 0, "the event buffer overflowed to disk"
    for layer, bound in capacity.items():
        assert int(stats[f"{layer.upper()}_HIGH_WATER"]) <= bound, (layer, stats)
        assert int(stats[f"{layer.upper()}_CAPACITY"]) == bound
    assert int(stats["QUEUE_HIGH_WATER"]) == capacity["queue"], "the queue really filled"
    assert int(stats["BATCH_HIGH_WATER"]) <= 8


@pytest.mark.slow
@pytest.mark.timeout(900)  # the export, at a low priority on a busy machine, takes minutes
def test_the_fast_runtime_is_swapped_in_while_serving_and_reused_after_a_restart(
        tmp_path: Path, daemon_factory) -> None:
    """The real daemon serves at once with torch while the exporter process builds the ONNX
    artifact, swaps it in between two batches (every file still gets a result that agrees),
    and a restart loads the artifact instead of exporting again."""
    from support.photos import photo_paths
    from tests.conftest import line_fields

    photos = photo_paths()
    cache = tmp_path / "cache"
    config = write_config(tmp_path, model={"cache_dir": str(cache)})
    inbox = tmp_path / "inbox"
    for name, path in photos.items():  # found by the start-up scan: served before any swap
        drop(path, inbox, f"before/{name}{path.suffix}")
    daemon = daemon_factory(config)
    started = line_fields(daemon.wait_for("started")[0])
    assert (started["RUNTIME"], started["RUNTIME_CHOSEN"], started["RUNTIME_STATE"]) == (
        "torch", "onnxruntime", "building"), started
    assert started["BF16_NATIVE"] and started["CPU_CAPABILITY"]
    before = {name: tmp_path / "results" / "before" / f"{name}{path.suffix}.json"
              for name, path in photos.items()}
    wait_until(lambda: all(p.exists() for p in before.values()), 120, "the first results")
    swapped = line_fields(daemon.wait_for("runtime", timeout_s=600)[0])
    assert (swapped["RUNTIME"], swapped["RUNTIME_ARTIFACT"]) == ("onnxruntime", "exported"), (
        daemon.output())
    for name, path in photos.items():
        drop(path, inbox, f"after/{name}{path.suffix}")
    after = {name: tmp_path / "results" / "after" / f"{name}{path.suffix}.json"
             for name, path in photos.items()}
    wait_until(lambda: all(p.exists() for p in after.values()), 120, "the results after")
    for name in photos:
        old, new = read_json(before[name]), read_json(after[name])
        assert (old["runtime"], new["runtime"]) == ("torch", "onnxruntime"), name
        assert old["precision"] == new["precision"] == "fp32"
        assert new["top_k"][0]["index"] == old["top_k"][0]["index"], name
        assert abs(new["top_k"][0]["score"] - old["top_k"][0]["score"]) <= 0.01, name
    assert 281 <= read_json(after["chelsea"])["top_k"][0]["index"] <= 285
    assert daemon.stop() == 0
    assert len(daemon.records("runtime")) == 1

    artifact = Path(swapped["RUNTIME_CACHE_FILE"])
    built = os.stat(artifact)
    again = daemon_factory(config)
    # The restart serves from the artifact from its first batch, torch never loaded
    # (tests/models/test_torch_free.py): nothing is exported or swapped in.
    reloaded = line_fields(again.wait_for("started", timeout_s=120)[0])
    assert (reloaded["RUNTIME"], reloaded["RUNTIME_ARTIFACT"]) == (
        "onnxruntime", "cached, served without torch"), reloaded
    drop(photos["chelsea"], inbox, "restart/cat.png")
    result = tmp_path / "results" / "restart" / "cat.png.json"
    wait_until(result.exists, 60, "the result after the restart")
    assert read_json(result)["runtime"] == "onnxruntime"
    assert again.stop() == 0
    assert again.records("runtime") == []  # loaded, not exported: the file is the same
    now = os.stat(artifact)
    assert (now.st_ino, now.st_mtime_ns) == (built.st_ino, built.st_mtime_ns)
