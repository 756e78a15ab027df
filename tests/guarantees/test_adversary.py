"""The real daemon (real watchfiles, real model) against what a hostile or careless user does:
a name reused while its first file is in flight, a linked folder inside the inbox, a writer that
pauses longer than settle_ms, Ctrl-C during ``inboxd once``."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from PIL import Image

from support.harness import sha256_hex as sha
from tests.conftest import drop, last_stats, make_image, read_json, wait_until, write_config


def done_and_results(root: Path) -> dict[str, str]:
    """done/<name> → the sha256 its result (results/<name>.json) records, for every done file;
    also checks that the done file's own bytes are what its result describes."""
    found = {}
    for path in sorted((root / "done").rglob("*")):
        if not path.is_file() or ".tmp" in path.parts:
            continue
        name = path.relative_to(root / "done").as_posix()
        result = read_json(root / "results" / f"{name}.json")
        assert result["sha256"] == sha(path.read_bytes()), f"{name}: result of other bytes"
        found[name] = result["sha256"]
    return found


@pytest.mark.daemon
@pytest.mark.slow
def test_a_name_reused_while_in_flight_keeps_every_input(tmp_path: Path, daemon_factory) -> None:
    """A scanner that always writes scan.png: each drop lands while the last may still be in
    flight. Every drop's bytes end in done/ under a name whose result is its own."""
    config = write_config(tmp_path, inbox={"settle_ms": 0})
    daemon = daemon_factory(config)
    daemon.wait_for("ready")
    inbox = tmp_path / "inbox"
    dropped = []
    for n in range(12):
        source = make_image(tmp_path / "src" / f"{n}.png", color=(n * 20, 40, 90))
        dropped.append(sha(source.read_bytes()))
        # Like the scanner: the next scan.png once the last one was taken from the inbox
        # (a rename over a file still in the inbox would be the writer's own overwrite).
        wait_until(lambda: not (inbox / "scan.png").exists(), 30, "the last drop claimed")
        drop(source, inbox, name="scan.png")
    wait_until(lambda: len(done_and_results(tmp_path)) == 12, 90, "twelve done files")
    assert sorted(done_and_results(tmp_path).values()) == sorted(dropped)
    assert not list((tmp_path / "failed").glob("*.png"))
    assert daemon.stop() == 0


@pytest.mark.daemon
@pytest.mark.slow
def test_a_linked_folder_in_the_inbox_is_never_followed(tmp_path: Path, daemon_factory) -> None:
    config = write_config(tmp_path, inbox={"settle_ms": 0})
    elsewhere = tmp_path / "alice"
    elsewhere.mkdir()
    (tmp_path / "inbox").mkdir(exist_ok=True)
    (tmp_path / "inbox" / "photos").symlink_to(elsewhere)
    make_image(elsewhere / "before.png")
    daemon = daemon_factory(config)
    daemon.wait_for("ready")
    make_image(elsewhere / "after.png")  # created behind the link while it is watched
    # A file of the inbox itself, dropped afterwards: once it is done, the watcher has seen
    # (and had the chance to mishandle) what happened behind the link.
    drop(make_image(tmp_path / "src" / "own.png"), tmp_path / "inbox")
    wait_until((tmp_path / "done" / "own.png").exists, 60, "the inbox's own file")
    # Two stats records later (interval 1 s), with nothing left in the event buffer or the
    # queue: whatever the watcher made of the change behind the link has been acted on.
    records = len(daemon.records("stats"))
    stats = last_stats(daemon.wait_for("stats", 30, count=records + 2))
    assert (stats["EVENT_BUFFER_SIZE"], stats["QUEUE_SIZE"]) == ("0", "0"), stats
    assert sorted(p.name for p in elsewhere.iterdir()) == ["after.png", "before.png"]
    assert not (tmp_path / "results" / "photos").exists()
    assert daemon.stop() == 0


