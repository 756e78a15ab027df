"""A batch's commit as one call: every result filed durably (``ResultFiles.write``, the group
commit), then every source moved on (``Lifecycle.finish_success``), in that order.

The daemon runs it in its commit process (``files/commit_process.py``), so what crosses the pipe
is data: each result's JSON as a dict, not the callable the result writer would build it with.
Two of its fields depend on the name the result ends up filed under (another file's result
may hold the plain name), and ``filed_document`` sets them once the name is known.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path, PurePath
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from inboxd.config import Config
from inboxd.files.durable import output_mode
from inboxd.files.index import ResultIndex
from inboxd.files.index_rows import IndexRow, row_of
from inboxd.files.lifecycle import Lifecycle
from inboxd.files.results import ResultEntry, ResultFiles
from inboxd.files.safe_paths import ForeignFolder
from inboxd.files.xmp import Sidecars


@dataclass(frozen=True, slots=True)
class CommitEntry:
    key: str
    sha256: str
    document: dict[str, Any]  # the result JSON as filed under ``key`` itself
    claimed: str  # the source, in our processing folder
    inbox_path: str  # where it came from (after_success: keep puts it back there)
    vector: npt.NDArray[np.float32] | None = None  # an embedding's, filed beside its JSON


@dataclass(slots=True)
class Committed:
    """What came of a batch: either ``error`` (no result was written: a full or read-only
    results disk) or, per entry, the name its result is filed under, whether that result was
    there already (the same bytes, filed earlier), and why its source could not move (None: it
    did, and only then is the file done). A name of "" is a result that can never be filed
    (``ResultFiles.refusal``), and its error says why."""

    filed: list[tuple[str, bool]] = field(default_factory=list)
    moves: list[OSError | None] = field(default_factory=list)
    error: OSError | None = None
    notes: list[str] = field(default_factory=list)  # warnings for the daemon's log


class Commits(Protocol):
    """Where a batch's commit runs: the commit process (``files/commit_process.py``); tests
    put one running in their own process where they fake a disk (``tests/fakes.py``). What the
    watchdog reads has defaults, for one that subclasses this to inherit (no process: nothing
    to stall or stop)."""

    replies: int = 0  # batches answered (the watchdog's progress)

    def start(self) -> None: ...

    @property
    def pid(self) -> int | None:
        """Its process, if it has one."""
        return None

    def stalled_s(self) -> float | None:
        """Seconds the oldest unanswered batch has waited for its reply; None: none waits."""
        return None

    def stopped(self) -> bool:
        """Whether its process is stopped (SIGSTOP, a debugger)."""
        return False

    def send(self, entries: Sequence[CommitEntry]) -> Future[Committed]: ...

    def close(self) -> None: ...


@dataclass(slots=True)
class Outputs:
    """What follows a batch's results besides its sources' moves, per the config."""

    index: ResultIndex | None = None
    sidecars: Sidecars | None = None

    @classmethod
    def of(cls, lifecycle: Lifecycle) -> Outputs:
        config = lifecycle.config
        return cls(None if config.index is None else ResultIndex(config, lifecycle.results),
                   None if config.xmp is None else Sidecars(config))

    def start(self) -> str | None:
        """The index opened and repaired (``ResultIndex.start``); what was done, or why it
        could not be now (the first batch tries again, as backpressure if it fails too)."""
        if self.index is None:
            return None
        try:
            return f"the index {self.index.path}: {self.index.start()}"
        except OSError as exc:
            return f"the index {self.index.path} cannot be opened now: {exc}"

    def close(self) -> None:
        if self.index is not None:
            self.index.close()


def commit(lifecycle: Lifecycle, entries: Sequence[CommitEntry],
           index: ResultIndex | None = None, sidecars: Sidecars | None = None) -> Committed:
    """The results filed, the sources moved, and what follows the results: the index's rows
    (``files.index``, its two steps around the result files) and the XMP sidecars
    (``files.xmp``), in the same commit and its error handling: an index that cannot be
    written is a results disk that cannot be (the batch's files wait, none is failed)."""
    with lifecycle.walked_once():  # each step of each file reaches its claimed folder
        return _commit(lifecycle, entries, index, sidecars)


def _commit(lifecycle: Lifecycle, entries: Sequence[CommitEntry], index: ResultIndex | None,
            sidecars: Sidecars | None) -> Committed:
    results = lifecycle.results
    keys = [(entry.key, entry.sha256, entry.inbox_path) for entry in entries]
    try:
        with contextlib.ExitStack() as log:
            if index is not None:
                index.begin(keys)
            # The index's pending entries durable with the results, before any is placed.
            also_sync = [] if index is None else [log.enter_context(index.log_descriptor())]
            filed = results.write([
                ResultEntry(entry.key, entry.sha256,
                            functools.partial(filed_document, results, entry.key,
                                              entry.document),
                            entry.vector, output_mode(lifecycle.source_mode(entry.claimed)))
                for entry in entries], also_sync)
    except OSError as exc:
        return Committed(error=exc)
    names: list[tuple[str, bool]] = []
    moves: list[OSError | None] = []
    rows: list[IndexRow] = []
    notes: list[str] = []
    for entry, got in zip(entries, filed, strict=True):
        if isinstance(got, OSError):  # its result can never be filed: no name, no move
            names.append(("", False))
            moves.append(got)
            continue
        names.append(got)
        name = got[0]
        photo: str | None
        try:
            photo = lifecycle.finish_success(entry.claimed, name, entry.inbox_path,
                                             entry.sha256)
        except OSError as exc:
            moves.append(exc)  # moved later (``finish_later``): where it will end
            photo = None if index is None else index.photo_path(name, entry.key,
                                                                entry.inbox_path)
        else:
            moves.append(None)
        document = filed_document(results, entry.key, entry.document, name)
        if index is not None:
            rows.append(row_of(index.stored_name(name), document, photo,
                               functools.partial(_given, entry.vector)))
        if sidecars is not None and photo is not None and moves[-1] is None:
            note = sidecars.write(photo, document)
            if note:
                notes.append(note)
    if index is not None:
        try:
            index.record(rows, keys)
        except OSError as exc:
            # The results are filed and the sources moved: the rows follow before the
            # next batch (``ResultIndex.unresolved``), and the daemon says why.
            notes.append(f"the index is behind the result files for now: {exc}")
    return Committed(names, moves, notes=notes)


def _given(vector: npt.NDArray[np.float32] | None, _file: str) -> npt.NDArray[np.float32] | None:
    return vector


def filed_document(results: ResultFiles, key: str, document: dict[str, Any],
                   name: str) -> dict[str, Any]:
    """``document`` as filed under ``name``: when that is not ``key``, ``filed_as`` follows
    ``source``, and an embedding names the vector file beside this very JSON."""
    if name == key:
        return document
    filed: dict[str, Any] = {}
    for item, value in document.items():
        filed[item] = value
        if item == "source":
            filed["filed_as"] = name
    if isinstance(filed.get("embedding"), dict):
        filed["embedding"] = {**filed["embedding"],
                              "file": os.path.basename(results.vector_file(name))}
    return filed


# -- the pipe between the daemon and its commit process ----------------------------------------


def request_frame(entries: Sequence[CommitEntry]) -> tuple[list[dict[str, Any]], bytes]:
    """The entries as a frame's header part and payload (the vectors, one after another).
    Paths go as hex: a file name need not be UTF-8."""
    rows, vectors, offset = [], [], 0
    for entry in entries:
        row: dict[str, Any] = {"key": entry.key, "sha256": entry.sha256,
                               "document": entry.document,
                               "claimed_hex": os.fsencode(entry.claimed).hex(),
                               "inbox_path_hex": os.fsencode(entry.inbox_path).hex()}
        if entry.vector is not None:
            data = np.ascontiguousarray(entry.vector, dtype=np.float32).tobytes()
            row["vector"] = [offset, len(data) // 4]
            vectors.append(data)
            offset += len(data)
        rows.append(row)
    return rows, b"".join(vectors)


def entries_from(rows: list[dict[str, Any]], payload: bytes | bytearray) -> list[CommitEntry]:
    entries = []
    for row in rows:
        vector = None
        if row.get("vector") is not None:
            offset, count = row["vector"]
            vector = np.frombuffer(payload, np.float32, count, offset).copy()
        entries.append(CommitEntry(row["key"], row["sha256"], row["document"],
                                   os.fsdecode(bytes.fromhex(row["claimed_hex"])),
                                   os.fsdecode(bytes.fromhex(row["inbox_path_hex"])), vector))
    return entries


def config_json(config: Config) -> str:
    """``config`` as JSON the commit process rebuilds it from. Paths go as hex: a path need not
    be UTF-8 (a working folder's name, say), and pydantic's own JSON refuses one that is not."""
    return json.dumps(config.model_dump(), default=_path_hex)


def config_from_json(text: str) -> Config:
    return Config.model_validate(json.loads(text, object_hook=_hex_path))


def _path_hex(value: Any) -> dict[str, str]:
    if isinstance(value, PurePath):
        return {"path_hex": os.fsencode(value).hex()}
    raise TypeError(f"{type(value).__name__} in a config")


def _hex_path(found: dict[str, Any]) -> Any:
    if found.keys() == {"path_hex"}:
        return Path(os.fsdecode(bytes.fromhex(found["path_hex"])))
    return found


def reply_header(committed: Committed) -> dict[str, Any]:
    return {"filed": committed.filed, "moves": [_error_fields(exc) for exc in committed.moves],
            "error": _error_fields(committed.error), "notes": committed.notes}


def committed_from(header: dict[str, Any]) -> Committed:
    return Committed([(str(name), bool(existed)) for name, existed in header["filed"]],
                     [_error(fields) for fields in header["moves"]], _error(header["error"]),
                     [str(note) for note in header.get("notes", [])])


def _error_fields(exc: OSError | None) -> list[Any] | None:
    """errno, text, (as hex: it need not be UTF-8) the path it names, and whether it is a
    ``ForeignFolder``: what a full disk's wait needs to say, and probe, which folder is full,
    and what tells a moved claim area (waited out) from a path that can never be (a link on
    the way): both have the same errno."""
    if exc is None:
        return None
    where = exc.filename if isinstance(exc.filename, str | bytes) else None
    return [exc.errno or errno.EIO, exc.strerror or str(exc),
            None if where is None else os.fsencode(where).hex(), isinstance(exc, ForeignFolder)]


def _error(fields: list[Any] | None) -> OSError | None:
    if fields is None:
        return None
    where = fields[2] if len(fields) > 2 else None
    kind = ForeignFolder if len(fields) > 3 and fields[3] else OSError
    if where is None:
        return kind(int(fields[0]), str(fields[1]))
    return kind(int(fields[0]), str(fields[1]), os.fsdecode(bytes.fromhex(where)))
