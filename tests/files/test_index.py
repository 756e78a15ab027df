"""The search index (``files.index``): rows follow the result files through the group commit,
a kill between its steps is repaired at start-up, an index that cannot be written holds the
batch back like a full disk, and search finds photos by label, by text and by likeness."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from inboxd.config import INDEX_FILENAME, load_config
from inboxd.files import index_search
from inboxd.files.commits import CommitEntry, Outputs, commit
from inboxd.files.index import IndexUnusable, connect
from inboxd.files.index_rows import row_of, top_outcome
from inboxd.files.layout import layout_problems
from inboxd.files.lifecycle import Lifecycle

from tests.conftest import REPO, write_config
from tests.index_check import assert_index_matches_results


def lifecycle_for(root: Path, **sections: Any) -> Lifecycle:
    lifecycle = Lifecycle(load_config(write_config(root, **sections)))
    lifecycle.prepare()
    lifecycle.lock_instance()
    return lifecycle


def entry(lifecycle: Lifecycle, name: str, data: bytes, document: dict[str, Any],
          vector: np.ndarray | None = None) -> CommitEntry:
    inbox = lifecycle.config.inbox.paths[0]
    (inbox / name).write_bytes(data)
    path = lifecycle.claim(inbox, name)
    assert path is not None
    sha = hashlib.sha256(data).hexdigest()
    return CommitEntry(name, sha, {"source": name, "sha256": sha, **document,
                                   "image": {"width": 100, "height": 50},
                                   "completed_at": "2026-12-05T00:00:00Z"},
                       path, os.path.join(inbox, name), vector)


def labels(*pairs: tuple[str, float]) -> dict[str, Any]:
    return {"model": "m", "top_k": [{"label": label, "index": n, "score": score}
                                    for n, (label, score) in enumerate(pairs)]}


def test_rows_follow_the_results_of_each_commit(tmp_path: Path) -> None:
    lifecycle = lifecycle_for(tmp_path)
    outputs = Outputs.of(lifecycle)
    assert outputs.start() is not None
    committed = commit(lifecycle, [
        entry(lifecycle, "cat.jpg", b"cat", labels(("tabby cat", 0.9), ("lynx", 0.05))),
        entry(lifecycle, "dog.jpg", b"dog", labels(("beagle", 0.7), ("tabby cat", 0.1)))],
        outputs.index, outputs.sidecars)
    assert committed.error is None and committed.notes == []
    assert assert_index_matches_results(tmp_path / "results") == 2
    conn = connect(tmp_path / "results" / INDEX_FILENAME, read_only=True)
    hits = index_search.by_words(conn, ["cat"])
    # Ranked by the label's score; the photo is where after_success put it.
    assert [(h.photo, h.match) for h in hits] == [
        (str(tmp_path / "done" / "cat.jpg"), "label tabby cat"),
        (str(tmp_path / "done" / "dog.jpg"), "label tabby cat")]
    assert hits[0].score == pytest.approx(0.9)
    assert index_search.by_words(conn, ["beagle"])[0].labels[0] == ("beagle", 0.7)
    assert index_search.by_words(conn, ["unicorn"]) == []


def test_every_task_section_is_indexed_and_text_is_ranked(tmp_path: Path) -> None:
    """The sections several tasks write (labels, detections, OCR text, embeddings) are read
    by what they hold, whatever the task is called."""
    lifecycle = lifecycle_for(tmp_path)
    outputs = Outputs.of(lifecycle)
    receipt = {"model": "m", "labels": labels(("menu", 0.8)),
               "objects": {"detections": [{"label": "person", "index": 0, "score": 0.9,
                                           "box": [10, 5, 60, 45]}]},
               "text": {"full_text": "TOTAL 12.50 EUR\nthank you for shopping at Mercado",
                        "lines": []}}
    sign = {"model": "m", "text": {"full_text": "Mercado Central open daily"}}
    commit(lifecycle, [entry(lifecycle, "receipt.jpg", b"r", receipt),
                       entry(lifecycle, "sign.jpg", b"s", sign)],
           outputs.index, outputs.sidecars)
    assert assert_index_matches_results(tmp_path / "results") == 2
    conn = connect(tmp_path / "results" / INDEX_FILENAME, read_only=True)
    assert {h.name for h in index_search.by_words(conn, ["mercado"])} == {"receipt.jpg",
                                                                         "sign.jpg"}
    # Only the sign says "central"; both words must be there.
    assert [h.name for h in index_search.by_words(conn, ["mercado", "central"])] == ["sign.jpg"]
    assert index_search.by_words(conn, ["person"])[0].match == "label person"
    boxes = conn.execute("SELECT task, label, x0, y0, x1, y1 FROM detections").fetchall()
    assert boxes == [("objects", "person", 10.0, 5.0, 60.0, 45.0)]
    assert top_outcome({"top_k": [{"label": "cat", "score": 0.5}]}) == "cat 0.50"


def test_like_ranks_a_photos_own_copy_first(tmp_path: Path) -> None:
    lifecycle = lifecycle_for(tmp_path)
    outputs = Outputs.of(lifecycle)
    rng = np.random.default_rng(7)
    vectors = rng.standard_normal((50, 16)).astype(np.float32)
    commit(lifecycle, [entry(lifecycle, f"p{n}.jpg", f"p{n}".encode(), {"model": "m",
                             "embedding": {"file": f"p{n}.jpg.npy", "dim": 16}}, vectors[n])
                       for n in range(50)], outputs.index, outputs.sidecars)
    assert assert_index_matches_results(tmp_path / "results") == 50
    conn = connect(tmp_path / "results" / INDEX_FILENAME, read_only=True)
    assert index_search.embedding_tasks(conn) == [("model", 16, 50)]
    near = vectors[17] + 0.01 * rng.standard_normal(16).astype(np.float32)
    for chunk_rows in (7, 4096):  # across chunk boundaries as within one
        hits = index_search.like(conn, near, "model", limit=5, chunk_rows=chunk_rows)
        assert hits[0].name == "p17.jpg" and hits[0].score > 0.99
        assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)
        assert len(hits) == 5
    sha = hashlib.sha256(b"p3").hexdigest()
    stored = index_search.stored_vector(conn, sha, "model")
    assert stored is not None and stored.tolist() == vectors[3].tolist()


@pytest.mark.parametrize("kill_at", ["after_begin", "after_results", "after_moves"])
def test_a_kill_between_the_steps_is_repaired_at_start(tmp_path: Path, kill_at: str) -> None:
    """The commit process killed part-way: the next start resolves what was pending, so the
    index equals the result files whatever the instant."""
    lifecycle = lifecycle_for(tmp_path)
    outputs = Outputs.of(lifecycle)
    outputs.start()
    index = outputs.index
    assert index is not None
    batch = [entry(lifecycle, "a.jpg", b"a", labels(("apple", 0.8))),
             entry(lifecycle, "b.jpg", b"b", labels(("banana", 0.6)))]
    index.begin([(e.key, e.sha256, e.inbox_path) for e in batch])
    if kill_at != "after_begin":
        from inboxd.files.commits import filed_document
        from inboxd.files.results import ResultEntry

        results = lifecycle.results
        filed = results.write([ResultEntry(e.key, e.sha256,
                                           lambda n, e=e: filed_document(results, e.key,
                                                                         e.document, n))
                               for e in batch])
        if kill_at == "after_moves":
            for e, got in zip(batch, filed, strict=True):
                assert not isinstance(got, OSError)
                lifecycle.finish_success(e.claimed, got[0], e.inbox_path, e.sha256)
    index.close()  # the kill: nothing more of this commit reaches the index
    again = Outputs.of(lifecycle)
    note = again.start()
    expected = 0 if kill_at == "after_begin" else 2
    assert note is not None and ("2 in flight at a kill resolved" in note), note
    assert assert_index_matches_results(tmp_path / "results") == expected
    conn = connect(tmp_path / "results" / INDEX_FILENAME, read_only=True)
    assert conn.execute("SELECT count(*) FROM pending").fetchone()[0] == 0
    if expected:
        assert index_search.by_words(conn, ["banana"])[0].photo == str(
            tmp_path / "done" / "b.jpg")


def test_a_lost_index_is_rebuilt_from_the_result_files_at_start(tmp_path: Path) -> None:
    lifecycle = lifecycle_for(tmp_path)
    outputs = Outputs.of(lifecycle)
    commit(lifecycle, [entry(lifecycle, f"{n}.jpg", bytes([n]), labels(("x", 0.5)))
                       for n in range(5)], outputs.index, outputs.sidecars)
    outputs.close()
    for extra in ("", "-wal", "-shm"):
        path = tmp_path / "results" / f"{INDEX_FILENAME}{extra}"
        if path.exists():
            path.unlink()
    note = Outputs.of(lifecycle).start()
    assert note is not None and "rebuilt from 5 result files (a new index)" in note
    assert assert_index_matches_results(tmp_path / "results") == 5
    # A damaged file is kept aside, and the index made again.
    (tmp_path / "results" / INDEX_FILENAME).write_bytes(b"not a database" * 100)
    for extra in ("-wal", "-shm"):
        (tmp_path / "results" / f"{INDEX_FILENAME}{extra}").unlink(missing_ok=True)
    note = Outputs.of(lifecycle).start()
    assert note is not None and "rebuilt from 5" in note
    assert list((tmp_path / "results").glob(f"{INDEX_FILENAME}.damaged-*"))


def test_an_index_that_cannot_be_written_holds_the_batch_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A full disk under the index is backpressure, as one under the results is: no result
    is filed, nothing moves, the error comes back for the files to wait (h-disk's path)."""
    lifecycle = lifecycle_for(tmp_path)
    outputs = Outputs.of(lifecycle)
    index = outputs.index
    assert index is not None

    def full(*_args: Any) -> None:
        raise IndexUnusable(errno.ENOSPC, "the index: database or disk is full")

    monkeypatch.setattr(index, "begin", full)
    batch = [entry(lifecycle, "a.jpg", b"a", labels(("apple", 0.8)))]
    committed = commit(lifecycle, batch, index, None)
    assert committed.error is not None and committed.error.errno == errno.ENOSPC
    assert not list((tmp_path / "results").glob("*.json"))
    assert os.path.exists(batch[0].claimed), "the claimed file stays to be tried again"


