"""Attacks on issue 36's fixes (a full disk is backpressure; names an output filesystem cannot
hold are filed under their portable form) that worked, each kept as a regression test.

Real filesystems and the real daemon, as in ``test_full_disk.py`` and ``test_exfat_outputs.py``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from inboxd.config import INDEX_FILENAME

from tests.conftest import drop, last_stats, make_image, wait_until, write_config
from tests.guarantees.test_exfat_outputs import exfat, files_under
from tests.guarantees.test_full_disk import QUICK_PROBES, fill, flood, names_in, small_ext4

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="loop devices and mounts need root")
needs_fuse = pytest.mark.skipif(not os.path.exists("/dev/fuse"),
                                reason="FUSE is not available here (no /dev/fuse)")
pytestmark = [pytest.mark.daemon, pytest.mark.slow, needs_root]


@needs_fuse
def test_a_failed_portable_name_says_the_variant_it_took_not_a_real_file_of_that_name(
        tmp_path: Path, daemon_factory) -> None:
    """``b?.png`` is filed on exFAT as ``b%3F.png``, unless a real ``b%3F.png`` failed first:
    then under a variant, and its report's ``filed_as`` must name that variant. It named
    ``b%3F.png``, the other photo's file: whoever follows the report (to look at, retry or
    delete the file it failed) reaches someone else's photo."""
    with exfat(tmp_path / "usb") as usb:
        failed = usb / "failed"
        daemon = daemon_factory(write_config(tmp_path, results_dir=str(usb / "results"),
                                             done_dir=str(usb / "done"), failed_dir=str(failed)))
        daemon.wait_for("ready")
        inbox = tmp_path / "inbox"
        for name, data in (("b%3F.png", b"not an image: the real b%3F"),
                           ("b?.png", b"not an image: b?")):
            count = len(files_under(failed))
            (inbox / ".part").write_bytes(data)
            os.rename(inbox / ".part", inbox / name)
            wait_until(lambda n=count: len(files_under(failed)) == n + 2, 60, f"{name} failed")
        assert daemon.stop() == 0
        reports = {json.loads((failed / report).read_text())["source"]: report
                   for report in files_under(failed) if report.endswith(".error.json")}
        assert set(reports) == {"b%3F.png", "b?.png"}
        ours = json.loads((failed / reports["b?.png"]).read_text())
        filed_as = reports["b?.png"].removesuffix(".error.json")
        assert ours["filed_as"] == filed_as != "b%3F.png", ours
        assert (failed / filed_as).read_bytes() == b"not an image: b?"
        assert (failed / "b%3F.png").read_bytes() == b"not an image: the real b%3F"
        assert "filed_as" not in json.loads((failed / reports["b%3F.png"]).read_text())


@needs_fuse
def test_a_kept_photo_under_a_name_results_cannot_hold_is_done_once(
        tmp_path: Path, daemon_factory) -> None:
    """``after_success: keep`` with results/ on exFAT: ``a?.png``'s result is filed as
    ``a%3F.png.json``, but intake looked for ``a?.png.json`` to see that the photo left in the
    inbox was done, found none, and claimed, inferred and put it back for ever (190
    completions of the one photo in 15 s, a log line each)."""
    with exfat(tmp_path / "usb") as usb:
        daemon = daemon_factory(write_config(tmp_path, results_dir=str(usb / "results"),
                                             inbox={"after_success": "keep"}))
        daemon.wait_for("ready")
        inbox = tmp_path / "inbox"
        drop(make_image(tmp_path / "src" / "1.png", size=(16, 16), color=(2, 9, 99)), inbox,
             "a?.png")
        daemon.wait_for("completed")
        # A photo dropped after it is taken after it: by then a loop would have gone round.
        drop(make_image(tmp_path / "src" / "2.png", size=(16, 16), color=(3, 9, 99)), inbox,
             "later.png")
        wait_until(lambda: "later.png.json" in files_under(usb / "results"), 60, "later.png")
        assert daemon.stop() == 0
        results = {name for name in files_under(usb / "results")
                   if not name.startswith(INDEX_FILENAME)}  # the index lives there too
        assert results == {"a%3F.png.json", "later.png.json"}
        stats = last_stats(daemon.records("stats"))
        assert (int(stats["COMPLETED"]), int(stats["ENQUEUED"])) == (2, 2), stats
        assert sorted(p.name for p in inbox.iterdir() if not p.name.startswith(".")) == [
            "a?.png", "later.png"]


