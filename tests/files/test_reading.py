"""Reading an input: its sha256 in chunks, and a small file's bytes kept for the decoder."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
from inboxd.files.reading import HASH_CHUNK_BYTES, hash_stream, open_input
from inboxd.item import PermanentError


@pytest.mark.parametrize("size_bytes", [0, 1, 2048, HASH_CHUNK_BYTES, HASH_CHUNK_BYTES + 1,
                                        3 * HASH_CHUNK_BYTES + 7])
def test_the_bytes_come_back_only_when_one_read_took_them_all(tmp_path: Path,
                                                              size_bytes: int) -> None:
    data = np.random.default_rng(size_bytes).bytes(size_bytes)
    (tmp_path / "f").write_bytes(data)
    with open_input(tmp_path / "f") as handle:
        sha256, total, whole = hash_stream(handle)
    assert (sha256, total) == (hashlib.sha256(data).hexdigest(), size_bytes)
    assert whole == (data if size_bytes <= HASH_CHUNK_BYTES else None)


def test_a_file_larger_than_allowed_is_refused_while_read(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"x" * (HASH_CHUNK_BYTES + 1))
    with open_input(tmp_path / "f") as handle, pytest.raises(PermanentError, match="grew past"):
        hash_stream(handle, max_bytes=HASH_CHUNK_BYTES)
