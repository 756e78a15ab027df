"""The watcher at its boundary (a scripted awatch, a fake statfs): polling where inotify cannot
see, the inotify watch limit, folders that arrive whole, names it will not take. The real
watchfiles runs end to end in tests/test_inputs_e2e.py."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import watchfiles
from inboxd.files.names import NameFilter
from inboxd.pipeline import watcher as watcher_module
from inboxd.pipeline.event_buffer import EventBuffer
from inboxd.pipeline.watch_events import ChangeSet
from inboxd.pipeline.watcher import Watcher
from inboxd.stats import Stats

from tests.conftest import make_image
from tests.fakes import ScriptedWatch

FUSE, EXT4 = 0x65735546, 0xEF53


def watcher_for(inbox: Path, watch: object, magic: int = EXT4,
                buffer: EventBuffer | None = None) -> Watcher:
    return Watcher([inbox], True, NameFilter(None), buffer or EventBuffer(64), Stats(), 3600,
                   lambda: 0.0, watch,  # type: ignore[arg-type]
                   statfs=lambda _: magic)


async def run_until(watcher: Watcher, done: asyncio.Event | None = None) -> None:
    task = asyncio.create_task(watcher.run_watch())
    if done is not None:
        await asyncio.wait_for(done.wait(), 10)
    else:
        await asyncio.sleep(0.05)
    watcher.stop()
    await asyncio.wait_for(task, 10)


@pytest.mark.parametrize(("magic", "polled"), [(FUSE, True), (EXT4, False)])
def test_statfs_picks_polling_for_a_fuse_inbox(tmp_path: Path, magic: int, polled: bool) -> None:
    async def scenario() -> list[bool]:
        watch = ScriptedWatch()
        watcher = watcher_for(tmp_path / "inbox", watch, magic)
        await run_until(watcher, watch.started)
        return watch.polling

    assert asyncio.run(scenario()) == [polled]


def test_the_inotify_watch_limit_is_said_once_and_the_inbox_polled(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    calls: list[bool] = []
    polling = asyncio.Event()

    async def limited(*paths: Path, recursive: bool, stop_event: asyncio.Event,
                      force_polling: bool = False, poll_delay_ms: int = 1000,
                      ) -> AsyncIterator[ChangeSet]:
        calls.append(force_polling)
        if not force_polling:
            raise OSError("OS file watch limit reached. about [\"/x\"]")  # as watchfiles says
        polling.set()
        await stop_event.wait()
        yield set()

    async def scenario() -> None:
        await run_until(watcher_for(tmp_path / "inbox", limited), polling)

    with caplog.at_level(logging.WARNING, logger="inboxd"):
        asyncio.run(scenario())
    assert calls == [False, True]
    said = [r.getMessage() for r in caplog.records if "watch limit" in r.getMessage()]
    assert len(said) == 1 and "fs.inotify.max_user_watches" in said[0]


def test_a_folder_that_arrives_is_walked_at_once_to_any_depth(tmp_path: Path) -> None:
    inbox = tmp_path / "inbox"
    album = inbox / "album"
    for rel in ("a.jpg", "2024/b.png", "2024/06/c.HEIC", "@eaDir/a.jpg/SYNOPHOTO.jpg",
                "__MACOSX/2024/._b.png"):
        make_image(album / rel, fmt="PNG")
    (album / "2024" / "notes.txt").write_text("not an image")
    (album / ".DS_Store").write_bytes(b"\0")
    buffer = EventBuffer(64)
    watch = ScriptedWatch()
    watcher = watcher_for(inbox, watch, buffer=buffer)

    async def scenario() -> None:
        task = asyncio.create_task(watcher.run_watch())
        await watch.started.wait()
        watch.push(album)  # inotify reports the folder only, not what it holds

        async def filled() -> None:
            while buffer.size < 3:
                await asyncio.sleep(0.01)

        with contextlib.suppress(TimeoutError):  # the asserts below say what was missed
            await asyncio.wait_for(filled(), 5)
        watch.push(album)  # said again (a rescan, a second event): still said once
        await asyncio.sleep(0.05)
        watcher.stop()
        await task

    asyncio.run(scenario())
    assert {Path(p).relative_to(album).as_posix() for p in buffer._entries} == {
        "a.jpg", "2024/b.png", "2024/06/c.HEIC"}
    counters = watcher.stats.counters
    assert (counters.ignored, counters.ignored_names) == (1, 1), "notes.txt, once"


def test_a_file_event_for_a_name_not_taken_is_said_once(tmp_path: Path) -> None:
    inbox = tmp_path / "inbox"
    watcher = watcher_for(inbox, ScriptedWatch())
    (inbox / "sub").mkdir(parents=True)
    for name in ("notes.txt", ".DS_Store", "x.jpg.part"):
        (inbox / "sub" / name).write_text("x")
    changes = {(watchfiles.Change.added, f"{inbox}/sub/{n}")
               for n in ("notes.txt", ".DS_Store", "x.jpg.part")}
    watcher._take(changes)
    watcher._take(changes)
    assert watcher.stats.counters.ignored_names == 1


def test_the_watcher_pauses_while_a_backlog_waits_on_disk(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """watchfiles keeps every change until it is next asked: during a flood that outlasts the
    buffer the scans find the files, so the watcher stops, and starts again only once a scan
    has taken everything (then rescans soon, for its start gap)."""
    inbox = tmp_path / "inbox"
    files = [make_image(inbox / f"f{n}.png") for n in range(5)]
    watch = ScriptedWatch()
    buffer = EventBuffer(2)
    watcher = watcher_for(inbox, watch, buffer=buffer)
    monkeypatch.setattr(watcher_module, "WATCHER_RESTART_DELAY_S", 0.02)

    async def scenario() -> None:
        task = asyncio.create_task(watcher.run_watch())
        await watch.started.wait()
        watch.push(*files)  # 2 admitted, 3 deferred
        await asyncio.sleep(0.1)
        assert watcher.paused and watcher.backlog_on_disk
        # Ten restart delays (shortened for the test): a restart would have come by now.
        await asyncio.sleep(10 * watcher_module.WATCHER_RESTART_DELAY_S)
        assert len(watch.polling) == 1, "a paused watcher must not be restarted"
        for _ in range(2):  # intake takes the two; a scan still defers, so still paused
            buffer.pop_due(0.0)
        await watcher.scan()
        assert watcher.paused and len(watch.polling) == 1
        while buffer.pop_due(0.0) is not None:  # all taken and done: the next scan completes
            pass
        for path in files:
            path.unlink()
        await watcher.scan()
        assert not watcher.paused and watcher._rescan_soon
        await asyncio.wait_for(_until(lambda: len(watch.polling) == 2), 5)
        watcher.stop()
        await asyncio.wait_for(task, 10)

    asyncio.run(scenario())
    assert watcher.stats.counters.deferred >= 3


async def _until(condition: Callable[[], bool]) -> None:
    while not condition():
        await asyncio.sleep(0.01)