@pytest.mark.daemon
@pytest.mark.slow
@pytest.mark.parametrize("pause_s", [0.5, 2.0])
def test_a_writer_pausing_longer_than_settle_ms_gets_its_whole_file(
        tmp_path: Path, daemon_factory, pause_s: float) -> None:
    """It used to fail as "truncated" (a 300 ms stall at settle_ms 250 failed 4 of 4)."""
    config = write_config(tmp_path, inbox={"settle_ms": 250})
    daemon = daemon_factory(config)
    daemon.wait_for("ready")
    image = Image.effect_noise((256, 256), 60).convert("RGB")
    image.save(tmp_path / "whole.png")
    payload = (tmp_path / "whole.png").read_bytes()
    target = tmp_path / "inbox" / "slow.png"
    with open(target, "wb") as writer:  # written in place, no temp name, like a camera
        writer.write(payload[: len(payload) // 3])
        writer.flush()
        time.sleep(pause_s)
        writer.write(payload[len(payload) // 3:])
    result_path = tmp_path / "results" / "slow.png.json"
    wait_until(result_path.exists, 60, "the slow file's result")
    assert read_json(result_path)["sha256"] == sha(payload)
    assert not list((tmp_path / "failed").glob("*.png"))
    assert daemon.stop() == 0


@pytest.mark.daemon
@pytest.mark.slow
def test_a_writer_that_pauses_past_settle_ms_gets_the_result_of_its_whole_file(
        tmp_path: Path, daemon_factory) -> None:
    """The file is claimed during the pause, and what is there by then is a complete image:
    it decodes. The decode worker sees the file still held open for writing and the daemon
    gives it back; the result is of every byte the writer wrote."""
    config = write_config(tmp_path, inbox={"settle_ms": 100})
    daemon = daemon_factory(config)
    daemon.wait_for("ready")
    Image.effect_noise((200, 200), 60).convert("RGB").save(tmp_path / "whole.png")
    image = (tmp_path / "whole.png").read_bytes()
    trailer = b"appended after the pause" * 100
    target = tmp_path / "inbox" / "paused.png"
    with open(target, "wb") as writer:
        writer.write(image)
        writer.flush()
        daemon.wait_for("released", 30)  # claimed mid-write, decoded, given back
        time.sleep(0.5)
        writer.write(trailer)
    result_path = tmp_path / "results" / "paused.png.json"
    wait_until(result_path.exists, 30, "the paused file's result")
    assert read_json(result_path)["sha256"] == sha(image + trailer)
    assert "still being written" in daemon.records("released")[0]
    assert not any((tmp_path / "failed").glob("*"))
    assert daemon.stop() == 0


@pytest.mark.daemon
@pytest.mark.slow
def test_a_broken_lease_does_not_kill_the_daemon(tmp_path: Path, daemon_factory) -> None:
    """A lease broken by a writer's open is signalled with SIGIO, which kills by default: an
    uploader opening its file in a loop could otherwise stop the daemon (see
    files/settling.py)."""
    daemon = daemon_factory(write_config(tmp_path))
    daemon.wait_for("ready")
    daemon.proc.send_signal(signal.SIGIO)
    drop(make_image(tmp_path / "a.png"), tmp_path / "inbox")
    wait_until((tmp_path / "results" / "a.png.json").exists, 30, "a result after SIGIO")
    assert daemon.stop() == 0


@pytest.mark.daemon
@pytest.mark.slow
def test_ctrl_c_stops_once_like_run(tmp_path: Path) -> None:
    """``once`` had no signal handling: Ctrl-C left files hidden in .processing/."""
    config = write_config(tmp_path, inbox={"settle_ms": 0}, batch={"max_size": 1},
                          capacity={"queue": 1, "preprocess_cache": 1})
    for n in range(300):
        make_image(tmp_path / "inbox" / f"f{n:03}.png", size=(640, 480))
    once = subprocess.Popen([sys.executable, "-m", "inboxd", "once", "-c", str(config)],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    wait_until(lambda: any((tmp_path / "done").glob("*.png")), 120, "the first result")
    once.send_signal(signal.SIGINT)
    _, err = once.communicate(timeout=90)
    assert once.returncode == 130, err
    waiting = sorted(p.name for p in (tmp_path / "inbox").glob("*.png"))
    assert f"{len(waiting)} file(s) wait in the inbox" in err
    assert 0 < len(waiting) < 300
    done = {p.name for p in (tmp_path / "done").glob("*.png")}
    assert done.isdisjoint(waiting) and len(done) + len(waiting) == 300
    processing = tmp_path / "inbox" / ".processing" / "default"
    assert not [p for p in processing.rglob("*") if p.is_file()]
