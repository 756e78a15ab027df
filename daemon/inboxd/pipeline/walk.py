"""Walking inbox folders, and every name found there that is not taken, said once.

Used by the watcher's scans and by the walk of a folder that has just arrived. A name the
daemon will not take (no include pattern matches, hidden, a format this build cannot decode) is
logged once per path with what to do and counted as ignored; OS litter (``.DS_Store``,
``Thumbs.db``, ``@eaDir/``, …) and temp names pass without a word.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from inboxd import logs
from inboxd.files.names import NameFilter, folder_skipped
from inboxd.pipeline.skipped import SkippedPaths
from inboxd.stats import Stats


class Walker:
    def __init__(self, names: NameFilter, recursive: bool, stats: Stats) -> None:
        self.names = names
        self.recursive = recursive
        self.stats = stats
        self.skipped = SkippedPaths()  # bounded: a name forgotten is at worst said again

    def walk(self, folder: str | Path, report: bool = True) -> Iterator[str]:
        """Wanted files under ``folder``, lazily: a scan that stops early reads no further.
        Names not taken are said once each (``report``); hidden and litter folders are not
        entered. Paths are strs: a Path per file would intern every name."""
        stack = [os.fspath(folder)]
        while stack:
            current = stack.pop()
            try:
                with os.scandir(current) as entries:
                    for entry in entries:
                        if entry.is_dir(follow_symlinks=False):
                            if self.recursive and not folder_skipped(entry.name):
                                stack.append(entry.path)
                        elif self.names.wanted(entry.name):
                            yield entry.path
                        elif report:
                            self.refuse(entry.path)
            except OSError as exc:  # gone, not a folder, no permission, a path too long
                logs.emit(logging.WARNING, "scan_error", f"cannot scan {current}: {exc}",
                          path=str(current))

    def refuse(self, path: str) -> None:
        """A name the daemon will not take: said once with what to do, counted as ignored."""
        reason = self.names.refusal(os.path.basename(path))
        if reason is not None and self.skipped.note(path, reason):
            self.stats.counters.ignored += 1
            self.stats.counters.ignored_names += 1

    def folder_arrived(self, path: str) -> bool:
        """An event for a name we do not take: True for a folder to walk now (inotify reports
        a folder moved or copied in, not the files it already holds); a file is refused."""
        try:
            st = os.lstat(path)
        except OSError:
            return False  # gone again
        if stat.S_ISDIR(st.st_mode):
            return self.recursive and not folder_skipped(os.path.basename(path))
        if stat.S_ISREG(st.st_mode):
            self.refuse(path)
        return False
