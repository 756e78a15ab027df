"""The second attack on issue 36's fixes (the claim area put back after a member of the inbox's
group moves ``.processing``): what a member can still do with two renames in a loop. The
attacker is a forked child with another uid in the inbox's group (``test_planted_links``)."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from inboxd.config import load_config
from inboxd.files.lifecycle import Lifecycle
from inboxd.files.takeover import take_over_dead

from support.harness import sha256_hex
from support.waiting import WaitTimeout, wait_until
from tests.byo_models import value_shaped_bomb
from tests.conftest import DaemonProcess, write_config
from tests.guarantees.test_claim_area import drop_all, outcome_shas, photos
from tests.guarantees.test_planted_links import NEIGHBOUR_UID, as_neighbour, shared_inbox

ROOT = os.geteuid() == 0
pytestmark = pytest.mark.skipif(not ROOT, reason="acting as another uid needs root")
SWAPS = 30



def test_areas_moved_away_in_a_loop_do_not_pile_up(root: Path) -> None:
    """Each move of ``.processing`` left a folder of the daemon's in the inbox (holding its old
    lock file) that the member cannot remove and the daemon never did: 200 moves, 200 folders,
    walked at every takeover sweep for ever. The sweep removes a former area once it is empty
    and its locks are free; the claimed files all stay claimed, in the area at the name."""
    inbox = root / "inbox"
    shared_inbox(inbox)
    lifecycle = Lifecycle(load_config(write_config(root, inbox={"settle_ms": 0})))
    lifecycle.lock_instance()
    try:
        for n in range(SWAPS):
            def swap(n: int = n) -> None:
                os.rename(inbox / ".processing", inbox / f".moved{n}")
                os.symlink("/tmp", inbox / ".processing")
            as_neighbour(swap)
            (inbox / f"p{n}.png").write_bytes(b"%d" % n)
            assert lifecycle.claim(inbox, f"p{n}.png") is not None
        sweep = take_over_dead(lifecycle)
        assert [t for t in sweep.taken if t.returned or t.failed or t.finished] == []
        own_folders = sorted(name for name in os.listdir(inbox)
                             if os.lstat(inbox / name).st_uid != NEIGHBOUR_UID)
        assert own_folders == [".processing"]
        claimed = inbox / ".processing" / "default"
        assert sorted(os.listdir(claimed)) == sorted(f"p{n}.png" for n in range(SWAPS))
        # The area held is at the name, locked: the next move is put back as before.
        assert lifecycle.ensure_claim_areas() == 0
    finally:
        lifecycle.unlock_instance()


def test_a_claimed_file_is_opened_in_the_area_held_whatever_the_name_leads_to(
        root: Path) -> None:
    """What a decode worker reopens: the daemon's descriptor of the claimed file, opened in
    the area held (put back first, under the area's lock) however often the member moved it
    and whatever they put at the name; it is the claimed file, never one of theirs."""
    inbox = root / "inbox"
    shared_inbox(inbox)
    lifecycle = Lifecycle(load_config(write_config(root, inbox={"settle_ms": 0})))
    lifecycle.lock_instance()
    try:
        (inbox / "p.png").write_bytes(b"the photo")
        claimed = lifecycle.claim(inbox, "p.png")
        assert claimed is not None
        for n in range(3):
            def swap(n: int = n) -> None:
                os.rename(inbox / ".processing", inbox / f".moved{n}")
                os.mkdir(inbox / ".processing")
                os.mkdir(inbox / ".processing" / "default")
                (inbox / ".processing" / "default" / "p.png").write_bytes(b"the member's")
            as_neighbour(swap)
            fd = lifecycle.open_claimed(claimed)
            try:
                assert os.read(fd, 100) == b"the photo"
            finally:
                os.close(fd)
    finally:
        lifecycle.unlock_instance()


def test_a_file_handed_back_as_the_area_is_put_back_reaches_the_inbox(
        root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A release reaches the claimed file's folder, then the area is put back (another
    thread, after a member's move) and the file moved into the fresh area before the rename
    out: it met no file, took it for gone, and the photo stayed claimed with nobody to finish
    it (stranded while the daemon ran). It is handed back from where it is now."""
    import inboxd.files.lifecycle as lifecycle_module

    inbox = root / "inbox"
    shared_inbox(inbox)
    lifecycle = Lifecycle(load_config(write_config(root, inbox={"settle_ms": 0})))
    lifecycle.lock_instance()
    real_place_inside = lifecycle_module.place_inside
    moves = []

    def put_back_first(*args: object, **kwargs: object) -> str:
        if not moves:  # the race, made certain: between the lookup and the rename
            moves.append(1)
            as_neighbour(lambda: os.rename(inbox / ".processing", inbox / ".moved"))
            assert lifecycle.ensure_claim_areas() == 1
        return real_place_inside(*args, **kwargs)  # type: ignore[arg-type]

    try:
        (inbox / "p.png").write_bytes(b"the photo")
        claimed = lifecycle.claim(inbox, "p.png")
        assert claimed is not None
        monkeypatch.setattr(lifecycle_module, "place_inside", put_back_first)
        assert lifecycle.release(claimed, inbox / "p.png") == str(inbox / "p.png")
        assert (inbox / "p.png").read_bytes() == b"the photo"
        assert not list((inbox / ".processing" / "default").iterdir())
    finally:
        lifecycle.unlock_instance()


def swap_in_a_loop(inbox: Path, for_s: float, every_s: float = 0.01) -> None:
    """As the member: move ``.processing`` away and put a link in its place, again and again."""
    end = time.monotonic() + for_s
    n = 0
    while time.monotonic() < end:
        try:
            os.rename(inbox / ".processing", inbox / f".moved{n}")
            os.symlink("/tmp", inbox / ".processing")
        except OSError:
            pass  # the daemon's fresh area is not there yet: the next round
        n += 1
        time.sleep(every_s)


@pytest.mark.daemon
@pytest.mark.slow
def test_a_claim_area_moved_every_10_ms_fails_no_good_photo(
        root: Path, daemon_factory: Callable[..., DaemonProcess]) -> None:
    """Between a move and the daemon putting its area back, the pipeline reached claimed files
    by name, through the member's link: photos read then failed for good ("cannot open the
    file: .processing is a symbolic link", decode, permanent), a result filed by the commit
    process failed its move to done/ for good (the error lost its kind on the way back), and
    releasing one by name failed too, leaving 27 of 30 stranded in ``.processing`` while the
    daemon ran. Every photo ends once, none failed for good."""
    config = write_config(root, inbox={"settle_ms": 0})
    inbox = root / "inbox"
    shared_inbox(inbox)
    daemon = daemon_factory(config)
    daemon.wait_for("ready")
    attacker = os.fork()
    if attacker == 0:  # the child: never returns into pytest
        as_neighbour(lambda: swap_in_a_loop(inbox, for_s=6))
        os._exit(0)
    sources = photos(root, 30)
    try:
        for source in sources:
            drop_all([source], inbox)
            time.sleep(0.1)  # photos keep coming while the member is at it
    finally:
        os.waitpid(attacker, 0)
    wanted = {sha256_hex(p.read_bytes()) for p in sources}
    wait_until(lambda: wanted <= set(outcome_shas(root)), 30, "30 photos with an outcome")
    ended = outcome_shas(root)
    assert all(len(where) == 1 for where in ended.values()), "a photo ended twice"
    # None may fail for good, and none may be left behind.
    reports = [json.loads(path.read_text()) for path in (root / "failed").rglob("*.json")]
    assert [r["reason"] for r in reports if r["permanent"]] == []
    # The member's last link (to /tmp) may still be at the name for up to a second: a walk
    # through it walked every other test's files.
    wait_until(lambda: not (inbox / ".processing").is_symlink(), 10, "the claim area put back")
    assert not [p for p in (inbox / ".processing").rglob("*.png")], "stranded in .processing"
    # Nor fail at all: a decode worker reopens each claimed file through the daemon's
    # descriptor of it, which no rename reaches (before, it walked the name, met the
    # member's link, and a photo could run out of attempts: an io failure).
    assert [r["reason"] for r in reports] == []
    assert all(where == ["done"] for where in ended.values())
    assert daemon.stop() == 0


@pytest.mark.daemon
@pytest.mark.slow
def test_a_claim_area_moved_every_10_ms_costs_no_decode_an_attempt(
        root: Path, daemon_factory: Callable[..., DaemonProcess]) -> None:
    """With one attempt per photo, any read of a claimed file that the member's moves make
    fail is a photo in failed/ (before: 30 of 40 here, "cannot open the file now:
    .processing is a symbolic link", io). Every photo ends in done/, none in failed/."""
    config = write_config(root, inbox={"settle_ms": 0}, retry={"max_attempts": 1})
    inbox = root / "inbox"
    shared_inbox(inbox)
    daemon = daemon_factory(config)
    daemon.wait_for("ready")
    attacker = os.fork()
    if attacker == 0:  # the child: never returns into pytest
        as_neighbour(lambda: swap_in_a_loop(inbox, for_s=8, every_s=0.002))
        os._exit(0)
    sources = photos(root, 40)
    try:
        for source in sources:
            drop_all([source], inbox)
            time.sleep(0.05)
    finally:
        os.waitpid(attacker, 0)
    wanted = {sha256_hex(p.read_bytes()) for p in sources}
    with contextlib.suppress(WaitTimeout):  # what failed says more than the timeout
        wait_until(lambda: wanted <= set(outcome_shas(root)), 30, "40 photos with an outcome")
    reports = [json.loads(path.read_text()) for path in (root / "failed").rglob("*.json")]
    assert [(r["reason_class"], r["reason"]) for r in reports] == []
    left = [str(p.relative_to(inbox)) for p in inbox.rglob("*.png")]  # where, if not done
    assert {sha: where for sha, where in outcome_shas(root).items() if sha in wanted} == {
        sha: ["done"] for sha in wanted}, (left, daemon.output()[-6000:])
    assert daemon.stop() == 0


def test_an_onnx_whose_memory_follows_pixel_values_is_refused(tmp_path: Path) -> None:
    """The probe (1 and batch.max_size, all zeros) passed this model; at a real photo it asks
    ONNX Runtime for 6.4 GB in the daemon's own process (tuned to just under the machine's
    memory, the OOM killer ends the daemon: the class 7 restart loop again). The probe now
    runs bright and random batches too, under the blank batch's peak plus a bound."""
    from inboxd.config import ConfigError, ModelConfig
    from inboxd.models.onnx_probe import probe_in_child

    bomb = value_shaped_bomb(tmp_path / "bomb.onnx")
    with pytest.raises(ConfigError, match="its memory follows the pixel values"):
        probe_in_child(ModelConfig.model_validate({"onnx": str(bomb)}), [1, 8], timeout_s=120)
