"""The search index against the result files it follows: one row per result file, with the
same name and sha256 (the JSON files are the source of truth; ``files.index``)."""

from __future__ import annotations

import collections
import json
import os
import sqlite3
from pathlib import Path

from inboxd.config import INDEX_FILENAME


def index_path(results: Path) -> Path:
    return results / INDEX_FILENAME


def result_files(results: Path) -> collections.Counter[tuple[str, str]]:
    """(name, sha256) of every result file under ``results`` (its temp folder left out)."""
    found: collections.Counter[tuple[str, str]] = collections.Counter()
    for path in results.rglob("*.json"):
        if ".tmp" in path.relative_to(results).parts:
            continue
        document = json.loads(path.read_bytes())
        found[(str(path.relative_to(results))[:-len(".json")], document["sha256"])] += 1
    return found


def index_rows(index: Path) -> collections.Counter[tuple[str, str]]:
    with sqlite3.connect(f"file:{index}?mode=ro", uri=True) as conn:
        return collections.Counter((os.fsdecode(name), str(sha)) for name, sha in conn.execute(
            "SELECT name, sha256 FROM results"))


def assert_index_matches_results(results: Path) -> int:
    """Rows = result files (names and sha256s); returns how many there are."""
    files, rows = result_files(results), index_rows(index_path(results))
    missing, extra = files - rows, rows - files
    assert not missing and not extra, (
        f"index and result files disagree: {len(files)} files, {len(rows)} rows; "
        f"without a row: {sorted(missing)[:5]}; rows without a file: {sorted(extra)[:5]}")
    return sum(files.values())
