"""End to end with the real daemon, real watchfiles and the real model: every format people
drop under the default config, names not taken said once, folders moved in found at once,
and an inbox polled instead of watched by inotify."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from PIL import Image

from support.photos import photo_paths
from tests.conftest import drop, line_fields, read_json, wait_until, write_config

# One photo saved in every format, under the names phones, browsers and scanners give them.
# Extensions in upper case too: the default include matches without regard to case.
SAVES = {
    "coffee.jpg": ("JPEG", {"quality": 92}),
    "IMG_0002.JPEG": ("JPEG", {"quality": 92}),
    "download.jfif": ("JPEG", {"quality": 92}),
    "old.jpe": ("JPEG", {"quality": 92}),
    "cat.png": ("PNG", {}),
    "cat.webp": ("WEBP", {"quality": 90}),
    "cat.gif": ("GIF", {}),
    "Screenshot.BMP": ("BMP", {}),
    "scan.tiff": ("TIFF", {}),
    "scan2.TIF": ("TIFF", {}),
    "download.avif": ("AVIF", {"quality": 80}),
    "IMG_0001.HEIC": ("HEIF", {"quality": 90}),
    "cat.heif": ("HEIF", {"quality": 90}),
    "cat.jp2": ("JPEG2000", {}),
    "cat.jxl": ("JXL", {}),
}


def top1(results: Path, name: str) -> str:
    label: str = read_json(results / f"{name}.json")["top_k"][0]["label"]
    return label


def stats_field(daemon: object, key: str) -> int | None:
    for line in reversed(daemon.records("stats")):  # type: ignore[attr-defined]
        fields = line_fields(line)
        if key in fields:
            return int(fields[key])
    return None


@pytest.mark.daemon
@pytest.mark.slow
def test_every_format_under_the_default_config_and_folders_moved_in_at_once(
    tmp_path: Path, daemon_factory,
) -> None:
    # Timer rescans off (an hour): only watcher events can find what is dropped or moved.
    config = write_config(tmp_path, inbox={"rescan_interval_s": 3600})
    daemon = daemon_factory(config)
    source = tmp_path / "made"
    source.mkdir()
    # The espresso: a decisive top-1 (0.95), so a lossy format cannot tip it into a near tie.
    with Image.open(photo_paths()["coffee"]) as photo:
        rgb = photo.convert("RGB")
        for name, (fmt, options) in SAVES.items():
            rgb.save(source / name, format=fmt, **options)
    (source / "notes.txt").write_text("not an image")
    (source / "photo.xyz").write_bytes(b"who knows")
    (source / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")
    daemon.wait_for("ready")
    inbox, results = tmp_path / "inbox", tmp_path / "results"
    for path in source.iterdir():
        drop(path, inbox)
    for name in SAVES:
        wait_until((results / f"{name}.json").exists, 60, f"the result of {name}")
    expected = top1(results, "coffee.jpg")
    assert expected == "espresso"
    assert {name: top1(results, name) for name in SAVES} == dict.fromkeys(SAVES, expected)

    # Not taken: said once each with the fix (the names stay in the inbox); litter: silence.
    wait_until(lambda: stats_field(daemon, "IGNORED_NAMES") == 2, 10, "IGNORED_NAMES=2")
    skipped = daemon.records("skipped")
    assert len([s for s in skipped if "notes.txt" in s]) == 1, skipped
    assert any("photo.xyz" in s and "add `*.xyz` to inbox.include" in s for s in skipped)
    assert not [s for s in skipped if "DS_Store" in s], skipped
    assert (stats_field(daemon, "IGNORED") or 0) >= 2
    assert sorted(p.name for p in inbox.iterdir() if p.is_file()) == [
        ".DS_Store", "notes.txt", "photo.xyz"]

    # One `mv` of a folder tree: every file's result within 2 s, with no rescan to help.
    album = tmp_path / "album"
    nested = {"a.jpg": "coffee.jpg", "2024/b.png": "cat.png", "2024/06/c.HEIC": "cat.heif",
              "2024/06/30/d.webp": "cat.webp", "2024/06/30/e.jfif": "download.jfif"}
    for rel, made in nested.items():
        (album / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(source / made, album / rel)
    moved_at = time.monotonic()
    os.rename(album, inbox / "album")
    for rel in nested:
        wait_until((results / "album" / f"{rel}.json").exists, 2.0, f"album/{rel} within 2 s")
    latency_s = time.monotonic() - moved_at
    print(f"moved folder: {len(nested)} results {latency_s:.2f} s after the mv")
    assert daemon.stop() == 0


@pytest.mark.daemon
@pytest.mark.slow
def test_a_polled_inbox_is_watched_without_inotify(tmp_path: Path, daemon_factory) -> None:
    config = write_config(tmp_path, inbox={"poll": "always", "poll_interval_ms": 100,
                                           "rescan_interval_s": 3600})
    daemon = daemon_factory(config)
    daemon.wait_for("ready")
    started = daemon.records("started")[0]
    assert "polling" in started and "inbox.poll: always" in started, started
    fds = Path(f"/proc/{daemon.proc.pid}/fd")
    links = [os.readlink(fd) for fd in fds.iterdir() if fd.is_symlink()]
    assert not [link for link in links if "inotify" in link], links
    drop(photo_paths()["chelsea"], tmp_path / "inbox", "polled/cat.png")
    wait_until((tmp_path / "results" / "polled" / "cat.png.json").exists, 20, "the result")
    assert daemon.stop() == 0


@pytest.mark.daemon
def test_submit_refuses_a_name_the_daemon_would_never_take(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    notes = tmp_path / "notes.txt"
    notes.write_text("not an image")
    photo = tmp_path / "IMG_0001.HEIC"
    shutil.copy(photo_paths()["chelsea"], photo)
    done = subprocess.run([sys.executable, "-m", "inboxd", "submit", "-c", str(config),
                           str(notes), str(photo)], capture_output=True, text=True)
    assert done.returncode == 1, done
    assert "add `*.txt` to inbox.include" in done.stderr
    assert sorted(p.name for p in (tmp_path / "inbox").iterdir()) == ["IMG_0001.HEIC"]


@pytest.fixture(autouse=True)
def _formats_present() -> None:
    from inboxd.decode import formats

    missing = {f.name for f in formats.FORMATS} - {f.name for f in formats.decodable()}
    assert not missing, f"this build should decode every format; missing {missing}"
