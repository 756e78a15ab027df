"""A member of the inbox's group against the daemon and its commands (issue 33, class 2): links
and guessed names planted in a folder the group can write (the shipped layout: inbox 2770,
group ``inboxd``). Nothing the daemon or its commands create, open, empty or move there may
follow a planted link or land on a guessed name; what is outside the inbox, and in done/, stays
as it was. The attacker runs as another uid in the inbox's group (a forked child that drops to
it), so the kernel's permission checks are the real ones."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import getpass
import os
import resource
import signal
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from inboxd import cli
from inboxd.config import load_config
from inboxd.files import retry_failed as retry
from inboxd.files.lifecycle import Lifecycle
from inboxd.files.reading import read_and_hash
from inboxd.files.safe_paths import LinkedFolder
from inboxd.item import TransientError
from inboxd.pipeline.wiring import Pipeline

from tests.conftest import make_image, write_config
from tests.fakes import FakeModel
from tests.files.test_retry import fail

ROOT = os.geteuid() == 0
NEIGHBOUR_UID = 42_421  # no passwd entry needed: the kernel only checks numbers
GROUP_GID = 42_420  # the inbox's group (`inboxd` in the shipped layout)

pytestmark = pytest.mark.skipif(not ROOT, reason="acting as another uid needs root")


def shared_inbox(inbox: Path) -> None:
    """The shipped layout: inbox 2770, group-owned; the path to it open to the neighbour."""
    inbox.mkdir(parents=True, exist_ok=True)
    os.chown(inbox, 0, GROUP_GID)
    os.chmod(inbox, 0o2770)
    for folder in inbox.parents:  # traversable (not listable) down to it, like /var/lib
        if folder == Path("/"):
            break
        os.chmod(folder, os.stat(folder).st_mode | 0o001)


def as_neighbour(act: Callable[[], None]) -> None:
    """Run ``act`` in a child process as a member of the inbox's group (not its owner)."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            # A pytest session that started meanwhile (another checkout's, as root) made its
            # basetemp's root 0700 again: traversable once more, as shared_inbox left it.
            with contextlib.suppress(OSError):
                basetemp_root = Path(tempfile.gettempdir()) / f"pytest-of-{getpass.getuser()}"
                os.chmod(basetemp_root, os.stat(basetemp_root).st_mode | 0o001)
            os.setgroups([GROUP_GID])
            os.setresgid(GROUP_GID, GROUP_GID, GROUP_GID)
            os.setresuid(NEIGHBOUR_UID, NEIGHBOUR_UID, NEIGHBOUR_UID)
            act()
            code = 0
        except BaseException as exc:  # reported through the exit status
            print(f"neighbour: {exc!r}\n{traceback.format_exc()}", file=sys.stderr)
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the neighbour's own step failed"


