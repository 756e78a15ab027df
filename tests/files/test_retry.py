"""``inboxd retry``: failed files back into their own inbox, never over another file, only
those asked for (PATH, ``--reason``), nothing moved by ``--dry-run``, and with a live daemon
the returned file gets its result."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from inboxd.cli import main
from inboxd.config import Config, load_config
from inboxd.files import retry_failed as retry_mod
from inboxd.files.layout import processing_dir
from inboxd.files.lifecycle import Lifecycle

from tests.conftest import DaemonProcess, drop, make_image, wait_until, write_config


def fail(config: Config, rel: str, data: bytes, reason: str, reason_class: str,
         instance: str | None = None, inbox: Path | None = None) -> Path:
    """A failure as the daemon records it: the claimed file moved by Lifecycle.finish_failure
    next to its report (the fields of pipeline/outcomes.py)."""
    inbox = inbox or config.inbox.paths[0]
    key = f"{inbox.name}/{rel}" if len(config.inbox.paths) > 1 else rel
    claimed = processing_dir(config, inbox) / rel
    claimed.parent.mkdir(parents=True, exist_ok=True)
    claimed.write_bytes(data)
    report = {"source": key, "inbox": str(inbox), "rel": rel, "reason": reason,
              "reason_class": reason_class, "permanent": True, "attempts": [reason],
              "sha256": None, "instance": instance or config.instance,
              "failed_at": "2026-12-01T00:00:00.000Z"}
    Lifecycle(config).finish_failure(claimed, key, report)
    return config.failed_dir / key


def names(folder: Path) -> list[str]:
    """What a user sees there: hidden folders (.processing/, .tmp/) left out."""
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))


def run_retry(config_path: Path, *args: str) -> int:
    return main(["retry", "-c", str(config_path), *args])


@pytest.fixture
def setup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Config]:
    monkeypatch.chdir(tmp_path)
    path = write_config(tmp_path)
    return path, load_config(path)


def test_a_name_taken_in_the_inbox_is_never_overwritten(
        setup: tuple[Path, Config], capsys: pytest.CaptureFixture[str]) -> None:
    path, config = setup
    inbox = config.inbox.paths[0]
    fail(config, "sub/a.jpg", b"old bytes", "not an image", "decode")
    (inbox / "sub").mkdir()
    (inbox / "sub" / "a.jpg").write_bytes(b"a newer drop of the same name")
    assert run_retry(path, "--all") == 0
    assert (inbox / "sub" / "a.jpg").read_bytes() == b"a newer drop of the same name"
    others = [p for p in (inbox / "sub").iterdir() if p.name != "a.jpg"]
    assert len(others) == 1 and others[0].name.startswith("a.") and others[0].suffix == ".jpg"
    assert others[0].read_bytes() == b"old bytes"  # beside it, under a free variant
    assert list(config.failed_dir.rglob("*.jpg*")) == []  # input and report both gone
    assert "returned 1 failed file(s)" in capsys.readouterr().out


def test_reason_filters_by_class_or_text_and_dry_run_moves_nothing(
        setup: tuple[Path, Config], capsys: pytest.CaptureFixture[str]) -> None:
    path, config = setup
    inbox = config.inbox.paths[0]
    fail(config, "bomb.png", b"1", "image is 9000×9000 pixels, more than ...", "too_large")
    fail(config, "junk.jpg", b"2", "not an image Pillow can read", "decode")
    fail(config, "disk.jpg", b"3", "cannot read the file: No space left on device", "io")
    before = names(config.failed_dir)

    assert run_retry(path, "--reason", "too_large", "--dry-run") == 0
    out = capsys.readouterr().out
    assert "would return 1 failed file(s)" in out and "bomb.png" in out
    assert names(config.failed_dir) == before
    assert names(inbox) == []

    assert run_retry(path, "--reason", "NO SPACE") == 0  # a piece of the text, any case
    assert names(inbox) == ["disk.jpg"]
    assert run_retry(path, "--reason", "decode") == 0
    assert names(inbox) == ["disk.jpg", "junk.jpg"]
    assert names(config.failed_dir) == [
        "bomb.png", "bomb.png.error.json"]


def test_only_what_is_named_and_never_another_instance_s(
        setup: tuple[Path, Config], capsys: pytest.CaptureFixture[str]) -> None:
    path, config = setup
    inbox = config.inbox.paths[0]
    one = fail(config, "one.jpg", b"1", "x", "decode")
    fail(config, "two.jpg", b"2", "x", "decode")
    fail(config, "gpu1.jpg", b"3", "x", "decode", instance="gpu1")
    assert run_retry(path) == 2  # nothing named: a usage error, nothing moved
    assert run_retry(path, str(one) + ".error.json", "nothing-like-this.jpg") == 1
    assert names(inbox) == ["one.jpg"]
    assert "nothing-like-this.jpg: no failed file of that name" in capsys.readouterr().err
    assert run_retry(path, "--all") == 0
    assert "retry it with --instance gpu1" in capsys.readouterr().err
    assert names(inbox) == ["one.jpg", "two.jpg"]
    assert run_retry(path, "--all", "--instance", "gpu1") == 0
    assert (inbox / "gpu1.jpg").read_bytes() == b"3"


def test_a_retry_killed_half_way_loses_no_report(setup: tuple[Path, Config]) -> None:
    _, config = setup
    failed = fail(config, "a.jpg", b"1", "x", "decode")
    report = failed.with_name("a.jpg.error.json")
    aside = config.failed_dir / ".tmp" / "retry-1-2.error.json"
    report.rename(aside)  # where a retry killed before moving the file leaves it
    assert retry_mod.put_back_stranded(config) == 1
    assert json.loads(report.read_text())["source"] == "a.jpg" and not aside.exists()


@pytest.mark.daemon
@pytest.mark.slow
def test_with_a_live_daemon_a_fixed_file_gets_its_result_in_its_own_inbox(
        tmp_path: Path) -> None:
    """Two inboxes with a file of the same name failing in each: the one retried goes back to
    its own inbox (not the other, not the first) and the running daemon processes it.

    This daemon has no ``metrics:`` and runs with Python's import log on: it also shows that
    prometheus_client is then never imported (one daemon start fewer in the suite)."""
    photos, scans = tmp_path / "photos", tmp_path / "scans"
    config = write_config(tmp_path, inbox={"paths": [str(photos), str(scans)]})
    daemon = DaemonProcess(config, env={"PYTHONPROFILEIMPORTTIME": "1"})
    try:
        daemon.wait_for("ready", 120)
        for inbox in (photos, scans):
            inbox.mkdir(exist_ok=True)
            junk = tmp_path / "junk" / inbox.name / "a.jpg"
            junk.parent.mkdir(parents=True)
            junk.write_bytes(b"not a jpeg " + inbox.name.encode())
            drop(junk, inbox)
        failed = tmp_path / "failed"
        # The [failed] records come once each source is in failed/ too (its .error.json is
        # written first): replacing the file before that raced the daemon's move of it.
        daemon.wait_for("failed", 60, count=2)
        assert len(list(failed.rglob("*.error.json"))) == 2
        report = json.loads((failed / "scans" / "a.jpg.error.json").read_text())
        assert (report["inbox"], report["rel"], report["reason_class"]) == (
            str(scans), "a.jpg", "decode")
        # The cause fixed: the real picture put in place of the broken one.
        make_image(failed / "scans" / "a.jpg", fmt="JPEG")
        done = subprocess.run(
            [sys.executable, "-m", "inboxd", "retry", "-c", str(config),
             str(failed / "scans" / "a.jpg")],
            capture_output=True, text=True, timeout=60, cwd=tmp_path, check=False)
        assert done.returncode == 0, done.stderr
        assert "returned 1 failed file(s) to the inbox" in done.stdout
        result = tmp_path / "results" / "scans" / "a.jpg.json"
        wait_until(result.exists, 60, "the retried file's result")
        assert json.loads(result.read_text())["top_k"]
        # The source moves after its result is durable: a moment after the JSON appears.
        wait_until((tmp_path / "done" / "scans" / "a.jpg").exists, 30, "the source in done/")
        assert not (failed / "scans" / "a.jpg.error.json").exists()
        assert (failed / "photos" / "a.jpg").read_bytes() == b"not a jpeg photos"
        assert (failed / "photos" / "a.jpg.error.json").exists()
        assert not (tmp_path / "results" / "photos").exists()
    finally:
        assert daemon.stop() == 0, daemon.output()[-3000:]
    imports = daemon.output()
    assert "inboxd.pipeline.wiring" in imports  # the import log is really there
    assert "prometheus_client" not in imports
