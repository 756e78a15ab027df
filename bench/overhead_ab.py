"""The overhead scenario as an A/B: two source trees, one daemon each, floods in turns.

Daemons A and B (each importing ``inboxd`` from its own tree's ``daemon/``) run side by side,
idle while the other is flooded; each round floods A, B, B, A (``count`` files each), so a
steady drift of this shared machine's speed falls on both alike. Per round B ÷ A is mean B ÷
mean A files/s, and B ÷ A of the CPU per file (all three processes: the steadier figure); CPU per
file by process and thread is the median over the floods.

    python -m bench.overhead_ab --a var/ab-base --b . [--count 3000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path
from typing import Any

from bench.offline import emit
from bench.overhead import (
    WORK_DIR,
    Scratch,
    make_inputs,
    measured_flood,
    start,
    wait_for_quiet_disk,
    write_config,
)
from support.harness import logger

log = logger("overhead-ab")


def summary(floods: list[dict[str, Any]]) -> dict[str, Any]:
    kinds = floods[0]["cpu_ms_per_file"]
    threads = floods[0]["cpu_ms_per_file_by_thread"]
    return {
        "files_per_s": [f["files_per_s"] for f in floods],
        "cpu_ms_per_file": {k: round(statistics.median(f["cpu_ms_per_file"][k] for f in floods),
                                     3) for k in kinds},
        "cpu_ms_per_file_total": round(statistics.median(
            sum(f["cpu_ms_per_file"].values()) for f in floods), 3),
        "by_thread": {k: round(statistics.median(
            f["cpu_ms_per_file_by_thread"].get(k, 0.0) for f in floods), 3) for k in threads},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a", type=Path, required=True, help="tree A (has daemon/inboxd)")
    parser.add_argument("--b", type=Path, required=True, help="tree B")
    parser.add_argument("--count", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    program, labels, photos = make_inputs(WORK_DIR)
    scratch = Scratch()
    try:
        disk = wait_for_quiet_disk(scratch)
        runs = {}
        for name, tree in (("A", args.a), ("B", args.b)):
            root = scratch(name)
            runs[name] = start(root, write_config(root, program, labels),
                               code=tree.resolve() / "daemon")
        floods: dict[str, list[dict[str, Any]]] = {"A": [], "B": []}
        ratios: list[float] = []
        cpu_ratios: list[float] = []  # per round B ÷ A of the CPU per file, all processes
        try:
            for round_ in range(args.rounds):
                rates: dict[str, list[float]] = {"A": [], "B": []}
                for turn, name in enumerate("ABBA"):
                    figures = measured_flood(runs[name], photos, args.count,
                                             f"r{round_}t{turn}{name}-")
                    floods[name].append(figures)
                    rates[name].append(figures["files_per_s"])
                ratios.append(round(statistics.mean(rates["B"]) / statistics.mean(rates["A"]), 3))
                cpu = {name: statistics.mean(sum(f["cpu_ms_per_file"].values())
                                             for f in floods[name][-2:]) for name in "AB"}
                cpu_ratios.append(round(cpu["B"] / cpu["A"], 3))
                log(f"round {round_}: B/A {ratios[-1]} (A {rates['A']}, B {rates['B']}), "
                    f"CPU per file B/A {cpu_ratios[-1]}, "
                    f"load {os.getloadavg()[0]:.1f}")
        finally:
            for run in runs.values():
                run.stop()
        emit({"disk": disk, "count": args.count, "ratios": ratios,
              "ratio_median": statistics.median(ratios), "cpu_ratios": cpu_ratios,
              "cpu_ratio_median": statistics.median(cpu_ratios),
              "A": summary(floods["A"]), "B": summary(floods["B"])})
    finally:
        scratch.clean()


if __name__ == "__main__":
    main()
