"""Group commit's building blocks: temps made durable together, and renames that make their
folder only when it is missing."""

from __future__ import annotations

import errno
import json
import math
import os
from pathlib import Path

import pytest
from inboxd.files import durable
from inboxd.files.renames import rename_into

# What results, reports and ledgers hold, and what json.dumps makes of the odd values among them.
ODD_DOCUMENT = {
    "source": "photo.jpg", "size_bytes": 1585, "big": 123456789012345678901234567890,
    "score": 0.1 + 0.2, "tiny": 5e-324, "negative_zero": -0.0, "nan": math.nan,
    "infinite": -math.inf, "name": "ünïcode \u2028 and a lone surrogate \udcff",
    "top_k": [{"label": "class1", "index": 1, "score": 0.164416}],
    "nested": {"empty": {}, "list": [], "flags": [True, False, None]},
    "ünï-key": 1, 7: "an int key",
}


def test_json_bytes_is_json_dumps_per_value_one_key_per_line() -> None:
    """The result file's bytes: each top-level value exactly as json.dumps writes it, on a
    line of its own (the encoder is called without json.dumps's layers around it)."""
    lines = durable.json_bytes(ODD_DOCUMENT).decode().splitlines()
    assert lines[0] == "{" and lines[-1] == "}"
    assert lines[1:-1] == [f"  {json.dumps(str(key))}: {json.dumps(value)}"
                           + ("," if index < len(ODD_DOCUMENT) - 1 else "")
                           for index, (key, value) in enumerate(ODD_DOCUMENT.items())]
    assert durable.json_bytes({}) == b"{}\n"
    assert json.loads(durable.json_bytes({"a": [1, {"b": "c"}]})) == {"a": [1, {"b": "c"}]}
    with pytest.raises(TypeError, match="not JSON serializable"):
        durable.json_bytes({"path": Path("/x")})


def test_write_tmps_writes_every_blob_and_syncs_each(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[int] = []
    real = os.fdatasync

    def counting(fd: int) -> None:
        synced.append(fd)
        real(fd)

    monkeypatch.setattr(durable.os, "fdatasync", counting)
    blobs = [f"result {n}\n".encode() for n in range(40)]
    temps = durable.write_tmps(tmp_path / "tmp", blobs, ".json")
    assert [Path(t).read_bytes() for t in temps] == blobs
    assert all(Path(t).parent == tmp_path / "tmp" for t in temps)
    assert len(synced) == len(blobs)  # every file's own fdatasync: no shared barrier assumed


def test_write_tmps_leaves_nothing_when_a_sync_fails(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    calls = 0

    def failing(fd: int) -> None:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(durable.os, "fdatasync", failing)
    with pytest.raises(OSError):
        durable.write_tmps(tmp_path / "tmp", [b"x"] * 20, ".json")
    assert list((tmp_path / "tmp").iterdir()) == []


def test_rename_into_makes_a_missing_folder_and_reports_a_missing_source(tmp_path: Path) -> None:
    source = tmp_path / "a.json"
    source.write_text("{}")
    target = tmp_path / "deep" / "er" / "a.json"
    rename_into(source, target)
    assert target.read_text() == "{}" and not source.exists()
    with pytest.raises(FileNotFoundError):
        rename_into(source, target.with_name("b.json"))  # the folder is there: source gone
    other = tmp_path / "b.json"
    other.write_text("{}")
    with pytest.raises(FileExistsError):
        rename_into(other, target)  # never over an existing result


def test_a_probe_of_room_leaves_nothing_and_never_writes_through_a_link(tmp_path: Path) -> None:
    from inboxd.files.durable import TmpDir, probe_room
    from inboxd.files.safe_paths import LinkedFolder
    (tmp_path / "results").mkdir()
    probe_room(TmpDir(tmp_path / "results", (".tmp", "default")))
    assert list((tmp_path / "results" / ".tmp" / "default").iterdir()) == []
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "inbox" / ".processing" / ".tmp").mkdir(parents=True)
    (tmp_path / "inbox" / ".processing" / ".tmp" / "default").symlink_to(elsewhere)
    with pytest.raises(LinkedFolder):
        probe_room(TmpDir(tmp_path / "inbox", (".processing", ".tmp", "default"), own=True))
    assert list(elsewhere.iterdir()) == []