@pytest.fixture
def layout(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    config = write_config(tmp_path, inbox={"settle_ms": 0})
    shared_inbox(tmp_path / "inbox")
    outside = tmp_path / "outside"
    outside.mkdir()
    yield config, outside


def test_submit_never_writes_through_a_link_at_a_guessable_temp_name(
        layout: tuple[Path, Path], tmp_path: Path) -> None:
    """``inboxd submit`` wrote to ``.NAME.PID.submit.tmp`` in the inbox: a neighbour who
    plants links at the next PIDs makes it overwrite the link's target (run by root or an
    admin: any file)."""
    _, outside = layout
    inbox = tmp_path / "inbox"
    victim = outside / "victim.conf"
    victim.write_bytes(b"precious")
    photo = make_image(tmp_path / "src" / "photo.png")
    pids = [os.getpid(), *range(os.getpid() + 1, os.getpid() + 50)]

    def plant() -> None:
        for pid in pids:
            os.symlink(victim, inbox / f".photo.png.{pid}.submit.tmp")

    as_neighbour(plant)
    target = cli.submit_file(photo, inbox)
    assert victim.read_bytes() == b"precious"
    assert target == inbox / "photo.png" and target.read_bytes() == photo.read_bytes()
    assert not target.is_symlink()
    # The planted links are the neighbour's: left as they are, none replaced.
    assert sum(1 for p in inbox.iterdir() if p.is_symlink()) == len(pids)


@pytest.mark.slow  # a costly run: `make test`, not the fast tier
def test_a_planted_processing_folder_never_gets_done_emptied(
        layout: tuple[Path, Path], tmp_path: Path) -> None:
    """The group can rename ``.processing`` away and make its own, with ``.tmp/<instance>`` a
    link to done/: the next start emptied the "temp folder", deleting every done file."""
    config_path, _ = layout
    inbox, done = tmp_path / "inbox", tmp_path / "done"
    make_image(inbox / "a.png")
    asyncio.run(Pipeline(load_config(config_path), FakeModel()).process_backlog())  # type: ignore[arg-type]
    assert (done / "a.png").is_file()

    def plant() -> None:
        os.rename(inbox / ".processing", inbox / ".processing-was")
        (inbox / ".processing" / ".tmp").mkdir(parents=True)
        (inbox / ".processing" / ".tmp" / "default").symlink_to(done)

    as_neighbour(plant)
    started = subprocess.run([sys.executable, "-m", "inboxd", "once", "-c", str(config_path)],
                             capture_output=True, text=True, timeout=120)
    assert (done / "a.png").is_file(), "start-up emptied done/ through a planted link"
    # Not a reason to stop (issue 36): theirs is renamed aside, untouched, and ours made again.
    assert started.returncode == 0, started.stderr[-2000:]
    assert f"uid {NEIGHBOUR_UID}" in started.stderr
    [aside] = [p for p in inbox.iterdir() if p.name.startswith(".processing.foreign-")]
    assert (aside / ".tmp" / "default").resolve() == done.resolve()
    assert os.stat(inbox / ".processing").st_uid == os.geteuid()
    Lifecycle(load_config(config_path)).prepare()
    assert (done / "a.png").is_file()


def test_a_processing_folder_swapped_while_running_takes_no_claim_outside(
        layout: tuple[Path, Path], tmp_path: Path) -> None:
    """Swapped after start-up, with ``<instance>`` a link to a folder outside: a claim must not
    rename the file through it."""
    config_path, outside = layout
    inbox = tmp_path / "inbox"
    os.chown(outside, NEIGHBOUR_UID, GROUP_GID)
    lifecycle = Lifecycle(load_config(config_path))
    lifecycle.lock_instance()
    lifecycle.prepare()
    (inbox / "x.png").write_bytes(b"a group member's photo")

    def plant() -> None:
        os.rename(inbox / ".processing", inbox / ".processing-was")
        (inbox / ".processing").mkdir()
        (inbox / ".processing" / "default").symlink_to(outside)

    as_neighbour(plant)
    claimed = lifecycle.claim(inbox, "x.png")  # into a fresh folder of ours (issue 36)
    lifecycle.unlock_instance()
    assert list(outside.iterdir()) == []
    assert claimed is not None and Path(claimed).read_bytes() == b"a group member's photo"
    assert os.stat(Path(claimed).parent).st_uid == os.geteuid()


def test_retry_does_not_follow_a_folder_replaced_by_a_link(
        layout: tuple[Path, Path], tmp_path: Path) -> None:
    """``retry`` followed a sub-folder of the inbox replaced by a link, and moved the failed
    file outside the inbox."""
    config_path, outside = layout
    config = load_config(config_path)
    failed = fail(config, "sub/x.jpg", b"failed bytes", "not an image", "decode")
    os.chown(outside, NEIGHBOUR_UID, GROUP_GID)
    as_neighbour(lambda: (tmp_path / "inbox" / "sub").symlink_to(outside))
    [chosen], _ = retry.select(config, [], True, None)
    with pytest.raises(LinkedFolder):
        retry.retry(config, chosen)
    assert list(outside.iterdir()) == []
    assert failed.read_bytes() == b"failed bytes"
    assert Path(f"{failed}.error.json").exists()  # still failed, with its report


def fill(folder: Path, size: str) -> None:
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                   check=True)


