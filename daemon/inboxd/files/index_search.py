"""Queries over the search index (``files.index``): photos by words (their labels, and text read
in them, ranked by FTS5) and by likeness (the cosine similarity of embeddings).

Likeness is an exact search: every stored vector of the task is compared, read in chunks of
``CHUNK_ROWS`` so that memory stays bounded whatever the photo count (a chunk of 1,280-float
vectors is 20 MiB); the time grows with the count (bench/RESULTS.md gives it at 100,000).
"""

from __future__ import annotations

import os
import sqlite3
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

CHUNK_ROWS = 4096
DEFAULT_LIMIT = 20
LABEL_ROWS_READ = 8  # label rows read per photo shown


@dataclass(slots=True)
class Hit:
    result_id: int
    score: float
    match: str  # why it was found: the label, the words of text, or "similar"
    name: str = ""  # results/<name>.json
    photo: str | None = None  # where the photo is now (None: after_success: delete)
    sha256: str = ""
    labels: list[tuple[str, float]] = field(default_factory=list)  # its best labels

    def as_json(self) -> dict[str, object]:
        return {"photo": self.photo, "result": self.name, "sha256": self.sha256,
                "score": round(self.score, 6), "match": self.match,
                "labels": [{"label": label, "score": round(score, 6)}
                           for label, score in self.labels]}


class SearchError(Exception):
    """A query that cannot be answered; the message says what to do."""


def fts_query(words: list[str]) -> str:
    """The user's words as an FTS5 query: each a quoted string (so no word is read as the
    query language's operators), all of them required."""
    terms = [word for word in " ".join(words).split() if word.strip()]
    return " ".join('"' + term.replace('"', '""') + '"' for term in terms)


def by_words(conn: sqlite3.Connection, words: list[str],
             limit: int = DEFAULT_LIMIT) -> list[Hit]:
    """Photos whose labels or text hold every word. A label match scores its label's score
    (0-1); a text match adds FTS5's bm25 relevance, squashed into 0-1. The best ``limit``
    label matches and the best ``limit`` text matches are merged."""
    query = fts_query(words)
    if not query:
        raise SearchError("give a word to search for")
    hits: dict[int, Hit] = {}
    try:
        # The best ``limit`` of each kind, merged: a word on every other photo must not
        # cost a row object per photo.
        # Each matching label's photos best score first through labels_name (name, score),
        # merged: no pass over every photo a common label is on. A photo with several
        # matching labels takes several rows: a margin of them is read.
        names = [(int(name_id), str(label)) for name_id, label in conn.execute(
            "SELECT rowid, label FROM label_words WHERE label_words MATCH ?", (query,))]
        found: list[tuple[float, int, str]] = []
        for name_id, label in names:
            found += [(float(score), int(result_id), label) for result_id, score in conn.execute(
                "SELECT result_id, score FROM labels WHERE name_id = ? "
                "ORDER BY score DESC LIMIT ?", (name_id, limit * LABEL_ROWS_READ))]
        for score, result_id, label in sorted(found, key=lambda f: (-f[0], f[1])):
            if result_id not in hits and len(hits) < limit:
                hits[result_id] = Hit(result_id, score, f"label {label}")
        for result_id, rank, snip in conn.execute(
                "SELECT t.result_id, m.rank, m.snip FROM "
                "(SELECT rowid, bm25(text_words) AS rank, "
                "snippet(text_words, 0, '[', ']', '…', 8) AS snip "
                "FROM text_words WHERE text_words MATCH ? ORDER BY rank LIMIT ?) AS m "
                "JOIN texts t ON t.id = m.rowid", (query, limit)):
            relevance = max(-float(rank), 0.0)
            text_score = relevance / (1.0 + relevance)
            hit = hits.get(result_id)
            if hit is None:
                hits[result_id] = Hit(result_id, text_score, f"text {snip}")
            elif not hit.match.startswith(("text", "label+text")):
                hit.score += text_score
                hit.match = f"{hit.match}; text {snip}"
    except sqlite3.OperationalError as exc:
        raise SearchError(f"the search failed: {exc}") from exc
    best = sorted(hits.values(), key=lambda hit: (-hit.score, hit.result_id))[:limit]
    return describe(conn, best)


