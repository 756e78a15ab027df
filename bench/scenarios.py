"""What the bench does to a running inboxd: a flood, single drops into an idle daemon, an
open-loop arrival process, and a flood too big to drain that is watched for a fixed window.

Every figure is taken from outside, as a user would see it: a file counts when its result is
present in the results folder. Memory is the daemon process's VmRSS, sampled every 20 ms.
"""

from __future__ import annotations

import os
import random
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.measure import ResultWatcher, drop, drop_many, drop_name, percentile
from bench.photos import Photo
from bench.procs import RssSampler, write_config
from support.daemon import DaemonProcess

MB = 1024 * 1024
FAST_POLL_S = 0.002  # single drops: the poll is the measurement's resolution
FLOOD_POLL_S = 0.01


def ms_summary(values_s: Sequence[float]) -> dict[str, float]:
    values = [v * 1000 for v in values_s]
    return {f"p{q}": round(percentile(values, q), 1) for q in (50, 90, 99)} | {
        "max": round(max(values, default=float("nan")), 1)}


@dataclass
class Running:
    """One daemon with its memory sampler and result watcher, in its own folder."""

    root: Path
    daemon: DaemonProcess
    rss: RssSampler
    results: ResultWatcher
    idle_rss: int

    @property
    def inbox(self) -> Path:
        return self.root / "inbox"

    def stop(self) -> dict[str, Any]:
        started = time.monotonic()
        code = self.daemon.stop()
        stop_s = time.monotonic() - started
        self.rss.stop()
        self.results.stop()
        return {"exit_code": code, "stop_s": round(stop_s, 2)}


def start(root: Path, overrides: dict[str, dict[str, Any]] | None = None) -> Running:
    """A fresh daemon in an empty ``root``; returns once it is READY and has been idle for one
    stats tick (so ``idle_rss`` is the settled figure, not mid-warm-up)."""
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    return watch(root, DaemonProcess(write_config(root, overrides)))


def watch(root: Path, daemon: DaemonProcess, consume: bool = True) -> Running:
    """``daemon`` (just started in ``root``) with its memory sampler and result watcher
    (``consume``: see ``ResultWatcher``), once it is READY and has been idle for one stats
    tick."""
    rss = RssSampler(daemon.pid)
    results = ResultWatcher(root / "results", FLOOD_POLL_S, consume)
    try:
        daemon.wait_ready()
        daemon.next_stats()
    except BaseException:
        daemon.kill()
        raise
    return Running(root, daemon, rss, results, rss.now())


