"""The second attack on issue 36's fixes (the claim area put back after a member of the inbox's
group moves ``.processing``): what a member can still do with two renames in a loop. The
attacker is a forked child with another uid in the inbox's group (``test_planted_links``)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from inboxd.config import load_config
from inboxd.files.lifecycle import Lifecycle
from inboxd.files.takeover import take_over_dead

from tests.conftest import write_config
from tests.guarantees.test_planted_links import NEIGHBOUR_UID, as_neighbour, shared_inbox

ROOT = os.geteuid() == 0
pytestmark = pytest.mark.skipif(not ROOT, reason="acting as another uid needs root")
SWAPS = 30


@pytest.fixture
def root() -> Iterator[Path]:
    folder = Path(tempfile.mkdtemp(prefix="inboxd-attacks-36b-"))
    os.chmod(folder, 0o701)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


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