def embedding_tasks(conn: sqlite3.Connection) -> list[tuple[str, int, int]]:
    """(task, dim, count) of the embeddings the index holds."""
    return [(str(task), int(dim), int(count)) for task, dim, count in conn.execute(
        "SELECT task, dim, count(*) FROM embeddings GROUP BY task, dim ORDER BY count(*) DESC")]


def stored_vector(conn: sqlite3.Connection, sha256: str,
                  task: str) -> npt.NDArray[np.float32] | None:
    """The vector the index holds for these bytes (a photo already indexed), if any."""
    row = conn.execute("SELECT e.vector FROM results r JOIN embeddings e ON e.result_id = r.id "
                       "WHERE r.sha256 = ? AND e.task = ? LIMIT 1", (sha256, task)).fetchone()
    return None if row is None else np.frombuffer(row[0], dtype=np.float32).copy()


def like(conn: sqlite3.Connection, vector: npt.NDArray[np.float32], task: str,
         limit: int = DEFAULT_LIMIT, chunk_rows: int = CHUNK_ROWS) -> list[Hit]:
    """The indexed photos most like ``vector`` (cosine similarity, exact), best first."""
    query = np.asarray(vector, dtype=np.float32).reshape(-1)
    norm = float(np.linalg.norm(query))
    if norm == 0.0 or not np.isfinite(norm):
        raise SearchError("the photo's embedding is all zeros or not a number: nothing is "
                          "like it")
    query = query / norm
    best_ids = np.empty(0, dtype=np.int64)
    best_scores = np.empty(0, dtype=np.float32)
    last_id = -1
    while True:
        rows = conn.execute(
            "SELECT id, result_id, vector FROM embeddings WHERE task = ? AND dim = ? AND id > ? "
            "ORDER BY id LIMIT ?", (task, int(query.size), last_id, chunk_rows)).fetchall()
        if not rows:
            break
        last_id = int(rows[-1][0])
        matrix = np.frombuffer(b"".join(row[2] for row in rows), dtype=np.float32).reshape(
            len(rows), query.size)
        norms = np.linalg.norm(matrix, axis=1)
        scores = (matrix @ query) / np.where(norms > 0, norms, np.inf)
        ids = np.fromiter((row[1] for row in rows), dtype=np.int64, count=len(rows))
        best_ids = np.concatenate([best_ids, ids])
        best_scores = np.concatenate([best_scores, scores.astype(np.float32)])
        if best_scores.size > limit:
            keep = np.argpartition(-best_scores, limit - 1)[:limit]
            best_ids, best_scores = best_ids[keep], best_scores[keep]
    order = sorted(range(best_ids.size), key=lambda i: (-float(best_scores[i]),
                                                        int(best_ids[i])))
    return describe(conn, [Hit(int(best_ids[i]), float(best_scores[i]), "similar")
                           for i in order])


def describe(conn: sqlite3.Connection, hits: list[Hit], labels: int = 3) -> list[Hit]:
    """``hits`` with where each photo is and its best labels."""
    for hit in hits:
        row = conn.execute("SELECT name, photo, sha256 FROM results WHERE id = ?",
                           (hit.result_id,)).fetchone()
        if row is None:
            continue
        hit.name = os.fsdecode(row[0])
        hit.photo = None if row[1] is None else os.fsdecode(row[1])
        hit.sha256 = str(row[2])
        hit.labels = [(str(label), float(score)) for label, score in conn.execute(
            "SELECT n.label, l.score FROM labels l JOIN label_names n ON n.id = l.name_id "
            "WHERE l.result_id = ? ORDER BY l.score DESC LIMIT ?", (hit.result_id, labels))]
    return [hit for hit in hits if hit.name]
