"""Outputs on exFAT (a USB disk): names it cannot hold are filed under their portable form.

results/, done/ and failed/ on a real exFAT (``exfatprogs`` + ``exfat-fuse`` on a loop device):
case-insensitive, no ``RENAME_NOREPLACE``, no ``?``, ``:`` or non-UTF-8 names (refused with
ENOENT, EILSEQ). Photos under such names used to cycle for ever — result refused, failed/
refused, released, claimed, decoded and inferred again. Each must now get exactly one outcome,
under its portable name (``names.portable_key``), with its original name in its result or
report; and two names that differ only in case must both be kept.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.conftest import drop, last_stats, make_image, wait_until, write_config

pytestmark = [pytest.mark.daemon, pytest.mark.slow,
              pytest.mark.skipif(os.geteuid() != 0, reason="loop devices and mounts need root"),
              pytest.mark.skipif(not os.path.exists("/dev/fuse"),
                                 reason="FUSE is not available here (no /dev/fuse)")]

# name in the inbox (bytes: one is not UTF-8) → the name its outcome is filed under
GOOD = {b"what?.png": "what%3F.png", b"c:d.png": "c%3Ad.png", b"caf\xe9.png": "caf%E9.png",
        b"q?dir/x.png": "q%3Fdir/x.png", b"plain.png": "plain.png",
        b"Case.png": "Case.png"}
BAD = {b"bad?.png": "bad%3F.png"}  # not an image: failed/, under its portable name


@contextmanager
def exfat(mountpoint: Path, size_mb: int = 32) -> Iterator[Path]:
    for tool in ("mkfs.exfat", "mount.exfat-fuse"):
        assert shutil.which(tool), (f"{tool} is missing: `make test-system-deps` installs "
                                    "exfatprogs and exfat-fuse")
    image = mountpoint.with_name(mountpoint.name + ".img")
    with open(image, "wb") as handle:
        handle.truncate(size_mb << 20)
    subprocess.run(["mkfs.exfat", str(image)], check=True, capture_output=True)
    loop = subprocess.run(["losetup", "-f", "--show", str(image)], check=True,
                          capture_output=True, text=True).stdout.strip()
    mountpoint.mkdir(parents=True, exist_ok=True)
    try:
        subprocess.run(["mount.exfat-fuse", loop, str(mountpoint)], check=True,
                       capture_output=True)
        try:
            yield mountpoint
        finally:
            subprocess.run(["umount", "-l", str(mountpoint)], check=False)
    finally:
        subprocess.run(["losetup", "-d", loop], check=False)
        image.unlink()


def files_under(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*")
            if p.is_file() and ".tmp" not in p.relative_to(folder).parts}


def test_names_exfat_cannot_hold_get_one_outcome_under_their_portable_form(
        tmp_path: Path, daemon_factory) -> None:
    with exfat(tmp_path / "usb") as usb:
        config = write_config(tmp_path, results_dir=str(usb / "results"),
                              done_dir=str(usb / "done"), failed_dir=str(usb / "failed"),
                              retry={"max_attempts": 3, "backoff_initial_ms": 50,
                                     "backoff_max_ms": 200})
        daemon = daemon_factory(config)
        daemon.wait_for("ready")
        inbox = os.fsencode(tmp_path / "inbox")
        for n, name in enumerate(GOOD):
            source = make_image(tmp_path / "src" / f"{n}.png", size=(16, 16), color=(n, 9, 99))
            target = os.path.join(inbox, name)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            os.rename(drop(source, tmp_path / "inbox", f"{n}.png"), target)
        # Differs from Case.png in case only: on exFAT the same name, so a variant of it.
        drop(make_image(tmp_path / "src" / "other.png", size=(16, 16), color=(1, 2, 3)),
             tmp_path / "inbox", "case.png")
        (tmp_path / "inbox" / "bad-src").write_bytes(b"not an image")
        os.rename(tmp_path / "inbox" / "bad-src", os.path.join(inbox, b"bad?.png"))

        def settled() -> bool:
            done = files_under(usb / "done")
            return len(done) == len(GOOD) + 1 and len(files_under(usb / "failed")) == 2
        wait_until(settled, 120, "every photo with one outcome")
        done = files_under(usb / "done")
        # The case-only pair: whichever is filed first keeps the name (on exFAT one name for
        # both), the other gets a variant of it; which one is up to the batch order.
        pair = {"Case.png", "case.png"}
        others = {raw: filed for raw, filed in GOOD.items() if filed not in pair}
        assert set(others.values()) <= done
        (plain,) = {name for name in done if name.lower() == "case.png"}
        (variant,) = done - set(others.values()) - {plain}
        assert variant.lower().startswith("case.") and variant.lower() != "case.png"
        sources = {json.loads((usb / "results" / f"{name}.json").read_text())["source"]
                   for name in (plain, variant)}
        assert sources == pair, sources  # one outcome each, its own name recorded
        for raw, filed in others.items():
            result = json.loads((usb / "results" / f"{filed}.json").read_text())
            assert result["source"] == os.fsdecode(raw)  # the original name, recorded
            if filed != os.fsdecode(raw):
                assert result["filed_as"] == filed
        assert files_under(usb / "failed") == {"bad%3F.png", "bad%3F.png.error.json"}
        report = json.loads((usb / "failed" / "bad%3F.png.error.json").read_text())
        assert (report["source"], report["filed_as"]) == ("bad?.png", "bad%3F.png")
        assert report["rel"] == "bad?.png"  # where `inboxd retry` puts it back
        assert daemon.stop() == 0
        stats = last_stats(daemon.records("stats"))
        assert (int(stats["COMPLETED"]), int(stats["FAILED"])) == (len(GOOD) + 1, 1)
        assert int(stats["RELEASED"]) == 0 and int(stats["RETRIED"]) == 0, "no cycle"
        left = [p for p in (tmp_path / "inbox").rglob("*")
                if p.is_file() and ".processing" not in p.parts]
        assert left == [], left