def test_sqlite_full_is_enospc(tmp_path: Path) -> None:
    lifecycle = lifecycle_for(tmp_path)
    outputs = Outputs.of(lifecycle)
    outputs.start()
    index = outputs.index
    assert index is not None
    index.conn.execute("PRAGMA max_page_count = 1")  # no room for one more page
    with pytest.raises(OSError) as raised:
        index.begin([("k", "0" * 64, "/in/k")] * 1000)
    assert raised.value.errno == errno.ENOSPC


def test_keep_moves_an_older_row_aside_with_its_result(tmp_path: Path) -> None:
    lifecycle = lifecycle_for(tmp_path, inbox={"after_success": "keep"})
    outputs = Outputs.of(lifecycle)
    commit(lifecycle, [entry(lifecycle, "a.jpg", b"old", labels(("apple", 0.8)))],
           outputs.index, outputs.sidecars)
    commit(lifecycle, [entry(lifecycle, "a.jpg", b"new", labels(("pear", 0.8)))],
           outputs.index, outputs.sidecars)
    assert assert_index_matches_results(tmp_path / "results") == 2
    conn = connect(tmp_path / "results" / INDEX_FILENAME, read_only=True)
    assert index_search.by_words(conn, ["pear"])[0].photo == str(tmp_path / "inbox" / "a.jpg")


