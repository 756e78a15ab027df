"""Two inboxd configurations against each other, in turns in one run: where the cores go idle.

Daemons A and B run side by side on the same photos (each started as ``bench.peer_vs_inboxd``
starts one: the shipped config with only its folders changed, a warm-up backlog, the cached
runtime serving, idle before the turns), and take floods in rounds of A, B, B, A: each round's
ratio is B's mean files/s ÷ A's, so a steady drift of the machine cancels. Per flood it reads
what the cores did, from /proc:

* ``cores``: the daemon's processes' CPU (user + system) over the flood's wall time (first
  file dropped → last result);
* ``idle``: the machine's idle share over the same span (``/proc/stat``: the cores nobody used,
  this bench's own result watcher and other sessions included);
* ``runq_ms``: per file, the time the daemon's threads and its workers were runnable but
  waiting for a core (``/proc/<tid>/schedstat``): the cost of the processes crowding each other;
* ``batch_p50``: the median of the stats records' ``BATCH_SIZE_P50`` (a record a second);
* ``stages_ms``: the medians of the results' own ``timings_ms`` (queue wait, preprocess, batch
  wait, inference).

``--a`` / ``--b`` change one config key each (``SECTION.KEY=VALUE``, repeatable), e.g.
``--b batch.max_delay_ms=0``.

    python -m bench.inboxd_ab --format 0.3MP --count 400 --rounds 3 --b batch.max_delay_ms=0
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench.measure import drop_many
from bench.peer_vs_inboxd import (
    FORMATS,
    SCALES,
    WORK_DIR,
    parse_changes,
    photos_for,
    start_inboxd,
    steady_files_per_s,
)
from bench.procs import CLK_TCK, HELPERS, cpu_s, helpers
from bench.scenarios import Running
from support.harness import logger

log = logger("bench-ab")

BENCH_DIR = Path(__file__).resolve().parent


def machine_idle_s() -> tuple[float, float]:
    """(idle + iowait seconds summed over the cores, all seconds summed) from /proc/stat."""
    with open("/proc/stat") as stat:
        fields = [int(x) for x in stat.readline().split()[1:]]
    return (fields[3] + fields[4]) / CLK_TCK, sum(fields[:8]) / CLK_TCK


def runq_wait_s(pid: int) -> dict[str, float]:
    """Seconds the threads of the daemon, and of each kind of helper, have waited runnable for
    a core (schedstat's second field), live threads only."""
    found: dict[str, float] = {}
    for member, kind in [(pid, "daemon"), *helpers(pid)]:
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{member}/task"):
                with contextlib.suppress(OSError, ValueError, IndexError):
                    with open(f"/proc/{member}/task/{task}/schedstat") as schedstat:
                        waited_ns = int(schedstat.read().split()[1])
                    found[kind] = found.get(kind, 0.0) + waited_ns / 1e9
    return found


def renice_workers(pid: int, increment: int) -> None:
    """Every thread of the daemon's decode workers ``increment`` nicer (niceness is per
    thread on Linux)."""
    for member, kind in helpers(pid):
        if kind != HELPERS["inboxd.decode.worker_child"]:
            continue
        for task in os.listdir(f"/proc/{member}/task"):
            tid = int(task)
            os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + increment)


