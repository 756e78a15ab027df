"""Result files: ``results/<name>.json`` (and ``<name>.npy`` for embeddings), one per input,
never one input's result over another's.

``<name>`` is the input's key (``photo.jpg``), or — when that name already holds the result of
*different* bytes — ``photo.<sha256[:12]>.jpg``, then ``photo.<sha256[:12]>.1.jpg`` and so on
(up to ``renames.MAX_NAME_VARIANTS``). A key whose folder cannot hold a result — a file has
that folder's name, as when ``a.jpg.json/`` with photos in it arrives after ``a.jpg`` was
done — is refused before anything is written: that file's own permanent problem
(``ResultFiles.refusal``), never a reason to try name after name, nor to fail the batch.
The source later moves to ``done/<name>``, the same name, so a file in ``done/``
finds its result by name. The same bytes under the same key always map to the same name, so a
re-drop or a rerun after a crash finds its earlier result in one or two opens.

Durability is grouped per batch (group commit): every JSON is written to its temp file, all of
them are made durable together (``durable.write_tmps``), then each is renamed into place without
replacing anything, and each results folder is fsynced once; only after that does the caller
move the batch's sources. A
batch's vectors are made durable *before* its JSON: a rerun treats an existing JSON with the
same sha256 as done, so a JSON must never exist without its vector. Vectors, too, are placed
without replacing: a name whose vector is there (another writer's, or a killed attempt's) is
taken, and the result goes to the next name.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
from collections.abc import Callable, Iterator, Sequence, Set
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from inboxd.files.durable import (
    RESULT_MODE,
    commit_pause,
    fsync_dir,
    json_bytes,
    unlink_quietly,
    write_tmp,
    write_tmps,
)
from inboxd.files.names import fit_name, output_path, output_str
from inboxd.files.portable_names import filing_key
from inboxd.files.renames import (
    MAX_NAME_VARIANTS,
    NoFreeName,
    key_variants,
    no_free_name,
    place,
    rename_into,
)
from inboxd.files.safe_paths import (
    NAME_ERRNOS,
    LinkedFolder,
    open_inside,
    split_rel,
)

JSON_SUFFIX = ".json"
VECTOR_SUFFIX = ".npy"
SHA_TOKEN_CHARS = 12


def sha_token(sha256: str) -> str:
    return sha256[:SHA_TOKEN_CHARS]


@dataclass
class ResultEntry:
    key: str
    sha256: str
    document: Callable[[str], dict[str, Any]]  # the JSON, given the name it is filed under
    vector: npt.NDArray[np.float32] | None = None
    mode: int = RESULT_MODE  # the JSON's and the vector's (durable.output_mode of the source)


class ResultFiles:
    def __init__(self, results_dir: Path, tmp_dir: Path, done_dir: Path | None,
                 replace_kept: bool = False) -> None:
        self.results_dir = results_dir
        self.tmp_dir = tmp_dir
        # With after_success: move, a name is only free when done/ does not hold it either,
        # so the source can follow its result's name.
        self.done_dir = done_dir
        # Every per-file path below is a str: pathlib would intern each file's name.
        self._results = os.fspath(results_dir)
        self._tmp = os.fspath(tmp_dir)
        self._done = None if done_dir is None else os.fspath(done_dir)
        # after_success: keep — the source stays in the inbox under its own name, and the plain
        # name's result must describe what is there now; an earlier result moves aside.
        self.replace_kept = replace_kept

    def json_path(self, name: str) -> Path:
        return output_path(self.results_dir, name, JSON_SUFFIX)

    def json_file(self, name: str) -> str:
        """:meth:`json_path` as a ``str``, for the per-file path."""
        return output_str(self._results, name, JSON_SUFFIX)

    def filed_json_file(self, key: str) -> str:
        """Where ``key``'s own result is (its plain name, as ``after_success: keep`` files
        it): :meth:`json_file` of the portable form of ``key`` where this filesystem cannot
        hold ``key`` (``portable_names.filing_key``). A full disk's error is raised."""
        return self.json_file(filing_key(key, self._tmp))

    def vector_file(self, name: str) -> str:
        return output_str(self._results, name, VECTOR_SUFFIX)

    def json_folder(self, name: str) -> str:
        return os.path.dirname(self.json_file(name))

    def make_durable(self, name: str) -> None:
        """fsync the folder of ``name``'s result: found there, it may be a commit's (another
        instance's, or another batch's) that has renamed it in but not fsynced its folder yet,
        and a source must not move before its result is durable."""
        fsync_dir(self.json_folder(name))

    def recorded_sha256(self, name: str) -> str | None:
        """The sha256 in ``name``'s result; "" when the file exists but says none; None when
        there is none, or ``name`` is one no result is ever filed under (``..`` in it)."""
        try:
            path = self.json_file(name)
        except ValueError:  # not "exists but says none": find() would guess on for ever
            return None
        try:
            with open(path, "rb") as existing:
                sha = json.load(existing).get("sha256")
        except (FileNotFoundError, NotADirectoryError):
            # NotADirectory: a file holds the name of a folder on the way (a.jpg.json, the
            # result of a.jpg, for the key a.jpg.json/b.jpg): no result there, nor under any
            # variant of the name. Read as "says none", the lookup would try variants for ever.
            return None
        except OSError as exc:
            # A name this filesystem cannot hold (exFAT: not UTF-8): no result is filed under
            # it, nor under any variant of it (read as "says none", find would try them all).
            return None if exc.errno in NAME_ERRNOS else ""
        except (ValueError, AttributeError):
            return ""
        return sha if isinstance(sha, str) else ""

    def find(self, key: str, sha256: str) -> str | None:
        """The name under which these bytes' result already exists, if it does (under the
        portable form of ``key`` where this filesystem cannot hold ``key``)."""
        key = filing_key(key, self._tmp)
        for name in key_variants(key, sha_token(sha256)):
            recorded = self.recorded_sha256(name)
            if recorded is None:
                return None
            if recorded == sha256:
                return name
        return None  # every variant holds other bytes' result: none of them is ours

    def refusal(self, key: str) -> LinkedFolder | None:
        """Why ``key``'s result (or, with after_success: move, its source in done/) can never
        be filed: a folder on the way is a file or a link. None: it can."""
        self.json_file(key)  # an unsafe key (``..``) is a bug, raised as such
        folders, _ = split_rel(key)
        if not folders:
            return None
        parts = [fit_name(part, "") for part in folders]
        for label, root in (("results", self._results), ("done", self._done)):
            if root is None:
                continue
            try:
                with open_inside(root, parts):
                    pass
            except FileNotFoundError:
                continue  # a part is missing, so is all below it: they are made when filed
            except LinkedFolder as exc:
                return LinkedFolder(exc.errno, f"it cannot be filed under {label}/"
                                    f"{'/'.join(folders)}/: {exc.strerror}; rename that folder "
                                    "in the inbox and drop its files again", key)
        return None

    def _next_free(self, key: str, sha256: str, taken: Set[str]) -> str:
        name = next(self._free_names(key, sha256, taken), None)
        if name is None:
            raise no_free_name(self.json_file(key))
        return name

    def _free_names(self, key: str, sha256: str, taken: Set[str]) -> Iterator[str]:
        """Names free for these bytes' result: not given out by this ``write`` (``taken``),
        no JSON there, and no vector either (another writer's, placed before its JSON)."""
        for name in key_variants(key, sha_token(sha256)):
            if name in taken:
                continue
            if os.path.lexists(self.json_file(name)) or os.path.lexists(self.vector_file(name)):
                continue
            if self._done is not None and os.path.lexists(output_str(self._done, name)):
                continue
            yield name

    def write(self, entries: Sequence[ResultEntry],
              also_sync: Sequence[int] = ()) -> list[tuple[str, bool] | OSError]:
        """Durably file every entry's result. Returns, per entry, the name it is filed under
        and whether that result was already there (the same bytes, filed earlier) — or why it
        can never be filed (that file's own problem: its batch is filed all the same).
        ``also_sync``: descriptors made durable with the batch's JSON, before any is placed."""
        # Vectors this call placed, by name: taken back if their JSON is not placed (a full
        # disk part-way), or the batch's retry would find the names taken and use variants.
        ours: dict[str, str] = {}
        try:
            return self._file_all(entries, ours, also_sync)
        except OSError:
            for vector in ours.values():
                unlink_quietly(vector)
            raise

    def _file_all(self, entries: Sequence[ResultEntry], ours: dict[str, str],
                  also_sync: Sequence[int]) -> list[tuple[str, bool] | OSError]:
        outcome: list[tuple[str, bool] | OSError | None] = []
        todo: list[tuple[int, ResultEntry, str]] = []
        # The names this call gave out: none goes to two entries, though no JSON is there yet.
        given: dict[tuple[str, str], str] = {}
        taken: set[str] = set()
        vector_folders: set[str] = set()
        folders: set[str] = set()  # fsynced at the end: every result returned is durable
        for index, entry in enumerate(entries):
            filing = filing_key(entry.key, self._tmp)
            if filing != entry.key:  # a name this filesystem cannot hold: its portable form
                entry = dataclasses.replace(entry, key=filing)
            known = None if self.replace_kept else self.find(entry.key, entry.sha256)
            outcome.append(None if known is None else (known, True))
            if known is not None:
                # Perhaps another commit's, renamed in but its folder not fsynced yet.
                folders.add(self.json_folder(known))
                continue
            name = given.get((entry.key, entry.sha256))
            if name is None:  # (the same bytes twice in one batch share one result)
                refused: OSError | None = self.refusal(entry.key)
                try:
                    name = self._claim_name(entry, taken) if refused is None else None
                except NoFreeName as exc:
                    refused = exc
                if name is None:
                    outcome[-1] = refused
                    continue
                if entry.vector is not None:
                    name = self._write_vector(entry, name, taken, ours)
                    vector_folders.add(os.path.dirname(self.vector_file(name)))
                given[(entry.key, entry.sha256)] = name
                taken.add(name)
            todo.append((index, entry, name))
        # Every vector durable before any JSON naming it is placed.
        for folder in vector_folders:
            fsync_dir(folder)
        # All durable together, or (a full disk part-way) none left behind.
        temps = write_tmps(self._tmp, [json_bytes(entry.document(name))
                                          for _, entry, name in todo], JSON_SUFFIX,
                           [entry.mode for _, entry, _ in todo], also_sync)
        commit_pause()
        placed = 0
        try:
            for (index, entry, name), tmp in zip(todo, temps, strict=True):
                filed = self._place_json(tmp, entry, name, taken, ours)
                outcome[index] = (filed, False)
                ours.pop(filed, None)  # its JSON names it now: no longer ours to take back
                folders.add(self.json_folder(filed))
                placed += 1
        except OSError:
            for tmp in temps[placed:]:  # not placed: give the space back now
                unlink_quietly(tmp)
            raise
        commit_pause()
        for folder in folders:
            fsync_dir(folder)
        commit_pause()
        return [filed for filed in outcome if filed is not None]  # every entry has one now

    def _claim_name(self, entry: ResultEntry, taken: Set[str]) -> str:
        if self.replace_kept and entry.key not in taken:
            self._move_aside(entry.key, entry.sha256)
            return entry.key
        return self._next_free(entry.key, entry.sha256, taken)

    def _move_aside(self, key: str, sha256: str) -> None:
        """keep: an older result of different bytes under the plain name moves to its own
        sha-named variant, so the plain name can describe the file now in the inbox."""
        recorded = self.recorded_sha256(key)
        if recorded in (None, sha256):
            return
        token = sha_token(recorded) if recorded else "old"
        for suffix in (VECTOR_SUFFIX, JSON_SUFFIX):  # vector first: never a JSON without it
            current = output_str(self._results, key, suffix)
            if os.path.lexists(current):
                place(current, output_str(self._results, key + "." + token, suffix), token)

    def _write_vector(self, entry: ResultEntry, name: str, taken: Set[str],
                      ours: dict[str, str]) -> str:
        """Place ``entry``'s vector as ``name``'s, or — that vector already there — the next
        free name's; returns the name it got (not yet durable: its folder wants an fsync).
        Never replaces: a vector there may be another writer's, whose JSON is still to come.
        A leftover of a killed earlier attempt just pushes this result to a variant name —
        one spare file, never a JSON beside the wrong vector."""
        assert entry.vector is not None
        data = io.BytesIO()
        # allow_pickle=False: a float32 array never needs it, and readers can refuse it.
        np.save(data, entry.vector, allow_pickle=False)
        tmp = write_tmp(self._tmp, data.getvalue(), VECTOR_SUFFIX, entry.mode)
        tried: set[str] = set(taken)
        try:
            for _ in range(MAX_NAME_VARIANTS):
                try:
                    rename_into(tmp, self.vector_file(name))
                    ours[name] = self.vector_file(name)
                    return name
                except FileExistsError:
                    if self.recorded_sha256(name) == entry.sha256:
                        # keep: the same bytes' result is there, and that vector is theirs.
                        unlink_quietly(tmp)
                        return name
                tried.add(name)
                name = self._next_free(entry.key, entry.sha256, tried)
            raise no_free_name(self.vector_file(entry.key))
        except OSError:
            unlink_quietly(tmp)
            raise

    def _place_json(self, tmp: str, entry: ResultEntry, name: str, taken: set[str],
                    ours: dict[str, str]) -> str:
        """Rename ``tmp`` to ``name``'s JSON; if another writer took that name meanwhile, the
        next free one (rewriting the JSON, and the vector, for it)."""
        for _ in range(MAX_NAME_VARIANTS):
            target = self.json_file(name)
            try:
                rename_into(tmp, target)
                return name
            except FileExistsError:
                if self.recorded_sha256(name) == entry.sha256:
                    unlink_quietly(tmp)  # the same bytes' result is already there
                    return name
            unlink_quietly(tmp)
            name = self._next_free(entry.key, entry.sha256, taken)
            if entry.vector is not None:
                name = self._write_vector(entry, name, taken, ours)
                fsync_dir(os.path.dirname(self.vector_file(name)))  # durable before its JSON
            taken.add(name)
            tmp = write_tmp(self._tmp, json_bytes(entry.document(name)), JSON_SUFFIX,
                            entry.mode)
        unlink_quietly(tmp)
        raise no_free_name(self.json_file(entry.key))
