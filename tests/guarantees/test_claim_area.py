"""A member of the inbox's group against the daemon's claim area (issue 36, class 2): the inbox
is 2770, so a member can rename ``<inbox>/.processing`` away and make a folder of their own in
its place. Nothing they do to names in the inbox may stop the pipeline or hide a claimed photo:
photos dropped afterwards are done, photos in flight each end exactly once, nothing stays in
the renamed folder, and a restart starts (not exit 78). The attacker is a forked child with
another uid in the inbox's group (``test_planted_links``), so the kernel's checks are real."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from inboxd.config import load_config
from inboxd.files.lifecycle import Lifecycle
from inboxd.files.takeover import take_over_dead

from support.harness import sha256_hex
from support.waiting import wait_until
from tests.conftest import DaemonProcess, make_image, write_config
from tests.guarantees.test_planted_links import NEIGHBOUR_UID, as_neighbour, shared_inbox

ROOT = os.geteuid() == 0
pytestmark = pytest.mark.skipif(not ROOT, reason="acting as another uid needs root")




def photos(tmp_path: Path, count: int, tag: int = 0) -> list[Path]:
    """``count`` small photos, each of its own bytes, outside the inbox."""
    return [make_image(tmp_path / "src" / f"p{tag}-{n}.png", color=(n % 256, n // 256, tag))
            for n in range(count)]


def drop_all(sources: list[Path], inbox: Path) -> None:
    for source in sources:
        tmp = inbox / f".{source.name}.part"
        tmp.write_bytes(source.read_bytes())
        os.rename(tmp, inbox / source.name)


def outcome_shas(root: Path) -> dict[str, list[str]]:
    """sha256 → where it ended (done/ or failed/), every regular file in both."""
    found: dict[str, list[str]] = {}
    for where in ("done", "failed"):
        for path in (root / where).rglob("*"):
            if path.is_file() and not path.name.endswith(".json") \
                    and ".tmp" not in path.parts:
                found.setdefault(sha256_hex(path.read_bytes()), []).append(where)
    return found


def swap_processing(inbox: Path, away: str = ".processing-was") -> Callable[[], None]:
    def swap() -> None:
        os.rename(inbox / ".processing", inbox / away)
        (inbox / ".processing").mkdir()
    return swap


@pytest.mark.daemon
@pytest.mark.slow
def test_a_swapped_processing_folder_does_not_stop_the_pipeline(
        root: Path, daemon_factory: Callable[..., DaemonProcess]) -> None:
    """Renamed away and replaced by the member's own folder: photos dropped afterwards were
    never done (the claims landed nowhere) and the restart exited 78."""
    config = write_config(root, inbox={"settle_ms": 0})
    inbox = root / "inbox"
    shared_inbox(inbox)
    daemon = daemon_factory(config)
    daemon.wait_for("ready")
    as_neighbour(swap_processing(inbox))
    sources = photos(root, 10)
    drop_all(sources, inbox)
    wanted = {sha256_hex(p.read_bytes()) for p in sources}
    wait_until(lambda: wanted <= set(outcome_shas(root)), 20, "10 photos done")
    assert all(where == ["done"] for where in outcome_shas(root).values())
    moved = daemon.records("claim_area_moved")
    assert moved and f"uid {NEIGHBOUR_UID}" in moved[0], daemon.output()[-3000:]
    assert (inbox / ".processing-was").is_dir()  # the member's folders: left where they are
    assert daemon.stop() == 0

    # Stopped, the member does it again: the restart starts, and works.
    as_neighbour(swap_processing(inbox, ".processing-again"))
    again = daemon_factory(config)
    again.wait_for("ready")
    more = photos(root, 3, tag=1)
    drop_all(more, inbox)
    wanted |= {sha256_hex(p.read_bytes()) for p in more}
    wait_until(lambda: wanted <= set(outcome_shas(root)), 20, "3 more photos done")
    assert os.stat(inbox / ".processing").st_uid == os.geteuid()
    assert again.stop() == 0


def result_shas(root: Path) -> collections.Counter[str]:
    return collections.Counter(json.loads(path.read_text()).get("sha256")
                               for path in (root / "results").rglob("*.json")
                               if ".tmp" not in path.parts)


@pytest.mark.daemon
@pytest.mark.slow
@pytest.mark.parametrize("away", [".processing-was", "stolen"])
def test_a_rename_away_while_photos_are_in_flight_loses_and_doubles_none(
        root: Path, daemon_factory: Callable[..., DaemonProcess], away: str) -> None:
    """``.processing`` renamed away while ~80 photos are claimed: to a hidden name, 14 of them
    stayed in the renamed folder for good, 10 with their results written; to a name the scan
    sees, they were claimed again from there as new photos under another name."""
    config = write_config(root, inbox={"settle_ms": 0},
                          capacity={"queue": 96, "event_buffer": 256})
    inbox = root / "inbox"
    shared_inbox(inbox)
    daemon = daemon_factory(config)
    daemon.wait_for("ready")
    sources = photos(root, 80)
    claimed = inbox / ".processing" / "default"
    drop_all(sources, inbox)
    wait_until(lambda: len(os.listdir(claimed)) >= 30, 30, "30 photos claimed")
    as_neighbour(lambda: os.rename(inbox / ".processing", inbox / away))
    wanted = {sha256_hex(p.read_bytes()) for p in sources}
    wait_until(lambda: wanted <= set(outcome_shas(root)), 60, "80 photos with an outcome")
    ended = outcome_shas(root)
    assert {digest: where for digest, where in ended.items() if where != ["done"]} == {}
    assert set(ended) == wanted
    assert result_shas(root) == collections.Counter(wanted), "a photo has two results"
    left = [p for p in (inbox / away).rglob("*") if p.is_file() and p.suffix == ".png"]
    assert left == [], "claimed photos left in the renamed folder"
    assert daemon.records("claim_area_moved")
    assert daemon.stop() == 0
    assert not [p for p in (inbox / ".processing").rglob("*.png")]


def test_files_in_an_area_renamed_away_before_a_kill_come_back(root: Path) -> None:
    """The daemon died before it noticed: its area is in the inbox under another name. A
    restart's takeover and ``inboxd recover`` both return what it held."""
    config_path = write_config(root, inbox={"settle_ms": 0})
    inbox = root / "inbox"
    shared_inbox(inbox)
    dead = Lifecycle(load_config(config_path))
    dead.lock_instance()
    for name in ("a.png", "b.png"):
        (inbox / name).write_bytes(name.encode())
        assert dead.claim(inbox, name) is not None
    as_neighbour(swap_processing(inbox))
    dead.unlock_instance()  # killed: the kernel drops its lock, nothing else happens

    recovered = subprocess.run([sys.executable, "-m", "inboxd", "recover", "-c",
                                str(config_path)], capture_output=True, text=True, timeout=120)
    assert recovered.returncode == 0, recovered.stderr[-2000:]
    assert "returned 2 file(s)" in recovered.stdout
    assert (inbox / "a.png").read_bytes() == b"a.png"
    assert (inbox / "b.png").read_bytes() == b"b.png"
    assert not list((inbox / ".processing-was").rglob("*.png"))

    # The same from another instance's takeover sweep.
    dead.lock_instance()
    assert dead.claim(inbox, "a.png") is not None
    as_neighbour(swap_processing(inbox, ".processing-twice"))
    dead.unlock_instance()
    other = Lifecycle(load_config(config_path).model_copy(update={"instance": "other"}))
    other.lock_instance()
    try:
        sweep = take_over_dead(other)
    finally:
        other.unlock_instance()
    assert [t.returned for t in sweep.taken] == [["a.png"]]
    assert (inbox / "a.png").read_bytes() == b"a.png"