def flood(run: Running, photos: list[Any], count: int, prefix: str) -> dict[str, Any]:
    pid = run.daemon.pid
    cpu_before, runq_before = cpu_s(pid), runq_wait_s(pid)
    idle_before, all_before = machine_idle_s()
    timings_from = len(run.results.timings)
    started = time.monotonic()
    names = drop_many(photos, run.inbox, count, prefix)
    if not run.results.wait_for(names, 120 + count * 2):
        run.daemon.check_alive()
        raise RuntimeError(f"inboxd: results missing after a flood of {count}")
    stamps = [run.results.seen[name] for name in names]
    wall_s = max(stamps) - started
    batch_sizes = [float(r["BATCH_SIZE_P50"]) for r in
                   run.daemon.stats_between(started, max(stamps)) if "BATCH_SIZE_P50" in r]
    idle_after, all_after = machine_idle_s()
    cpu_after, runq_after = cpu_s(pid), runq_wait_s(pid)
    cpu = {k: cpu_after[k] - cpu_before.get(k, 0.0) for k in cpu_after}
    runq = {k: runq_after[k] - runq_before.get(k, 0.0) for k in runq_after}
    cores_total = os.cpu_count() or 1
    return {
        "files_per_s": round(steady_files_per_s(stamps), 2),
        "cpu_ms_per_file": {k: round(v * 1000 / count, 2) for k, v in cpu.items()},
        "cpu_ms": round(sum(cpu.values()) * 1000 / count, 2),
        "cores": round(sum(cpu.values()) / wall_s, 2),
        "idle": round((idle_after - idle_before) / max(all_after - all_before, 1e-9)
                      * cores_total, 2),
        "runq_ms": {k: round(v * 1000 / count, 2) for k, v in runq.items()},
        "batch_p50": statistics.median(batch_sizes) if batch_sizes else None,
        "stages_ms": {stage: v["p50"] for stage, v in
                      run.results.stage_summary(timings_from).items()},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    labels = {f.size: f for f in FORMATS if f.fmt == "jpg" and f.resize is None}
    parser.add_argument("--format", choices=sorted(labels), default="0.3MP")
    parser.add_argument("--count", type=int, default=400, help="files per flood")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of A, B, B, A")
    parser.add_argument("--a", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--b", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--a-env", action="append", default=[], metavar="NAME=VALUE",
                        help="an environment variable for A's daemon only (PYTHONPATH=... "
                             "runs another checkout's code)")
    parser.add_argument("--b-env", action="append", default=[], metavar="NAME=VALUE",
                        help="an environment variable for B's daemon only")
    parser.add_argument("--b-nice-workers", type=int, default=0, metavar="N",
                        help="renice B's decode workers by N once it is idle (an experiment "
                             "on scheduling before any code for it)")
    parser.add_argument("--out", type=Path, default=BENCH_DIR / "out" / "ab.json")
    args = parser.parse_args()
    fmt = labels[args.format]
    photos = photos_for(fmt)
    sizes = SCALES["full"]
    runs: dict[str, Running] = {}
    started: dict[str, dict[str, Any]] = {}
    try:
        for side, changes in (("A", args.a), ("B", args.b)):
            runs[side], startup = start_inboxd(WORK_DIR / f"ab-{side}", photos, sizes["warm"],
                                               sizes["settle_s"],
                                               {"stats": {"interval_s": 1},
                                                **parse_changes(changes)},
                                               dict(e.split("=", 1) for e in
                                                    getattr(args, f"{side.lower()}_env")))
            started[side] = startup.get("started", {})
            if side == "B" and args.b_nice_workers:
                renice_workers(runs[side].daemon.pid, args.b_nice_workers)
            log(f"{side} ({', '.join(changes) or 'defaults'}): READY {startup['ready_s']} s, "
                f"runtime {startup['runtime_state'] or 'as started'}")
        floods: dict[str, list[dict[str, Any]]] = {"A": [], "B": []}
        ratios = []
        for round_ in range(args.rounds):
            rates: dict[str, list[float]] = {"A": [], "B": []}
            for turn, side in enumerate("ABBA"):
                result = flood(runs[side], photos, args.count, f"r{round_}{turn}{side}-")
                floods[side].append(result)
                rates[side].append(result["files_per_s"])
                log(f"round {round_} {side}: {json.dumps(result)}")
            ratios.append(statistics.mean(rates["B"]) / statistics.mean(rates["A"]))
            log(f"round {round_}: B ÷ A {ratios[-1]:.3f} (load {os.getloadavg()[0]:.1f})")
    finally:
        for running in runs.values():
            running.stop()
    summary = {"format": fmt.label, "count": args.count, "a": args.a, "b": args.b,
               "ratios": [round(r, 3) for r in ratios], "floods": floods, "started": started}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1) + "\n")
    for side in "AB":
        med = {key: round(statistics.median(f[key] for f in floods[side]), 2)
               for key in ("files_per_s", "cpu_ms", "cores", "idle")}
        print(f"{side} ({', '.join(getattr(args, side.lower())) or 'defaults'}): {med}")
    print(f"B ÷ A per round: {', '.join(f'{r:.3f}' for r in ratios)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