def test_an_index_on_a_network_filesystem_is_refused(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    config = load_config(write_config(tmp_path))
    monkeypatch.setattr("inboxd.files.layout.statfs_type", lambda _path: 0x6969)  # NFS
    problems = [p for p in layout_problems(config) if p.startswith("index:")]
    assert len(problems) == 1 and "nfs" in problems[0] and "index: null" in problems[0]
    path = write_config(tmp_path)  # (its sections' None removes a key: null is written here)
    path.write_text(path.read_text() + "index: null\n")
    off = load_config(path)
    assert off.index is None
    assert not [p for p in layout_problems(off) if p.startswith("index:")]


def test_rows_of_todays_result_format(tmp_path: Path) -> None:
    document = {"source": "a.jpg", "sha256": "ab" * 32, "model": "efficientnet_lite0",
                "top_k": [{"label": "tabby, tabby cat", "index": 281, "score": 0.7}],
                "image": {"width": 640, "height": 480}, "instance": "default",
                "completed_at": "t"}
    row = row_of("a.jpg", document, "/done/a.jpg", lambda _f: None)
    assert [(label.task, label.label, label.score) for label in row.labels] == [
        ("model", "tabby, tabby cat", 0.7)]
    assert (row.width, row.height, row.model) == (640, 480, "efficientnet_lite0")


def test_search_and_index_commands(tmp_path: Path) -> None:
    lifecycle = lifecycle_for(tmp_path)
    outputs = Outputs.of(lifecycle)
    commit(lifecycle, [entry(lifecycle, "cat.jpg", b"c", labels(("tabby cat", 0.9)))],
           outputs.index, outputs.sidecars)
    outputs.close()
    config = tmp_path / "inboxd.yaml"

    def inboxd(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "inboxd", *args, "-c", str(config)],
                              capture_output=True, text=True, cwd=REPO, timeout=120,
                              env={**os.environ, "PYTHONPATH": str(REPO / "daemon")})

    found = inboxd("search", "--json", "cat")
    assert found.returncode == 0, found.stderr
    assert [hit["photo"] for hit in json.loads(found.stdout)] == [str(tmp_path / "done" /
                                                                      "cat.jpg")]
    table = inboxd("search", "tabby")
    assert table.returncode == 0 and "label tabby cat" in table.stdout
    assert str(tmp_path / "done" / "cat.jpg") in table.stdout
    assert inboxd("search", "unicorn").returncode == 1
    like = inboxd("search", "--like", str(tmp_path / "done" / "cat.jpg"))
    assert like.returncode == 78 and "--like needs embeddings" in like.stderr
    (tmp_path / "results" / INDEX_FILENAME).unlink()
    rebuilt = inboxd("index", "--rebuild")
    assert rebuilt.returncode == 0 and "rebuilt from 1 result files" in rebuilt.stdout
    assert assert_index_matches_results(tmp_path / "results") == 1


