"""Embedding vectors as ``<results_dir>/<key>.npy``, next to the JSON result that describes them.

Written the way ``Lifecycle.write_results`` writes the JSON: a temp file in the results' temp
folder, fsynced, renamed into place. The vectors of a batch are made durable (their folders
fsynced) *before* the batch's JSON is written: a rerun treats an existing JSON with the same
sha256 as done, so a JSON must never exist without its vector.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt

from inboxd.files.lifecycle import fsync_dir
from inboxd.files.names import output_path

SUFFIX = ".npy"


def embedding_path(results_dir: Path, key: str) -> Path:
    return output_path(results_dir, key, SUFFIX)


def write_embeddings(
    results_dir: Path, tmp_dir: Path, vectors: Sequence[tuple[str, npt.NDArray[np.float32]]]
) -> None:
    folders: set[Path] = set()
    for key, vector in vectors:
        tmp = tmp_dir / f"{os.getpid()}-{abs(hash(key)):x}{SUFFIX}.tmp"
        # 0o644 like the JSON results: never writable by others, whatever the umask.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        with os.fdopen(fd, "wb") as handle:
            # allow_pickle=False: a float32 array never needs it, and readers can refuse it.
            np.save(handle, vector, allow_pickle=False)
            handle.flush()
            os.fsync(handle.fileno())
        final = embedding_path(results_dir, key)
        final.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, final)
        folders.add(final.parent)
    for folder in folders:
        fsync_dir(folder)
