"""The search index: every result also as rows of an SQLite database (``index:``, by default
``results_dir/.inboxd-index.sqlite3``), which ``inboxd search`` reads.

The JSON files stay the source of truth; the index follows them, written by the commit process
in the same group commit as the batch's result files, so a kill at any instant leaves the two
agreeing (or agreeing after the start-up's repair, which looks only at what was in flight):

1. ``begin``: the batch's (key, sha256) go into ``pending``, committed before any result file
   exists, its write-ahead log made durable in the same parallel fsync as the batch's result
   files (``ResultFiles.write(also_sync=)``), so before any of them is placed;
2. the result files are written and made durable, the sources moved (``files.commits``);
3. ``record``: the batch's rows go in and its pending entries out, in one transaction.

A kill between 1 and 3 leaves pending entries: ``resolve_pending`` (at start-up, and before the
next batch after a failed step 3) looks each one up among the result files by its sha256 and
indexes what it finds. Step 3 needs no fsync of its own: lost to a power cut, it takes nothing
with it that step 1 had not made durable (its pending entries are still there). A missing
or older index (a deleted file, a new schema) is rebuilt from the JSON files at start-up, as
``inboxd index --rebuild`` does on demand.

Several instances may share one results folder and so one index on a local filesystem: SQLite
locks the file (WAL, a shared-memory index beside it), and each waits its turn (``BUSY_S``). On
a network filesystem SQLite's locking does not hold: start-up and check-config refuse an index
there (``files.layout``).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import sqlite3
import time
import urllib.parse
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from inboxd.config import INDEX_FILENAME as INDEX_FILENAME
from inboxd.config import Config
from inboxd.files.index_rows import IndexRow, npy_reader, row_of
from inboxd.files.layout import TMP_DIRNAME
from inboxd.files.names import output_str
from inboxd.files.results import JSON_SUFFIX, ResultFiles, sha_token

SCHEMA_VERSION = "2"
BUSY_S = 60.0  # another instance's transaction on a shared index: waited for, not an error

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta(key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS results(
    id INTEGER PRIMARY KEY,
    name BLOB NOT NULL UNIQUE,          -- results/<name>.json
    sha256 TEXT NOT NULL,
    source BLOB NOT NULL,               -- the inbox key
    photo BLOB,                         -- where the photo is now; NULL: deleted
    model TEXT NOT NULL,
    model_sha256 TEXT,
    instance TEXT NOT NULL,
    size_bytes INTEGER,
    width INTEGER,
    height INTEGER,
    completed_at TEXT NOT NULL,
    indexed_at REAL NOT NULL);
CREATE INDEX IF NOT EXISTS results_sha256 ON results(sha256);
-- Each label string once (a model's vocabulary), searched by FTS5; a photo's labels point at
-- them, so a label costs its photo one plain row, and a word finds its labels in the small
-- vocabulary, then their photos best score first through labels_name.
CREATE TABLE IF NOT EXISTS label_names(
    id INTEGER PRIMARY KEY,
    label TEXT NOT NULL UNIQUE);
CREATE VIRTUAL TABLE IF NOT EXISTS label_words USING fts5(
    label, content='label_names', content_rowid='id', tokenize='unicode61 remove_diacritics 2');
CREATE TRIGGER IF NOT EXISTS label_names_in AFTER INSERT ON label_names BEGIN
    INSERT INTO label_words(rowid, label) VALUES (new.id, new.label); END;
CREATE TABLE IF NOT EXISTS labels(
    result_id INTEGER NOT NULL REFERENCES results(id) ON DELETE CASCADE,
    task TEXT NOT NULL,
    kind TEXT NOT NULL,                 -- class (top-k) or detection
    name_id INTEGER NOT NULL REFERENCES label_names(id),
    score REAL NOT NULL);
CREATE INDEX IF NOT EXISTS labels_result ON labels(result_id);
CREATE INDEX IF NOT EXISTS labels_name ON labels(name_id, score);
CREATE TABLE IF NOT EXISTS detections(
    id INTEGER PRIMARY KEY,
    result_id INTEGER NOT NULL REFERENCES results(id) ON DELETE CASCADE,
    task TEXT NOT NULL,
    label TEXT NOT NULL,
    score REAL NOT NULL,
    x0 REAL NOT NULL, y0 REAL NOT NULL, x1 REAL NOT NULL, y1 REAL NOT NULL);
CREATE INDEX IF NOT EXISTS detections_result ON detections(result_id);
CREATE TABLE IF NOT EXISTS texts(
    id INTEGER PRIMARY KEY,
    result_id INTEGER NOT NULL REFERENCES results(id) ON DELETE CASCADE,
    task TEXT NOT NULL,
    text TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS texts_result ON texts(result_id);
CREATE VIRTUAL TABLE IF NOT EXISTS text_words USING fts5(
    text, content='texts', content_rowid='id', tokenize='unicode61 remove_diacritics 2');
CREATE TRIGGER IF NOT EXISTS texts_in AFTER INSERT ON texts BEGIN
    INSERT INTO text_words(rowid, text) VALUES (new.id, new.text); END;
CREATE TRIGGER IF NOT EXISTS texts_out AFTER DELETE ON texts BEGIN
    INSERT INTO text_words(text_words, rowid, text) VALUES ('delete', old.id, old.text); END;
CREATE TABLE IF NOT EXISTS embeddings(
    id INTEGER PRIMARY KEY,
    result_id INTEGER NOT NULL REFERENCES results(id) ON DELETE CASCADE,
    task TEXT NOT NULL,
    dim INTEGER NOT NULL,
    vector BLOB NOT NULL);              -- float32, native order
CREATE INDEX IF NOT EXISTS embeddings_result ON embeddings(result_id);
CREATE TABLE IF NOT EXISTS pending(
    instance TEXT NOT NULL,
    key BLOB NOT NULL,
    sha256 TEXT NOT NULL,
    inbox_path BLOB NOT NULL);
-- Paths and names are kept as their bytes (os.fsencode): a file name need not be UTF-8.
"""