@pytest.mark.daemon
@pytest.mark.timeout(400)
@pytest.mark.slow  # a costly run: `make test`, not the fast tier
def test_like_finds_a_photos_own_picture_first_with_the_real_model(tmp_path: Path) -> None:
    """The built-in model embedding (``model.output: embed``): ``search --like`` embeds a
    re-encoded, smaller copy of one filed photo, which is not in the index, and ranks that
    photo first; and says why not when the model classifies."""
    from PIL import Image

    from support.photos import photo_paths

    photos = dict(list(photo_paths().items())[:5])
    assert len(photos) == 5
    config = write_config(tmp_path, inbox={"settle_ms": 0},
                          model={"output": "embed", "device": "cpu"})
    for name, path in photos.items():
        with Image.open(path) as image:
            image.convert("RGB").save(tmp_path / "inbox" / f"{name}.jpg", quality=95)
    env = {**os.environ, "PYTHONPATH": str(REPO / "daemon")}
    done = subprocess.run([sys.executable, "-m", "inboxd", "once", "-c", str(config)],
                          capture_output=True, text=True, cwd=REPO, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    target = sorted(photos)[2]
    with Image.open(tmp_path / "done" / f"{target}.jpg") as image:
        image.resize((image.width * 2 // 3, image.height * 2 // 3)).save(
            tmp_path / "copy.jpg", quality=70)
    found = subprocess.run([sys.executable, "-m", "inboxd", "search", "--json", "--like",
                            str(tmp_path / "copy.jpg"), "-c", str(config)],
                           capture_output=True, text=True, cwd=REPO, timeout=300, env=env)
    assert found.returncode == 0, found.stderr[-3000:]
    hits = json.loads(found.stdout)
    assert hits[0]["photo"] == str(tmp_path / "done" / f"{target}.jpg"), hits
    assert len(hits) == 5 and hits[0]["score"] > hits[1]["score"]
