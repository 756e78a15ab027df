"""A shared machine: the inbox belongs to a group (2770, group ``inboxd``), and other local
users are around. What a neighbour can see or do must stay what the README's threat model says:
a private photo stays private on its way to done/ and in its result, an idle connection flood
on ``metrics.listen`` cannot stop the pipeline, a file held open does not make the daemon spin,
and records a neighbour writes to the journal or names they choose never pass for the daemon's.
Real mounts, real processes, other uids (as root; each test skips with its reason otherwise).
"""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from inboxd.config import load_config
from inboxd.pipeline.wiring import Pipeline

from tests.conftest import make_image, read_json, write_config
from tests.fakes import FakeModel

needs_root = pytest.mark.skipif(os.geteuid() != 0,
                                reason="mounts, other owners and other uids need root")
NEIGHBOUR_UID = NEIGHBOUR_GID = 65534  # nobody/nogroup: a local user who is not the daemon
OWNER_UID, OWNER_GID = 4242, 4343  # the photo's owner (no passwd entry needed)


@contextmanager
def tmpfs(target: Path) -> Iterator[Path]:
    target.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m,mode=0755", "tmpfs", str(target)],
                   check=True)
    try:
        yield target
    finally:
        subprocess.run(["umount", "-l", str(target)], check=False)


def set_xattr(path: Path) -> str | None:
    """A user xattr where the filesystem takes one (tmpfs does since Linux 6.6), else a
    trusted one (root on tmpfs); the name set, or None."""
    for name in ("user.inboxd_test", "trusted.inboxd_test"):
        try:
            os.setxattr(path, name, b"kept")
        except OSError:
            continue
        return name
    return None


# -- class 3: permissions lost on the way -----------------------------------------------------


@needs_root
def test_a_move_to_another_filesystem_keeps_mode_owner_times_and_xattrs(tmp_path: Path) -> None:
    """done/ and failed/ on a tmpfs of their own: the cross-filesystem copy. A 0600 photo of
    another user stays 0600 and theirs, with its mtime and xattrs, in done/ and in failed/;
    its result and error report are no more readable than it (never 0640 for the group)."""
    with tmpfs(tmp_path / "other") as other:
        config = load_config(write_config(
            tmp_path, inbox={"settle_ms": 0}, done_dir=str(other / "done"),
            failed_dir=str(other / "failed")))
        inbox = config.inbox.paths[0]
        good = make_image(inbox / "private.png", size=(8, 8))
        bad = inbox / "broken.png"
        bad.write_bytes(b"not an image")
        shared = make_image(inbox / "shared.png", size=(8, 8), color=(1, 2, 3))
        mtime_ns = 1_600_000_000_123_456_789
        xattrs = {}
        for path, mode in ((good, 0o600), (bad, 0o600), (shared, 0o644)):
            os.chown(path, OWNER_UID, OWNER_GID)
            os.chmod(path, mode)
            os.utime(path, ns=(mtime_ns, mtime_ns))
            xattrs[path.name] = set_xattr(path)
        pipeline = Pipeline(config, FakeModel())  # type: ignore[arg-type]
        asyncio.run(pipeline.process_backlog())

        for moved, mode in ((other / "done" / "private.png", 0o600),
                            (other / "failed" / "broken.png", 0o600),
                            (other / "done" / "shared.png", 0o644)):
            st = moved.lstat()
            assert stat.S_IMODE(st.st_mode) == mode, (moved, oct(st.st_mode))
            assert (st.st_uid, st.st_gid) == (OWNER_UID, OWNER_GID), moved
            assert st.st_mtime_ns == mtime_ns, moved
            name = xattrs[moved.name]
            if name is not None:
                assert os.getxattr(moved, name) == b"kept", moved
        # What the daemon writes about a private photo is private too; a shared one's is not.
        for written in (tmp_path / "results" / "private.png.json",
                        other / "failed" / "broken.png.error.json"):
            assert stat.S_IMODE(written.stat().st_mode) & 0o077 == 0, (
                written, oct(written.stat().st_mode))
        assert stat.S_IMODE((tmp_path / "results" / "shared.png.json").stat().st_mode) & 0o044
        assert read_json(tmp_path / "results" / "private.png.json")["source"] == "private.png"
        # Nothing readable by others was left on the way.
        assert not [p for p in other.rglob("*.tmp") if p.is_file()]
