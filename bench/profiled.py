"""The daemon under cProfile, every thread of it, and where its time goes per file.

    python -m bench.profiled OUT.prof run -c CONFIG   (the arguments after OUT are inboxd's)

Each thread the daemon starts gets its own profiler on its first event (``threading.setprofile``
hands the hook over before the thread runs), the main thread one from the start; when ``inboxd``
returns (SIGTERM: it drains and exits) they are merged into OUT. cProfile makes every Python call
dearer, so the times are for proportions; the call *counts* are exact (hops per file).

``summary`` turns OUT into per-file figures by concern: event-loop hops, executor hand-offs,
decode IPC, fsyncs, other syscalls, JSON, logging, stats, and time spent waiting.
"""

from __future__ import annotations

import cProfile
import marshal
import pstats
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

_main = cProfile.Profile()
_profiles: list[cProfile.Profile] = []
_lock = threading.Lock()

Key = tuple[str, int, str]  # pstats' (file, line, function)
PIPE_READ = "<built-in method posix.read>"
PIPE_WAIT = PIPE_READ + " of a helper's pipe"  # see _split_pipe_reads
# Context.run's own time is the anyio worker thread blocked in watchfiles' Rust watcher.
WAITING = ("<method 'poll' of 'select.epoll' objects>", "<method 'run' of '_contextvars.Context' "
           "objects>", "<method 'acquire' of '_thread.lock' "
           "objects>", "<method 'get' of '_queue.SimpleQueue' objects>",
           "<built-in method posix.waitpid>", "<built-in method time.sleep>",
           "<method 'poll' of 'select.poll' objects>", PIPE_WAIT)


def category(key: Key) -> str:
    file, _line, function = key
    if function in WAITING:
        return "waiting (idle, locks, poll)"
    if function in ("<built-in method posix.fsync>", "<built-in method posix.fdatasync>",
                    "<built-in method posix.sync>"):
        return "fsync"
    if file.endswith(("inboxd/wire.py", "decode/pool.py", "decode/replies.py")) or function in (
            "<built-in method posix.readv>",):
        return "decode IPC (pipes, frames)"
    if "asyncio" in file and ("base_events" in file or "events.py" in file or "selector" in file):
        return "event loop (hops)"
    if "concurrent/futures" in file or "asyncio/futures" in file or file.endswith(
            "threading.py"):
        return "executor hand-offs, futures"
    if "asyncio" in file:
        return "asyncio tasks, queues, events"
    if function.startswith(("<built-in method posix.", "<built-in method io.open")):
        return "other syscalls"
    if "/json/" in file or function.startswith("{built-in method _json") or "_json" in function:
        return "JSON"
    if "/logging/" in file or file.endswith("inboxd/logs.py") or "journal" in file:
        return "logging"
    if file.endswith("inboxd/stats.py"):
        return "stats"
    if "torch" in file or "numpy" in file:
        return "model (torch, numpy)"
    if "inboxd" in file:
        return "inboxd code"
    return "other"


# Calls counted per file: (label, function name ends with / file ends with).
COUNTED = (
    ("event-loop iterations", "_run_once", "base_events.py"),
    ("executor hand-offs (run_in_executor)", "run_in_executor", "base_events.py"),
    ("call_soon_threadsafe", "call_soon_threadsafe", "base_events.py"),
    ("fsync", "<built-in method posix.fsync>", ""),
    ("fdatasync", "<built-in method posix.fdatasync>", ""),
    ("rename", "<built-in method posix.rename>", ""),
    ("rename_noreplace", "rename_noreplace", "renames.py"),
    ("open", "<built-in method posix.open>", ""),
    ("stat/lstat/fstat", "stat>", ""),
    ("json.dumps", "dumps", "json/__init__.py"),
    ("log records (emit)", "emit", "inboxd/logs.py"),
    ("frames sent (decode, commit)", "frame", "inboxd/wire.py"),  # send() makes one too
    ("frames received (decode, commit)", "recv", "inboxd/wire.py"),
)


Raw = dict[Key, tuple[int, int, float, float, Any]]


def load(path: str) -> Raw:
    with open(path, "rb") as handle:
        raw: Raw = marshal.load(handle)
    return raw