def test_a_claim_after_a_swap_lands_in_a_fresh_area_and_paths_in_flight_lead_home(
        root: Path) -> None:
    config_path = write_config(root, inbox={"settle_ms": 0})
    inbox = root / "inbox"
    shared_inbox(inbox)
    lifecycle = Lifecycle(load_config(config_path))
    lifecycle.lock_instance()
    try:
        (inbox / "first.png").write_bytes(b"first")
        first = lifecycle.claim(inbox, "first.png")
        assert first is not None
        as_neighbour(swap_processing(inbox))
        (inbox / "second.png").write_bytes(b"second")
        second = lifecycle.claim(inbox, "second.png")
        assert second is not None
        # Both claimed paths lead to their files, in the daemon's own fresh folder.
        assert Path(first).read_bytes() == b"first" and Path(second).read_bytes() == b"second"
        assert os.stat(inbox / ".processing").st_uid == os.geteuid()
        assert not list((inbox / ".processing-was").rglob("*.png"))
        aside = [p for p in inbox.iterdir() if p.name.startswith(".processing.foreign-")]
        assert [os.stat(p).st_uid for p in aside] == [NEIGHBOUR_UID]
        assert lifecycle.release(first, inbox / "first.png") is not None
    finally:
        lifecycle.unlock_instance()