@contextlib.contextmanager
def small_inbox(tmp_path: Path) -> Iterator[Path]:
    inbox = tmp_path / "small"
    inbox.mkdir()
    fill(inbox, "256k")
    try:
        yield inbox
    finally:
        subprocess.run(["umount", "-l", str(inbox)], check=False)


def big_photo(tmp_path: Path) -> Path:
    path = tmp_path / "src" / "big.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(os.urandom(1 << 20))
    return path


def test_submit_into_a_full_inbox_leaves_nothing_behind(tmp_path: Path) -> None:
    """A full inbox left a hidden 1 MiB temp there for ever."""
    with small_inbox(tmp_path) as inbox:
        with pytest.raises(OSError) as raised:
            cli.submit_file(big_photo(tmp_path), inbox)
        assert raised.value.errno == errno.ENOSPC
        assert os.listdir(inbox) == []
        assert os.statvfs(inbox).f_bfree == os.statvfs(inbox).f_blocks  # space given back


def test_submit_without_unnamed_files_cleans_its_temp_on_every_failure(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the filesystem has no O_TMPFILE, the named temp is removed on a full disk and on
    a file-size limit (as a quota would stop it) alike."""
    real_open = os.open

    def no_tmpfile(path: str, flags: int, *args: object, **kwargs: object) -> int:
        if flags & os.O_TMPFILE == os.O_TMPFILE:
            raise OSError(errno.EOPNOTSUPP, "not supported here")
        return real_open(path, flags, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", no_tmpfile)
    with small_inbox(tmp_path) as inbox:
        with pytest.raises(OSError):
            cli.submit_file(big_photo(tmp_path), inbox)
        assert os.listdir(inbox) == []
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG, not a kill
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, hard))
    try:
        with pytest.raises(OSError) as raised:
            cli.submit_file(big_photo(tmp_path), inbox)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
    assert raised.value.errno == errno.EFBIG
    assert os.listdir(inbox) == []


def test_a_foreign_processing_folder_is_moved_aside_not_a_reason_to_stop(
        layout: tuple[Path, Path], tmp_path: Path) -> None:
    """It stopped every start with exit 78 (issue 36): a member could stop the service."""
    config_path, _ = layout
    inbox = tmp_path / "inbox"
    as_neighbour(lambda: (inbox / ".processing").mkdir())
    lifecycle = Lifecycle(load_config(config_path))
    lifecycle.lock_instance()
    lifecycle.unlock_instance()
    assert os.stat(inbox / ".processing").st_uid == os.geteuid()
    [aside] = [p for p in inbox.iterdir() if p.name.startswith(".processing.foreign-")]
    assert aside.name.startswith(f".processing.foreign-uid{NEIGHBOUR_UID}")


def test_a_claimed_file_is_never_read_through_a_swapped_processing_folder(
        layout: tuple[Path, Path], tmp_path: Path) -> None:
    """Claimed, then ``.processing`` swapped for the neighbour's with ``<instance>`` a link to
    their own folder holding a file of the same name: read by path, the decode would read
    (and file a result of) the neighbour's bytes for this file's name."""
    config_path, outside = layout
    inbox = tmp_path / "inbox"
    lifecycle = Lifecycle(load_config(config_path))
    lifecycle.lock_instance()
    (inbox / "x.png").write_bytes(b"the real photo")
    claimed = lifecycle.claim(inbox, "x.png")
    assert claimed is not None
    os.chown(outside, NEIGHBOUR_UID, GROUP_GID)

    def plant() -> None:
        (outside / "x.png").write_bytes(b"the neighbour's bytes")
        os.rename(inbox / ".processing", inbox / ".processing-was")
        (inbox / ".processing").mkdir()
        (inbox / ".processing" / "default").symlink_to(outside)

    as_neighbour(plant)
    with pytest.raises(TransientError):
        read_and_hash(claimed)
    lifecycle.unlock_instance()
    assert (inbox / ".processing-was" / "default" / "x.png").read_bytes() == b"the real photo"
