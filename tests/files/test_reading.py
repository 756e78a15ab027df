"""Reading an input: its sha256 in chunks, a small file's bytes kept for the decoder, and a
claimed file reopened through the daemon's descriptor of it."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import pytest
from inboxd.files.reading import HASH_CHUNK_BYTES, READ_CLAIMED_FLAGS, hash_stream, open_input
from inboxd.item import PermanentError, TransientError


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


def test_a_claimed_file_is_reopened_through_the_daemon_s_descriptor(tmp_path: Path) -> None:
    """``.processing`` moved away and a link put in its place: by path the file cannot be
    reached (a transient error, an attempt used up); through the descriptor the daemon
    holds, it is the very file, whatever its folder is called now. A FIFO held so is still
    refused on the reopened descriptor, without blocking."""
    inbox = tmp_path / "inbox"
    claimed = inbox / ".processing" / "default" / "a.jpg"
    claimed.parent.mkdir(parents=True)
    claimed.write_bytes(b"the photo")
    held = os.open(claimed, READ_CLAIMED_FLAGS)
    try:
        os.rename(inbox / ".processing", inbox / ".moved")
        os.symlink(tmp_path, inbox / ".processing")
        with pytest.raises(TransientError, match="symbolic link"):
            open_input(claimed)
        with open_input(claimed, opened=f"/proc/{os.getpid()}/fd/{held}") as handle:
            assert handle.read() == b"the photo"
    finally:
        os.close(held)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    held = os.open(fifo, READ_CLAIMED_FLAGS)
    try:
        with pytest.raises(PermanentError, match="not a regular file"):
            open_input(fifo, opened=f"/proc/{os.getpid()}/fd/{held}")
    finally:
        os.close(held)