def test_instances_sharing_an_inbox_each_take_their_own_files_back(root: Path) -> None:
    """One instance puts the area back; the other joins the fresh one (the daemon's own, with
    its own lock in it) instead of moving it aside in turn, and takes its own files back."""
    config = load_config(write_config(root, inbox={"settle_ms": 0}))
    inbox = root / "inbox"
    shared_inbox(inbox)
    a = Lifecycle(config.model_copy(update={"instance": "a"}))
    b = Lifecycle(config.model_copy(update={"instance": "b"}))
    a.lock_instance()
    b.lock_instance()
    try:
        claimed = {}
        for who, lifecycle in (("a", a), ("b", b)):
            (inbox / f"{who}.png").write_bytes(who.encode())
            claimed[who] = lifecycle.claim(inbox, f"{who}.png")
        as_neighbour(swap_processing(inbox))
        assert a.ensure_claim_areas() == 1
        assert b.ensure_claim_areas() == 1
        for who, path in claimed.items():
            assert path is not None and Path(path).read_bytes() == who.encode()
        aside = [p for p in inbox.iterdir() if p.name.startswith(".processing.foreign-")]
        assert len(aside) == 1, "the fresh area of one instance was moved aside by the other"
        assert sorted(p.name for p in (inbox / ".processing").iterdir()
                      if p.name.endswith(".lock")) == ["a.lock", "b.lock"]
        assert not list((inbox / ".processing-was").rglob("*.png"))
    finally:
        a.unlock_instance()
        b.unlock_instance()


def test_an_entry_filed_while_the_area_is_put_back_does_not_stop_the_put_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The commit process files a claimed photo by name while the daemon puts its area back:
    the entry listed is gone when its turn comes. The put-back stopped there (the rest of the
    claimed files left in the moved folder, stranded while the daemon ran) and kept the fresh
    area's lock on a descriptor nobody closed, so every later put-back failed (seen under a
    2 ms move storm: "cannot be made again now: FileNotFoundError"). Now the gone entry is
    skipped and the rest taken back."""
    from inboxd.files import claim_area

    inbox = tmp_path / "inbox"
    inbox.mkdir()
    held, _ = claim_area.open_area(inbox, "default")
    for name in ("a.png", "c.png"):
        (inbox / ".processing" / "default" / name).write_bytes(name.encode())
    os.rename(inbox / ".processing", inbox / ".moved")
    real_listdir = os.listdir

    def listed_with_a_filed_one(folder: int) -> list[str]:  # the race, made certain
        return [*real_listdir(folder), "b.png"]

    monkeypatch.setattr(claim_area.os, "listdir", listed_with_a_filed_one)
    fresh, report = claim_area.put_back(inbox, "default", held)
    monkeypatch.undo()
    assert report is not None and report.taken_back == 2
    assert sorted(os.listdir(inbox / ".processing" / "default")) == ["a.png", "c.png"]
    os.rename(inbox / ".processing", inbox / ".moved2")  # and the next put-back works
    again, report = claim_area.put_back(inbox, "default", fresh)
    assert report is not None and report.taken_back == 2
    again.close()