@needs_fuse
def test_an_inbox_on_a_filesystem_without_permissions_is_refused_saying_so(
        tmp_path: Path, daemon_factory) -> None:
    """An inbox on exFAT (a camera's card, a USB stick): every folder reads mode 0777, so the
    daemon's .processing is refused, rightly (any local user could write into it), but the
    message said "someone replaced it — move it aside and look inside": nobody did, and no
    move helps. Since .processing that is not the daemon's own is moved aside and made again,
    each start moved 8 aside and exited 75, for systemd to start it again: a restart loop
    leaving 8 folders in the inbox each time. It must exit 78, naming the filesystem's lack of
    permissions and the mount option, and leave the inbox as it was."""
    with exfat(tmp_path / "usb") as usb:
        (usb / "inbox").mkdir()
        daemon = daemon_factory(write_config(tmp_path, inbox={"paths": [str(usb / "inbox")]}))
        code = daemon.proc.wait(120)
        daemon.stop()
        output = "\n".join(daemon.lines)
        assert "does not keep Unix permissions" in output and "umask=022" in output, output
        assert "someone replaced it" not in output
        assert code == 78, output
        # Not moved aside and made again, start after start: nothing left in the inbox but it.
        assert sorted(os.listdir(usb / "inbox")) == [".processing"]


def test_a_batch_bigger_than_the_room_left_files_what_fits_rather_than_waiting_for_ever(
        tmp_path: Path, daemon_factory) -> None:
    """A disk with ~150 KiB free: the 64 KiB probe passes, a batch of 32 embeddings (a vector
    and a JSON each) does not. Every batch was held whole and sent whole again after each
    passing probe: 0 of 64 photos done in 25 s (35 probes) while ``df`` showed free space.
    What fits must be filed (the held batch is sent in halves), with no photo failed."""
    with small_ext4(tmp_path / "results") as results:
        # Without the index: its WAL (the vectors again, as blobs) takes the room this test
        # measures out; written before the index existed, and not re-measured with it.
        config = write_config(tmp_path, retry=QUICK_PROBES, model={"output": "embed"},
                              batch={"max_size": 32, "max_delay_ms": 800},
                              inbox={"settle_ms": 1000})
        config.write_text(config.read_text() + "index: null\n")
        daemon = daemon_factory(config)
        daemon.wait_for("ready")
        filler = fill(results)
        size = filler.stat().st_size
        filler.unlink()
        with open(filler, "wb") as handle:  # the disk again, but for ~160 KiB
            handle.write(bytes(size - (160 << 10)))
            os.fsync(handle.fileno())
        names = flood(tmp_path / "inbox", 64)
        daemon.wait_for("output_full", 60)
        wait_until(lambda: len(names_in(results, ".json")) >= 4, 60,
                   "what fits in the room left filed")
        assert names_in(tmp_path / "failed") == set()
        filler.unlink()
        wait_until(lambda: names_in(tmp_path / "done") == names, 120, "all 64 done")
        assert names_in(results, ".json") == names
        assert daemon.stop() == 0
        stats = last_stats(daemon.records("stats"))
        assert (int(stats["COMPLETED"]), int(stats["FAILED"]), int(stats["DUPLICATES"])) == (
            64, 0, 0), stats
        assert len(daemon.records("output_full")) <= 3, daemon.records("output_full")