# SQLite's primary result codes, as the errno a disk would have given: the commit's error
# handling (a full or read-only results disk is backpressure) treats them alike.
_SQLITE_ERRNO = {13: errno.ENOSPC, 8: errno.EROFS, 10: errno.EIO, 14: errno.EACCES,
                 5: errno.EBUSY, 6: errno.EBUSY, 7: errno.ENOMEM, 23: errno.EACCES,
                 11: errno.EIO, 26: errno.EIO}


class IndexUnusable(OSError):
    """The index cannot be opened or written (its errno says why, as a disk's would)."""


@contextlib.contextmanager
def as_os_error(path: Path) -> Iterator[None]:
    """SQLite's errors as OSErrors naming the index file."""
    try:
        yield
    except (sqlite3.ProgrammingError, sqlite3.InterfaceError):
        raise  # a bug of ours, not a disk's: a traceback, not a retry
    except sqlite3.Error as exc:
        code = getattr(exc, "sqlite_errorcode", None)
        number = _SQLITE_ERRNO.get((code or 0) & 0xFF, errno.EIO)
        if number in (errno.EIO, errno.EACCES):
            number = _disk_condition(path) or number
        # The errno's own words first: what a full or read-only disk says, as the result
        # files' errors do (h-disk's warning names the condition by them).
        raise IndexUnusable(number, f"{os.strerror(number)} (the index: {exc})",
                            str(path)) from exc


def _disk_condition(path: Path) -> int | None:
    """EROFS or ENOSPC when the index's filesystem is read-only or full now: SQLite reports
    a write refused for either as an I/O error, which would not be the backpressure that a
    full or read-only results disk is."""
    try:
        info = os.statvfs(path.parent)
    except OSError:
        return None
    if info.f_flag & os.ST_RDONLY:
        return errno.EROFS
    if info.f_bavail == 0:
        return errno.ENOSPC
    return None


def connect(path: Path, read_only: bool = False) -> sqlite3.Connection:
    with as_os_error(path):
        if read_only:
            uri = f"file:{urllib.parse.quote(os.fsencode(path))}?mode=ro"
            conn = sqlite3.connect(uri, uri=True, timeout=BUSY_S, isolation_level=None,
                                   check_same_thread=False)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            # One thread at a time, not always the one that opened it (a test's in-process
            # commit opens it on one thread and commits on the io thread).
            conn = sqlite3.connect(os.fsencode(path), timeout=BUSY_S, isolation_level=None,
                                   check_same_thread=False)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute("PRAGMA foreign_keys=ON")
    return conn


