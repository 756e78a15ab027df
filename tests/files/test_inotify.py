"""The inotify tree watch (``files/inotify.py``) against the real kernel: names that are not
UTF-8, folders made, moved in and moved out, hidden folders never watched."""

from __future__ import annotations

import os
from pathlib import Path

from inboxd.files.inotify import ADDED, DELETED, TreeWatch
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
