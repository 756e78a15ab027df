"""``inboxd search`` and ``inboxd index``: the search index (``files.index``) from the command
line. Search opens the index read-only, so it runs beside the daemons that write it."""

from __future__ import annotations

import hashlib
import json
import sqlite3
import sys
from pathlib import Path

import numpy as np
import numpy.typing as npt

from inboxd import logs
from inboxd.config import Config
from inboxd.files import index_search
from inboxd.files.index import ResultIndex, as_os_error, connect
from inboxd.files.index_rows import SINGLE_TASK
from inboxd.files.index_search import Hit, SearchError
from inboxd.files.lifecycle import Lifecycle

EX_NOT_FOUND = 1  # nothing matched, as grep says it


def search(config: Config, words: list[str], like: Path | None, task: str | None,
           limit: int, as_json: bool) -> int:
    conn = open_for_search(config)
    with as_os_error(config.index or Path()):
        if like is not None:
            hits = search_like(config, conn, like, task, limit)
        else:
            hits = index_search.by_words(conn, words, limit)
    if as_json:
        print(json.dumps([hit.as_json() for hit in hits], ensure_ascii=False))
    else:
        print_table(hits)
    return 0 if hits else EX_NOT_FOUND


def open_for_search(config: Config) -> sqlite3.Connection:
    if config.index is None:
        raise SearchError("the index is off in this config (index: null): remove that line "
                          "(or give index: a path) and run `inboxd index --rebuild -c FILE`")
    if not config.index.exists():
        raise SearchError(f"no index at {config.index}: the daemon makes it as it files "
                          "results; `inboxd index --rebuild -c FILE` makes it from the result "
                          "files there are")
    return connect(config.index, read_only=True)


def search_like(config: Config, conn: sqlite3.Connection, photo: Path, task: str | None,
                limit: int) -> list[Hit]:
    tasks = index_search.embedding_tasks(conn)
    if not tasks:
        raise SearchError(
            "--like needs embeddings, and the index holds none: the configured model "
            f"{'embeds' if config.model.output == 'embed' else 'classifies'}"
            f"{'' if config.model.output == 'embed' else ' (model.output: classify, the default)'}"
            ". Set model.output: embed (the built-in model embeds too) and let the daemon "
            "file the photos again, or search by words")
    names = sorted({name for name, _dim, _count in tasks})
    if task is None:
        if len(names) > 1:
            raise SearchError(f"several tasks embed ({', '.join(names)}): choose one with "
                              "--task NAME")
        task = names[0]
    elif task not in names:
        raise SearchError(f"no embeddings of task {task!r} in the index (those there: "
                          f"{', '.join(names)})")
    try:
        data = photo.read_bytes()
    except OSError as exc:
        raise SearchError(f"cannot read {photo}: {exc.strerror or exc}") from exc
    vector = index_search.stored_vector(conn, hashlib.sha256(data).hexdigest(), task)
    if vector is None:
        vector = embed(config, data, task)
    return index_search.like(conn, vector, task, limit)


def embed(config: Config, data: bytes, task: str) -> npt.NDArray[np.float32]:
    """The photo embedded with the configured model, as the daemon would embed it."""
    if task != SINGLE_TASK or config.model.output != "embed":
        raise SearchError(
            f"the photo is not in the index, and the configured model does not embed it for "
            f"task {task!r} (model.output: {config.model.output}): give a photo the daemon has "
            "filed, or configure the model that made the index's embeddings")
    from inboxd.decode.pillow import decode_image
    from inboxd.item import PermanentError
    from inboxd.models.engines.choice import load_here
    from inboxd.models.model import Model

    model = load_here(config.model)
    if not isinstance(model, Model):  # (a detector or a reader: never with output: embed)
        raise SearchError("the configured model does not embed: --like needs one that does")
    try:
        pixels = decode_image(data, model.spec, config.preprocess.max_image_pixels).pixels
    except PermanentError as exc:
        raise SearchError(f"cannot decode the photo: {exc}") from exc
    return np.asarray(model.embed([pixels])[0].vector, dtype=np.float32)


def print_table(hits: list[Hit]) -> None:
    if not hits:
        print("no photo found", file=sys.stderr)
        return
    print(f"{'score':>6}  {'match':<32}  photo")
    for hit in hits:
        match = hit.match if len(hit.match) <= 32 else hit.match[:31] + "…"
        where = hit.photo if hit.photo is not None else f"(deleted; result {hit.name}.json)"
        print(logs.shown(f"{hit.score:6.3f}  {match:<32}  {where}"))


def index_command(config: Config, rebuild: bool) -> int:
    if config.index is None:
        raise SearchError("the index is off in this config (index: null)")
    index = ResultIndex(config, Lifecycle(config).results)
    try:
        if rebuild:
            print(f"{config.index}: rebuilt from {index.rebuild()} result files")
        else:
            print(f"{config.index}: {index.start()}")
    finally:
        index.close()
    return 0