class ResultIndex:
    def __init__(self, config: Config, results: ResultFiles) -> None:
        assert config.index is not None
        self.path = config.index
        self.config = config
        self.results = results
        self._conn: sqlite3.Connection | None = None
        self.unresolved = False  # a batch's ``record`` failed: its pending entries wait
        self.started = False  # ``start`` has run (a failed one is tried again by ``begin``)
        self._label_ids: dict[str, int] = {}

    @property
    def conn(self) -> sqlite3.Connection:
        if self._conn is None:
            self._conn = connect(self.path)
            with as_os_error(self.path):
                self._conn.executescript(SCHEMA)
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    # -- start-up ----------------------------------------------------------------------------

    def start(self) -> str:
        """Open it, and repair what a kill or a lost file left: rebuilt from the JSON files
        when it is new, of another schema or of another results folder; else only the pending
        entries resolved. Returns what was done, for the log."""
        try:
            with as_os_error(self.path):
                meta: dict[str, str | bytes] = dict(
                    self.conn.execute("SELECT key, value FROM meta").fetchall())
        except IndexUnusable as exc:
            if exc.errno != errno.EIO or not self.path.exists():
                raise
            # Not a database, or a damaged one: kept aside for a look, and made again.
            self.close()
            aside = self.path.with_name(f"{self.path.name}.damaged-{int(time.time())}")
            os.replace(self.path, aside)
            self._remove_files()
            meta = {}
        if meta.get("schema") not in (None, SCHEMA_VERSION):
            # Another schema's tables would stay under the new names: made again, empty.
            self._remove_files()
        want: dict[str, str | bytes] = {"schema": SCHEMA_VERSION,
                                        "results_dir": os.fsencode(self.config.results_dir)}
        if any(meta.get(key) != value for key, value in want.items()):
            count = self.rebuild()
            self.started = True
            return f"rebuilt from {count} result files ({_why_rebuilt(meta, want)})"
        resolved = self.resolve_pending()
        self.started = True
        return f"{self.count()} results" + (f", {resolved} in flight at a kill resolved"
                                            if resolved else "")

    def _remove_files(self) -> None:
        self.close()
        for extra in ("", "-wal", "-shm"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"{self.path}{extra}")

    def count(self) -> int:
        with as_os_error(self.path):
            return int(self.conn.execute("SELECT count(*) FROM results").fetchone()[0])

    def rebuild(self) -> int:
        """Every result file's row, in one transaction replacing all there was."""
        rows = list(self._rows_from_files())
        with as_os_error(self.path), self._transaction():
            conn = self.conn
            for table in ("pending", "labels", "texts", "detections", "embeddings", "results"):
                # (label_names too, below: the FTS rows of the vocabulary go with a rebuild)
                conn.execute(f"DELETE FROM {table}")
            conn.execute("INSERT INTO label_words(label_words) VALUES ('delete-all')")
            conn.execute("DELETE FROM label_names")
            self._label_ids.clear()
            self._insert_rows(rows)
            conn.executemany("INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)", [
                ("schema", SCHEMA_VERSION),
                ("results_dir", os.fsencode(self.config.results_dir))])
        return len(rows)

    def _rows_from_files(self) -> Iterator[IndexRow]:
        root = os.fspath(self.config.results_dir)
        for folder, subfolders, files in os.walk(root):
            if folder == root and TMP_DIRNAME in subfolders:
                subfolders.remove(TMP_DIRNAME)
            for file in files:
                if file.endswith(JSON_SUFFIX):
                    row = self._row_from_file(os.path.join(folder, file))
                    if row is not None:
                        yield row

    def _row_from_file(self, json_file: str, inbox_path: str | None = None) -> IndexRow | None:
        try:
            with open(json_file, "rb") as file:
                document = json.load(file)
        except (OSError, ValueError):
            return None
        if not isinstance(document, dict) or not isinstance(document.get("sha256"), str):
            return None
        name = self.file_name(json_file)
        key = str(document.get("source") or name)
        return row_of(name, document, self.photo_path(str(document.get("filed_as") or key),
                                                      key, inbox_path), npy_reader(json_file))

    def file_name(self, json_file: str) -> str:
        """A result's name in the index: its file's path under results_dir, less ``.json``
        (what a kept photo's older result is renamed to, or a long name shortened to)."""
        return os.path.relpath(json_file, self.config.results_dir)[:-len(JSON_SUFFIX)]

    def stored_name(self, name: str) -> str:
        return self.file_name(self.results.json_file(name))

    def photo_path(self, name: str, key: str, inbox_path: str | None = None) -> str | None:
        """Where ``after_success`` puts the photo of the result filed as ``name``."""
        policy = self.config.inbox.after_success
        if policy == "move":
            return output_str(os.fspath(self.config.done_dir), name)
        if policy == "keep":
            if inbox_path is not None:
                return inbox_path
            inboxes = self.config.inbox.paths
            if len(inboxes) == 1:
                return os.path.join(inboxes[0], key)
            folder, _, rel = key.partition("/")
            return next((os.path.join(p, rel) for p in inboxes if p.name == folder), None)
        return None

    # -- the group commit --------------------------------------------------------------------

    def begin(self, keys: Sequence[tuple[str, str, str]]) -> None:
        """Step 1: (key, sha256, inbox path) of a batch about to be filed, pending. Written,
        not yet durable: the caller makes the write-ahead log (``log_descriptor``) durable in
        the same parallel sync as the batch's result files, before any is placed — one fsync
        of its own would cost each batch a disk round trip more."""
        if not self.started:
            self.start()
        elif self.unresolved:
            self.resolve_pending()
        instance = self.config.instance
        try:
            with as_os_error(self.path), self._transaction(synchronous="OFF"):
                self.conn.executemany(
                    "INSERT INTO pending(instance, key, sha256, inbox_path) VALUES (?, ?, ?, ?)",
                    [(instance, fsbytes(key), sha, fsbytes(inbox_path))
                     for key, sha, inbox_path in keys])
        except OSError:
            self.close()  # opened afresh for the next try: SQLite may not recover in place
            raise

    @contextlib.contextmanager
    def log_descriptor(self) -> Iterator[int]:
        """A descriptor of the write-ahead log, for the caller's fsync of ``begin``'s entries."""
        with as_os_error(self.path):
            fd = os.open(f"{self.path}-wal", os.O_RDONLY | os.O_CLOEXEC)
        try:
            yield fd
        finally:
            os.close(fd)

    def record(self, rows: Sequence[IndexRow], keys: Sequence[tuple[str, str, str]]) -> None:
        """Step 3: the batch's rows in, its pending entries out. On failure the entries stay
        pending, and are resolved before the next batch (or at the next start)."""
        try:
            with as_os_error(self.path), self._transaction():
                self._insert_rows(rows)
                self._forget(keys)
        except OSError:
            self.unresolved = True
            self.close()
            raise

    def resolve_pending(self) -> int:
        """Each of this instance's pending entries indexed from its result file (if it has
        one now) and forgotten. Returns how many there were."""
        instance = self.config.instance
        with as_os_error(self.path):
            keys = [(os.fsdecode(k), str(s), os.fsdecode(p)) for k, s, p in self.conn.execute(
                "SELECT key, sha256, inbox_path FROM pending WHERE instance = ?", (instance,))]
        rows = []
        for key, sha, inbox_path in keys:
            name = self.results.find(key, sha)
            if name is not None:
                row = self._row_from_file(self.results.json_file(name), inbox_path)
                if row is not None:
                    rows.append(row)
        with as_os_error(self.path), self._transaction():
            self._insert_rows(rows)
            self.conn.execute("DELETE FROM pending WHERE instance = ?", (instance,))
        self.unresolved = False
        return len(keys)

    def _forget(self, keys: Sequence[tuple[str, str, str]]) -> None:
        self.conn.executemany(
            "DELETE FROM pending WHERE rowid IN (SELECT rowid FROM pending WHERE instance = ? "
            "AND key = ? AND sha256 = ? LIMIT 1)",
            [(self.config.instance, fsbytes(key), sha) for key, sha, _ in keys])

    @contextlib.contextmanager
    def _transaction(self, synchronous: str = "NORMAL") -> Iterator[None]:
        conn = self.conn
        if synchronous != "NORMAL":
            conn.execute(f"PRAGMA synchronous={synchronous}")
        try:
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield
            except BaseException:
                self._label_ids.clear()  # ids made in it are gone (or another's rebuild's)
                if conn.in_transaction:  # a full disk has rolled it back already
                    conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")
        finally:
            if synchronous != "NORMAL":
                conn.execute("PRAGMA synchronous=NORMAL")

    def _insert(self, row: IndexRow) -> None:
        self._insert_rows([row])

    def _insert_rows(self, rows: Sequence[IndexRow]) -> None:
        """Each row in place of any row of its name; a batch's labels, texts and vectors each
        in one statement. Another bytes' row of that name was moved aside with its result
        (after_success: keep files the kept photo's result under the plain name, its
        predecessor under ``name.<sha>``), or is gone with it."""
        conn = self.conn
        labels, detections, texts, vectors = [], [], [], []
        now = time.time()
        for row in rows:
            self._make_room(row)
            result_id = conn.execute(
                "INSERT INTO results(name, sha256, source, photo, model, model_sha256, "
                "instance, size_bytes, width, height, completed_at, indexed_at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (fsbytes(row.name), row.sha256, fsbytes(row.source),
                 None if row.photo is None else fsbytes(row.photo), row.model,
                 row.model_sha256, row.instance, row.size_bytes, row.width, row.height,
                 row.completed_at, now)).lastrowid
            labels += [(result_id, label.task, label.kind, self._label_id(label.label),
                        label.score) for label in row.labels]
            detections += [(result_id, d.task, d.label, d.score, *d.box) for d in row.detections]
            texts += [(result_id, task, text) for task, text in row.texts]
            vectors += [(result_id, task, int(vector.size),
                         np.ascontiguousarray(vector, dtype=np.float32).tobytes())
                        for task, vector in row.embeddings]
        if labels:
            conn.executemany("INSERT INTO labels(result_id, task, kind, name_id, score) "
                             "VALUES (?, ?, ?, ?, ?)", labels)
        if detections:
            conn.executemany("INSERT INTO detections(result_id, task, label, score, x0, y0, "
                             "x1, y1) VALUES (?, ?, ?, ?, ?, ?, ?, ?)", detections)
        if texts:
            conn.executemany("INSERT INTO texts(result_id, task, text) VALUES (?, ?, ?)", texts)
        if vectors:
            conn.executemany("INSERT INTO embeddings(result_id, task, dim, vector) "
                             "VALUES (?, ?, ?, ?)", vectors)

    def _make_room(self, row: IndexRow) -> None:
        conn = self.conn
        old = conn.execute("SELECT id, sha256 FROM results WHERE name = ?",
                           (fsbytes(row.name),)).fetchone()
        if old is None:
            return
        if old[1] != row.sha256:
            aside = f"{row.name}.{sha_token(old[1])}"
            if self.results.recorded_sha256(aside) == old[1]:
                aside = self.stored_name(aside)
                conn.execute("DELETE FROM results WHERE name = ?", (fsbytes(aside),))
                conn.execute("UPDATE results SET name = ? WHERE id = ?",
                             (fsbytes(aside), old[0]))
                return
        conn.execute("DELETE FROM results WHERE id = ?", (old[0],))

    def _label_id(self, label: str) -> int:
        """The id of ``label`` in the vocabulary, added when new (cached: a model has a few
        thousand labels at most, and a rollback only loses ids that are made again)."""
        found = self._label_ids.get(label)
        if found is None:
            conn = self.conn
            conn.execute("INSERT OR IGNORE INTO label_names(label) VALUES (?)", (label,))
            found = int(conn.execute("SELECT id FROM label_names WHERE label = ?",
                                     (label,)).fetchone()[0])
            self._label_ids[label] = found
        return found


def fsbytes(path: str) -> bytes:
    return os.fsencode(path)


def _why_rebuilt(meta: dict[str, str | bytes], want: dict[str, str | bytes]) -> str:
    if not meta:
        return "a new index"
    if meta.get("schema") != want["schema"]:
        return f"schema {meta.get('schema')!r} → {SCHEMA_VERSION}"
    return "another results folder's index"
