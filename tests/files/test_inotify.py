"""The inotify tree watch (``files/inotify.py``) against the real kernel: names that are not
UTF-8, folders made, moved in and moved out, hidden folders never watched; floods past one
read and past the kernel's queue, a watched folder replaced."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from inboxd.files.inotify import (
    ADDED,
    DELETED,
    MAX_CHANGES_PER_READ,
    QueueOverflow,
    TreeWatch,
    WatchedFolderGone,
)
from inboxd.files.names import folder_skipped

from support.waiting import wait_until


def gathered(watch: TreeWatch, wanted: set[tuple[int, str]]) -> set[tuple[int, str]]:
    seen: set[tuple[int, str]] = set()

    def all_seen() -> bool:
        seen.update(watch.read())
        return wanted <= seen

    wait_until(all_seen, 5, f"{wanted}")
    return seen


def test_a_name_that_is_not_utf8_is_a_name_like_any_other(tmp_path: Path) -> None:
    watch = TreeWatch([str(tmp_path)], True, folder_skipped)
    try:
        odd = os.fsencode(tmp_path) + b"/\xff\xfe.jpg"
        with open(odd, "wb"):
            pass
        os.rename(odd, odd + b"2")
        named = os.fsdecode(odd)
        gathered(watch, {(ADDED, named), (DELETED, named), (ADDED, named + "2")})
    finally:
        watch.close()


def test_folders_made_and_moved_in_are_watched_and_moved_out_forgotten(tmp_path: Path) -> None:
    inbox, away = tmp_path / "inbox", tmp_path / "away"
    inbox.mkdir()
    away.mkdir()
    (inbox / ".processing" / "default").mkdir(parents=True)
    watch = TreeWatch([str(inbox)], True, folder_skipped)
    try:
        assert watch.size == 1  # hidden folders (.processing among them) are never watched
        (inbox / "new" / "deeper").mkdir(parents=True)
        gathered(watch, {(ADDED, f"{inbox}/new")})
        (inbox / "new" / "deeper" / "a.jpg").write_bytes(b"a")
        gathered(watch, {(ADDED, f"{inbox}/new/deeper/a.jpg")})
        (away / "moved" / "sub").mkdir(parents=True)
        os.rename(away / "moved", inbox / "moved")
        gathered(watch, {(ADDED, f"{inbox}/moved")})
        (inbox / "moved" / "sub" / "b.jpg").write_bytes(b"b")
        gathered(watch, {(ADDED, f"{inbox}/moved/sub/b.jpg")})
        os.rename(inbox / "new", away / "new")
        gathered(watch, {(DELETED, f"{inbox}/new")})
        (away / "new" / "deeper" / "c.jpg").write_bytes(b"c")
        (inbox / "marker.jpg").write_bytes(b"m")
        seen = gathered(watch, {(ADDED, f"{inbox}/marker.jpg")})
        assert not [path for _, path in seen if path.endswith("c.jpg")], "a folder moved out"
        assert watch.size == 3  # inbox, moved, moved/sub
    finally:
        watch.close()


# -- floods: more events than one read, than the kernel's queue; a watched folder replaced ---


def max_queued_events() -> int:
    return int(Path("/proc/sys/fs/inotify/max_queued_events").read_text())


def make_files(folder: Path, count: int, tag: str = "f") -> set[str]:
    """``count`` empty files: two events each (IN_CREATE, IN_CLOSE_WRITE)."""
    names = set()
    for n in range(count):
        fd = os.open(folder / f"{tag}{n:06}.jpg", os.O_WRONLY | os.O_CREAT, 0o644)
        os.close(fd)
        names.add(f"{folder}/{tag}{n:06}.jpg")
    return names


def test_one_read_hands_over_a_bounded_share_of_a_flood(tmp_path: Path) -> None:
    """A read took every event queued, reading until the queue was empty: under a writer as
    fast as the parse (any member of the group) it never returned, the event loop with it,
    and its set grew with the flood. Each read now hands over at most MAX_CHANGES_PER_READ;
    what stays queued is the kernel's (bounded: an overflow means a rescan)."""
    count = min(6000, max_queued_events() // 2 - 100)
    assert count > MAX_CHANGES_PER_READ, "the flood is more than one read"
    watch = TreeWatch([str(tmp_path)], True, folder_skipped)
    try:
        names = make_files(tmp_path, count)
        seen: set[str] = set()
        reads = 0
        while True:
            changes = watch.read()
            if not changes:
                break
            assert len(changes) <= MAX_CHANGES_PER_READ
            seen.update(path for change, path in changes if change == ADDED)
            reads += 1
        assert seen == names, "every file handed over, over several reads"
        assert reads > 1
    finally:
        watch.close()


def test_a_queue_overflow_is_raised_for_a_rescan(tmp_path: Path) -> None:
    """More events than the kernel queues (fs.inotify.max_queued_events): they are lost, and
    the reader says so (the watcher rescans) instead of handing over a partial picture."""
    watch = TreeWatch([str(tmp_path)], True, folder_skipped)
    try:
        make_files(tmp_path, max_queued_events() // 2 + 100)
        with pytest.raises(QueueOverflow):
            for _ in range(max_queued_events()):  # every read until the overflow event
                watch.read()
    finally:
        watch.close()


@pytest.mark.parametrize("how", ["moved", "deleted"])
def test_a_watched_root_replaced_is_said_for_a_new_watch(tmp_path: Path, how: str) -> None:
    """An inbox moved away (or deleted) and made again is another folder: the watch on the old
    one sees nothing of the new. The reader said nothing, and photos in the new inbox waited
    for the rescan timer; now it raises, and the watcher watches the new one and rescans."""
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    watch = TreeWatch([str(inbox)], True, folder_skipped)
    try:
        if how == "moved":
            os.rename(inbox, tmp_path / "inbox.old")
        else:
            inbox.rmdir()
        inbox.mkdir()
        with pytest.raises(WatchedFolderGone, match=str(inbox)):
            wait_until(watch.read, 5, "an event")
    finally:
        watch.close()


def test_a_subfolder_replaced_is_watched_again(tmp_path: Path) -> None:
    """A folder below the inbox moved away and another made (or moved) in its place: the new
    one is watched, the old one forgotten, whatever the order the events come in."""
    inbox, away = tmp_path / "inbox", tmp_path / "away"
    (inbox / "album").mkdir(parents=True)
    away.mkdir()
    watch = TreeWatch([str(inbox)], True, folder_skipped)
    try:
        for n in range(20):  # quicker than the reader: it sees the whole dance at once
            os.rename(inbox / "album", away / f"album{n}")
            (inbox / "album").mkdir()
        # What the new folder held before it was watched is the watcher's walk to find: the
        # reader says the folder arrived.
        gathered(watch, {(ADDED, f"{inbox}/album")})
        while watch.read():
            pass  # the rest of the dance
        (inbox / "album" / "a.jpg").write_bytes(b"a")
        seen = gathered(watch, {(ADDED, f"{inbox}/album/a.jpg")})
        (away / "album19" / "old.jpg").write_bytes(b"o")
        (inbox / "album" / "b.jpg").write_bytes(b"b")
        seen = gathered(watch, {(ADDED, f"{inbox}/album/b.jpg")})
        assert not [path for _, path in seen if path.endswith("old.jpg")]
        assert watch.size == 2  # inbox, album
    finally:
        watch.close()