def summary(path: str, files: int, top: int = 15) -> dict[str, Any]:
    """Per-file ms by category (profiled time), exact call counts per file, top functions:
    what ``path`` holds minus ``path``.base (the snapshot taken when the flood started)."""
    after, before = load(path), load(path + ".base")
    raw: Raw = {}
    for key, (cc, nc, tt, ct, callers) in after.items():
        cc0, nc0, tt0, ct0, _ = before.get(key, (0, 0, 0.0, 0.0, None))
        if nc > nc0 or tt > tt0:
            raw[key] = (cc - cc0, nc - nc0, tt - tt0, ct - ct0, callers)
    _split_pipe_reads(raw, before)
    by_category: dict[str, float] = {}
    for key, (_cc, _nc, tottime, _ct, _callers) in raw.items():
        name = category(key)
        by_category[name] = by_category.get(name, 0.0) + tottime
    busy = sum(v for k, v in by_category.items() if not k.startswith("waiting"))
    counts = {}
    for label, function, file in COUNTED:
        calls = sum(nc for key, (_cc, nc, _t, _ct, _c) in raw.items()
                    if key[2].endswith(function) and key[0].endswith(file))
        counts[label] = round(calls / files, 2)
    ranked = sorted(raw.items(), key=lambda kv: kv[1][2], reverse=True)
    top_items = [{"function": f"{k[0].rsplit('/', 2)[-1] if k[0] != '~' else ''}:{k[1]}({k[2]})",
                  "category": category(k), "calls_per_file": round(v[1] / files, 2),
                  "ms_per_file": round(v[2] * 1000 / files, 4)}
                 for k, v in ranked if category(k) != "waiting (idle, locks, poll)"][:top]
    return {
        "files": files,
        "busy_ms_per_file": round(busy * 1000 / files, 3),
        "ms_per_file": {k: round(v * 1000 / files, 4)
                        for k, v in sorted(by_category.items(), key=lambda kv: -kv[1])},
        "share_of_busy": {k: round(v / busy, 3) for k, v in by_category.items()
                          if not k.startswith("waiting") and busy > 0},
        "calls_per_file": counts,
        "top": top_items,
    }


def _split_pipe_reads(raw: Raw, before: Raw) -> None:
    """A read that ``wire.py`` makes is a blocking read of a helper process's pipe: nearly all
    of its time is waiting for that process to answer. Moved to a key of its own, filed as
    waiting; any other read stays where it was."""
    for key in [k for k in raw if k[2] == PIPE_READ]:
        cc, nc, tt, ct, callers = raw[key]
        earlier = (before.get(key) or (0, 0, 0.0, 0.0, {}))[4]
        calls, waited = 0, 0.0
        for caller, (c_nc, _c_cc, c_tt, _c_ct) in callers.items():
            if caller[0].endswith("inboxd/wire.py"):
                c_nc0, _cc0, c_tt0, _ct0 = earlier.get(caller, (0, 0, 0.0, 0.0))
                calls, waited = calls + c_nc - c_nc0, waited + c_tt - c_tt0
        raw[key] = (cc - calls, nc - calls, tt - waited, ct - waited, callers)
        raw[(key[0], key[1], PIPE_WAIT)] = (calls, calls, waited, waited, {})


def _snapshot(path: str) -> None:
    """Every profiler's figures so far, merged, into ``path`` (pstats' marshal format). Called
    in the main thread holding the GIL: the other threads' profilers cannot change meanwhile."""
    merged: Raw = {}
    with _lock:
        profiles = [_main, *_profiles]
    for profile in profiles:
        profile.snapshot_stats()
        stats: Raw = getattr(profile, "stats")  # noqa: B009 (set by snapshot_stats, untyped)
        for key, (cc, nc, tt, ct, callers) in stats.items():
            cc0, nc0, tt0, ct0, callers0 = merged.get(key, (0, 0, 0.0, 0.0, {}))
            add_callers: Callable[[Any, Any], Any] = getattr(pstats, "add_callers")  # noqa: B009
            merged[key] = (cc + cc0, nc + nc0, tt + tt0, ct + ct0,
                           add_callers(callers0, callers))
    with open(path, "wb") as handle:
        marshal.dump(merged, handle)


def _start_thread_profile(*_args: object) -> None:
    profile = cProfile.Profile()
    with _lock:
        _profiles.append(profile)
    profile.enable()  # replaces this hook, in this thread only


def main() -> int:
    out, argv = sys.argv[1], sys.argv[2:]
    from inboxd.cli import main as inboxd_main

    # SIGUSR1 (the bench sends it as the flood starts): the baseline to subtract.
    signal.signal(signal.SIGUSR1, lambda _sig, _frame: _snapshot(out + ".base"))
    threading.setprofile(_start_thread_profile)
    _main.enable()
    try:
        code = inboxd_main(argv)
    finally:
        _main.disable()
        threading.setprofile(None)
        _snapshot(out)
    return code


if __name__ == "__main__":
    sys.exit(main())