def rss_series(rss: RssSampler, start_s: float, end_s: float, idle: int,
               points: int = 200) -> list[tuple[float, float]]:
    """(seconds since ``start_s``, MB above idle), thinned to about ``points`` samples."""
    samples = [(t, v) for t, v in list(rss.samples) if start_s <= t <= end_s]
    step = max(1, len(samples) // points)
    return [(round(t - start_s, 2), round((v - idle) / MB, 1)) for t, v in samples[::step]]


def _layer_figures(run: Running, start_s: float, end_s: float) -> dict[str, Any]:
    """High-water marks and put-wait from the daemon's own stats records in a time span."""
    figures: dict[str, Any] = {}
    for key in ("QUEUE_HIGH_WATER", "PREPROCESS_CACHE_HIGH_WATER", "EVENT_BUFFER_HIGH_WATER",
                "BATCH_SIZE_P50", "PUT_WAIT_MS_P50", "PUT_WAIT_MS_P99",
                "CUDA_RESERVED_BYTES", "CUDA_ALLOCATED_BYTES"):
        value = run.daemon.stat_max(key, start_s, end_s)
        if value is not None:
            figures[key.lower()] = value
    reserved = run.daemon.stat_values("CUDA_RESERVED_BYTES", start_s, end_s)
    if reserved:  # flat after warm-up is the claim: keep the low end too
        figures["cuda_reserved_bytes_min"] = min(reserved)
    return figures


def flood(run: Running, photos: Sequence[Photo], count: int, timeout_s: float,
          prefix: str = "flood") -> dict[str, Any]:
    """Drop ``count`` files at once; files/s from the first drop to the last result."""
    timings_from = len(run.results.timings)
    started = run.rss.mark()
    names = drop_many(photos, run.inbox, count, prefix)
    dropped_s = time.monotonic() - started
    if not run.results.wait_for(names, timeout_s):
        run.daemon.check_alive()
        done = sum(name in run.results.seen for name in names)
        raise RuntimeError(f"flood: only {done}/{count} results after {timeout_s:.0f} s")
    ended = max(run.results.seen[name] for name in names)
    peak = run.rss.span_peak(started, ended)
    run.daemon.next_stats()  # one more record, so the stats cover the whole flood
    return {
        "count": count,
        "drop_s": round(dropped_s, 2),
        "elapsed_s": round(ended - started, 2),
        "files_per_s": round(count / (ended - started), 2),
        "peak_rss_above_idle": peak - run.idle_rss,
        "idle_rss": run.idle_rss,
        "rss_series": rss_series(run.rss, started, ended, run.idle_rss),
        "stages_ms": run.results.stage_summary(timings_from),
        **_layer_figures(run, started, time.monotonic()),
    }


def single_drops(run: Running, photos: Sequence[Photo], count: int) -> dict[str, Any]:
    """``count`` files one at a time into an idle daemon: drop → result present."""
    run.results.interval_s = FAST_POLL_S
    done_dir = run.root / "done"
    latencies: list[float] = []
    timings_from = len(run.results.timings)
    for index in range(count):
        photo = photos[index % len(photos)]
        name = drop_name(index, photo, "single")
        started = time.monotonic()
        drop(photo, run.inbox, name)
        if not run.results.wait_for([name], 60):
            run.daemon.check_alive()
            raise RuntimeError(f"single drop {name}: no result within 60 s")
        latencies.append(run.results.seen[name] - started)
        # Idle again only once the source has moved on (the last step after the result).
        deadline = time.monotonic() + 30
        while not (done_dir / name).exists() and time.monotonic() < deadline:
            time.sleep(FAST_POLL_S)
    run.results.interval_s = FLOOD_POLL_S
    return {"count": count, "latency_ms": ms_summary(latencies),
            "stages_ms": run.results.stage_summary(timings_from)}


def open_loop(run: Running, photos: Sequence[Photo], rate_per_s: float, duration_s: float,
              seed: int, prefix: str) -> dict[str, Any]:
    """Poisson arrivals at ``rate_per_s`` for ``duration_s`` (the arrival process never waits
    for the daemon), then wait for every result. Latency is drop → result present."""
    rng = random.Random(seed)
    schedule, at = [], rng.expovariate(rate_per_s)
    while at < duration_s:
        schedule.append(at)
        at += rng.expovariate(rate_per_s)
    dropped: dict[str, float] = {}
    rss_before = run.rss.now()  # retained heap since start-up shows as idle_now - idle
    started = run.rss.mark()
    for index, due in enumerate(schedule):
        delay = started + due - time.monotonic()
        if delay > 0:
            time.sleep(delay)  # pacing the arrival schedule, not waiting for an outcome
        photo = photos[index % len(photos)]
        name = drop_name(index, photo, prefix)
        dropped[name] = time.monotonic()
        drop(photo, run.inbox, name)
    arrivals_end = time.monotonic()
    backlog_s = len(schedule) / rate_per_s
    if not run.results.wait_for(dropped, backlog_s + 120):
        run.daemon.check_alive()
        raise RuntimeError(f"open loop at {rate_per_s:.1f}/s: results missing")
    ended = max(run.results.seen[name] for name in dropped)
    peak = run.rss.span_peak(started, ended)
    latencies = [run.results.seen[name] - t for name, t in dropped.items()]
    return {
        "rate_per_s": round(rate_per_s, 2),
        "files": len(schedule),
        "arrival_s": round(arrivals_end - started, 2),
        "drain_s": round(ended - arrivals_end, 2),
        "completed_per_s": round(len(schedule) / (ended - started), 2),
        "latency_ms": ms_summary(latencies),
        "peak_rss_above_idle": peak - run.idle_rss,
        "rss_before_above_idle": rss_before - run.idle_rss,
        **_layer_figures(run, started, ended),
    }


def big_flood(run: Running, photos: Sequence[Photo], count: int,
              window_s: float) -> dict[str, Any]:
    """Drop ``count`` files at once and watch memory for ``window_s`` (or until all are done,
    if sooner): a backlog this size takes too long to drain on a CPU, and what matters is that
    it waits on disk, not in RAM. Then stop the daemon and count that no file went missing."""
    started = run.rss.mark()
    names = drop_many(photos, run.inbox, count, "big")
    dropped_s = time.monotonic() - started
    all_done = run.results.wait_for(names, window_s)
    ended = time.monotonic()
    run.daemon.check_alive()
    completed = sum(name in run.results.seen for name in names)
    peak = run.rss.span_peak(started, ended)
    figures = _layer_figures(run, started, ended)
    stopped = run.stop()
    left = _count(run.inbox, "big")
    moved = _count(run.root / "done", "big")
    failed = _count(run.root / "failed", "big") - _count(run.root / "failed", "big", ".json")
    return {
        "count": count,
        "drop_s": round(dropped_s, 2),
        "window_s": round(ended - started, 2),
        "all_done": all_done,
        "completed_in_window": completed,
        "peak_rss_above_idle": peak - run.idle_rss,
        "idle_rss": run.idle_rss,
        "rss_series": rss_series(run.rss, started, ended, run.idle_rss),
        "after_stop": {**stopped, "left_in_inbox": left, "done": moved, "failed": failed,
                       "missing": count - left - moved - failed},
        **figures,
    }


def _count(folder: Path, prefix: str, suffix: str = "") -> int:
    """Files under ``folder`` (claimed ones included) that the bench dropped."""
    return sum(1 for _dir, _subdirs, files in os.walk(folder) for name in files
               if name.startswith(prefix) and name.endswith(suffix))
