"""The crash ledger: which claimed files were in flight when a stage crashed, counted in a row,
so that one file cannot crash-loop the service (``Lifecycle.recover`` fails a file at
``CRASHES_BEFORE_FAILING``). One ``<instance>.crashes.json`` per instance beside its claim area
(``files.instances`` reads them all); a kill leaves no record and counts nothing."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Collection
from pathlib import Path
from typing import Any

from inboxd.config import Config
from inboxd.files import instances
from inboxd.files.durable import create_excl, json_bytes, tmp_name, walk_files
from inboxd.files.instances import LEDGER_SUFFIX
from inboxd.files.layout import PROCESSING_DIRNAME, TMP_DIRNAME, processing_dir
from inboxd.files.safe_paths import open_inside

# A file in flight at this many stage crashes in a row is failed instead of retried.
CRASHES_BEFORE_FAILING = 2


class CrashLedger:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.max_file_bytes = config.preprocess.max_file_mb * 2**20

    def path(self, inbox: Path, instance: str | None = None) -> Path:
        name = instance or self.config.instance
        return processing_dir(self.config, inbox).parent / f"{name}{LEDGER_SUFFIX}"

    def counts(self, inbox: Path) -> list[instances.Ledger]:
        """Every instance's ledger here, for ``crashes_of``: a count follows its file."""
        return instances.all_ledgers(inbox)

    def record(self, reason: str, inside: Collection[str] | None = None) -> None:
        """A stage crashed: count one crash against each file that was inside it (``inside``:
        their claimed paths; None when the stage cannot say, then every file claimed now),
        keep the counts of the other claimed files as they were, and forget the files that
        are no longer claimed (the count is of crashes in a row, bounded by what can be in
        flight). A kill leaves no record and counts nothing: it is not the file's doing. The
        next start-up reads this in ``recover``."""
        for inbox in self.config.inbox.paths:
            processing = processing_dir(self.config, inbox)
            ledgers = self.counts(inbox)
            updated: dict[str, list[object]] = {}
            for claimed in walk_files(processing):  # the bytes too: a name is often reused
                rel = claimed.relative_to(processing).as_posix()
                sha256 = instances.file_sha256(claimed, self.max_file_bytes)
                crashes, why = instances.crashes_of(ledgers, rel, sha256)
                if inside is None or os.path.normpath(claimed) in inside:
                    crashes, why = crashes + 1, reason
                if crashes:
                    updated[rel] = [crashes, why, sha256]
            self.write(inbox, self.config.instance, updated)

    def write(self, inbox: Path, instance: str, entries: dict[str, Any]) -> None:
        """Replace ``instance``'s ledger (ours, or a dead one's while we hold its lock)."""
        ledger = self.path(inbox, instance).name
        with open_inside(inbox, [PROCESSING_DIRNAME], own=True) as processing:
            if not entries and instance != self.config.instance:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(ledger, dir_fd=processing)
                return
            with open_inside(processing, [TMP_DIRNAME, self.config.instance], create=True,
                             own=True) as tmp_dir:
                tmp = tmp_name("", ".crashes")
                try:
                    with os.fdopen(create_excl(tmp, tmp_dir), "wb") as handle:
                        handle.write(json_bytes(entries))
                        handle.flush()
                        os.fsync(handle.fileno())
                    os.replace(tmp, ledger, src_dir_fd=tmp_dir, dst_dir_fd=processing)
                except BaseException:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(tmp, dir_fd=tmp_dir)
                    raise
