"""No loop without a way out (issue 33, class 1): a name no variant can take — a folder named
like a result or like a done file, a link where a folder should be — is that file's own
permanent problem, with an outcome that says so, never a search for the next name or a retry
for ever. Every name loop is bounded; the daemon stays responsive (later files get results,
SIGTERM stops it)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from inboxd.config import load_config
from inboxd.files import renames
from inboxd.files.lifecycle import Lifecycle
from inboxd.files.results import ResultEntry
from inboxd.pipeline.wiring import Pipeline

from support.harness import sha256_hex as sha
from tests.conftest import drop, make_image, read_json, wait_until, write_config
from tests.fakes import FakeModel
from tests.files.test_retry import fail


def backlog(config_path: Path, timeout_s: float = 60) -> None:
    """``inboxd once`` in-process with the fake model, given ``timeout_s`` to end: before the
    fix, every case here went on for ever."""
    pipeline = Pipeline(load_config(config_path), FakeModel())  # type: ignore[arg-type]

    async def bounded() -> None:
        await asyncio.wait_for(pipeline.process_backlog(), timeout_s)

    asyncio.run(bounded())


@pytest.mark.slow  # a costly run: `make test`, not the fast tier
def test_a_folder_named_like_a_result_fails_its_files_and_the_daemon_goes_on(
        tmp_path: Path, daemon_factory) -> None:
    """``a.png`` is done (results/a.png.json); then a folder ``a.png.json/`` with a photo in
    it arrives: its result would be results/a.png.json/p.png.json, under a file. The lookup
    of an earlier result read "Not a directory" as "a result with no sha256" and tried the
    next variant name for ever: the commit process spun, later files got no result, and
    SIGTERM did not stop the daemon."""
    config = write_config(tmp_path, inbox={"settle_ms": 0})
    inbox = tmp_path / "inbox"
    daemon = daemon_factory(config)
    daemon.wait_for("ready")
    drop(make_image(tmp_path / "src" / "a.png"), inbox)
    wait_until((tmp_path / "done" / "a.png").exists, 60, "a.png done")
    folder = tmp_path / "src" / "a.png.json"
    make_image(folder / "p.png", color=(1, 2, 3))
    os.rename(folder, inbox / "a.png.json")
    drop(make_image(tmp_path / "src" / "later.png", color=(9, 9, 9)), inbox)
    wait_until((tmp_path / "results" / "later.png.json").exists, 60, "a later file's result")
    report_path = tmp_path / "failed" / "a.png.json" / "p.png.error.json"
    # The report comes first, the file follows it.
    wait_until((tmp_path / "failed" / "a.png.json" / "p.png").exists, 60, "p.png's outcome")
    assert "not a folder" in read_json(report_path)["reason"]
    assert read_json(tmp_path / "results" / "a.png.json")["source"] == "a.png"  # untouched
    assert daemon.stop(timeout_s=30) == 0


@pytest.mark.slow  # a costly run: `make test`, not the fast tier
def test_a_folder_named_like_a_done_file_fails_its_files(tmp_path: Path) -> None:
    """done/x.png is a file, then a folder x.png/ with photos arrives: done/x.png/a.png can
    never be made. The move failed with ENOTDIR and was retried like a full disk, for ever
    (given back to the inbox after the last attempt, taken again, …)."""
    config = write_config(tmp_path, inbox={"settle_ms": 0},
                          retry={"max_attempts": 3, "backoff_initial_ms": 10,
                                 "backoff_max_ms": 20})
    inbox = tmp_path / "inbox"
    make_image(inbox / "x.png")
    backlog(config)
    assert (tmp_path / "done" / "x.png").is_file()
    make_image(inbox / "x.png" / "a.png", color=(5, 6, 7))
    make_image(inbox / "x.png" / "b.png", color=(7, 6, 5))
    backlog(config)
    for name in ("a.png", "b.png"):
        report = read_json(tmp_path / "failed" / "x.png" / f"{name}.error.json")
        assert report["permanent"] is True
        assert "done/x.png/" in report["reason"] and "not a folder" in report["reason"]
        assert (tmp_path / "failed" / "x.png" / name).is_file()
    assert not [p for p in inbox.rglob("*.png") if p.is_file()]
    # No result for a file that could not be done: it failed before one was written.
    assert not (tmp_path / "results" / "x.png").exists()


def test_a_durable_result_whose_done_folder_became_a_file_ends_in_failed(
        tmp_path: Path) -> None:
    """The same bytes again (its result is there: a duplicate), and done/x/ has become a file
    since: the move can never happen. Its outcome is failed/, saying where its result is."""
    config = write_config(tmp_path, inbox={"settle_ms": 0})
    inbox, done = tmp_path / "inbox", tmp_path / "done"
    make_image(inbox / "x" / "a.png")
    data = (inbox / "x" / "a.png").read_bytes()
    backlog(config)
    assert (done / "x" / "a.png").is_file()
    os.rename(done / "x", done / "elsewhere")
    (done / "x").write_bytes(b"a file where the folder was")
    (inbox / "x").mkdir(exist_ok=True)  # the emptied folder may still be there
    (inbox / "x" / "a.png").write_bytes(data)
    backlog(config)
    report = read_json(tmp_path / "failed" / "x" / "a.png.error.json")
    assert "its result is filed" in report["reason"] and "not a folder" in report["reason"]
    assert (tmp_path / "failed" / "x" / "a.png").read_bytes() == data


def test_a_failure_whose_failed_folder_is_a_file_is_filed_at_the_top(tmp_path: Path) -> None:
    """failed/x.png is a failed file; then x.png/bad.png fails too: failed/x.png/ cannot be
    made, so it is filed as failed/bad.png with its report (which says where it came from)."""
    config = write_config(tmp_path, inbox={"settle_ms": 0})
    inbox = tmp_path / "inbox"
    (inbox / "x.png").write_bytes(b"not an image")
    backlog(config)
    assert (tmp_path / "failed" / "x.png").is_file()
    (inbox / "x.png").mkdir()
    (inbox / "x.png" / "bad.png").write_bytes(b"not an image either")
    backlog(config)
    assert (tmp_path / "failed" / "bad.png").read_bytes() == b"not an image either"
    assert read_json(tmp_path / "failed" / "bad.png.error.json")["rel"] == "x.png/bad.png"


def test_retry_into_a_dangling_link_ends_and_keeps_the_file(tmp_path: Path) -> None:
    """inbox/sub is a dangling link: the rename found no folder, made it, got EEXIST (the
    link), and took FileExistsError for "this name is taken": the next name, for ever."""
    config_path = write_config(tmp_path)
    config = load_config(config_path)
    failed = fail(config, "sub/x.jpg", b"bytes", "not an image", "decode")
    (tmp_path / "inbox" / "sub").symlink_to(tmp_path / "nowhere")
    done = subprocess.run([sys.executable, "-m", "inboxd", "retry", "-c", str(config_path),
                           "--all"], capture_output=True, text=True, timeout=60)
    assert "symbolic link" in done.stderr, done.stderr
    assert failed.read_bytes() == b"bytes"
    assert Path(f"{failed}.error.json").exists()
    assert not (tmp_path / "nowhere").exists()


def test_every_name_loop_ends(tmp_path: Path) -> None:
    """With every name taken, each search gives up with NoFreeName (a bounded loop), instead
    of searching on."""
    config = load_config(write_config(tmp_path))
    lifecycle = Lifecycle(config)
    lifecycle.prepare()
    results = tmp_path / "results"
    data = b"bytes"
    digest = sha(data)
    variants = list(renames.key_variants("k.png", digest[:12]))
    assert len(variants) == renames.MAX_NAME_VARIANTS
    for name in variants:  # each name holds another file's result
        (results / f"{name}.json").write_text(json.dumps({"sha256": "0" * 64}))
    assert lifecycle.results.find("k.png", digest) is None
    [refused] = lifecycle.results.write([ResultEntry("k.png", digest, lambda n: {})])
    assert isinstance(refused, renames.NoFreeName)
    target = tmp_path / "taken"
    target.mkdir()
    for name in renames.name_variants("t.png", "tok"):
        (target / name).write_bytes(b"")
    (tmp_path / "new").write_bytes(b"new")
    with pytest.raises(renames.NoFreeName):
        renames.place_inside(tmp_path / "new", None, target, "t.png", "tok")
    assert (tmp_path / "new").read_bytes() == b"new"
