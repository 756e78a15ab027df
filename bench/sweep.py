"""``make bench-sweep``: inboxd under a short flood for a grid of capacities, to choose them.

The article's own advice: maxsize=2 is a starting point, not a law; measure per-item memory,
model time and acceptable wait, then pick a capacity you can explain. Per point: files/s,
in-pipeline latency (claimed → inferred, from the results' own stage timings: what a slot in
front of the model costs in wait), drop → result latency, peak RSS above idle and, on a GPU,
peak CUDA reserved. Ends with one recommendation: the smallest setting within 5% of the best
throughput, and what each extra slot costs.

Points run in a fixed shuffled order, so that the machine's load drifting over the sweep does
not line up with one axis of the grid.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench import scenarios
from bench.measure import percentile
from bench.photos import build_corpus
from bench.run import BENCH_DIR, CORPUS_DIR, MIX_TEXT, MIXES, WORK_DIR, load_avg, log

MB = 1024 * 1024
WITHIN = 0.95
CONFIRM = 4  # leading points measured a second time before recommending


@dataclass(frozen=True)
class Grid:
    queues: tuple[int, ...]
    caches: tuple[int, ...]
    batches: tuple[int, ...]
    flood: int
    mix: str


GRIDS = {
    # 20 points of ~15-25 s each on 2 busy cores. Cut to keep it under 15 minutes: cache and
    # batch get two values each (4/16 items, 4/8 per batch); queue gets all five.
    "cpu": Grid((1, 2, 4, 8, 16), (4, 16), (4, 8), flood=240, mix="mixed"),
    "gpu": Grid((1, 2, 4, 8, 16), (16, 64), (32, 64), flood=4000, mix="small-jpeg"),
    "quick": Grid((1, 4), (4,), (8,), flood=40, mix="mixed"),
}


def measure_point(queue: int, cache: int, batch: int, grid: Grid,
                  photos: list[Any]) -> dict[str, Any]:
    overrides = {"capacity": {"queue": queue, "preprocess_cache": cache},
                 "batch": {"max_size": batch}}
    run = scenarios.start(WORK_DIR / "sweep", overrides)
    try:
        flood = scenarios.flood(run, photos, grid.flood, timeout_s=grid.flood * 2 + 120,
                                prefix="sweep")
        timings = run.results.timings[-grid.flood:]
        in_pipeline = [t["queue_wait"] + t["preprocess"] + t["batch_wait"] + t["inference"]
                       for t in timings]
        latencies = [t["total"] for t in timings]
        point = {
            "queue": queue, "preprocess_cache": cache, "batch": batch,
            "slots": queue + cache + batch,
            "files_per_s": flood["files_per_s"],
            "in_pipeline_ms": {"p50": round(percentile(in_pipeline, 50), 1),
                               "p99": round(percentile(in_pipeline, 99), 1)},
            "latency_ms": {"p50": round(percentile(latencies, 50), 1),
                           "p99": round(percentile(latencies, 99), 1)},
            "peak_rss_above_idle": flood["peak_rss_above_idle"],
            "cuda_reserved_bytes": flood.get("cuda_reserved_bytes"),
            "ready_s": round(run.daemon.ready_s or 0, 2),
            "loadavg": load_avg(),
        }
    finally:
        run.stop()
    return point


def recommend(points: list[dict[str, Any]]) -> tuple[dict[str, Any], str]:
    """Among the confirmed points (mean of two runs each), the smallest within 5% of the best;
    the slot costs are fitted over every point of the grid."""
    confirmed = [p for p in points if "runs_files_per_s" in p]
    best = max(confirmed, key=lambda p: p["files_per_s"])
    # "Within 5%" only means something when a point's two runs agree to better than 5%; on a
    # noisier machine the tolerance is the run-to-run spread actually measured.
    spread = max(abs(a - b) / ((a + b) / 2) for a, b in (p["runs_files_per_s"] for p in confirmed))
    within = min(WITHIN, 1 - spread)
    good = [p for p in confirmed if p["files_per_s"] >= within * best["files_per_s"]]
    pick = min(good, key=lambda p: (p["slots"], p["peak_rss_above_idle"]))
    slots = np.array([p["queue"] + p["preprocess_cache"] for p in points], dtype=float)
    rss_slope = float(np.polyfit(slots, [p["peak_rss_above_idle"] / MB for p in points], 1)[0])
    wait_slope = float(np.polyfit(slots, [p["in_pipeline_ms"]["p50"] for p in points], 1)[0])
    little_ms = 1000 / pick["files_per_s"]
    text = (
        f"recommend capacity.queue={pick['queue']}, capacity.preprocess_cache="
        f"{pick['preprocess_cache']}, batch.max_size={pick['batch']}: {pick['files_per_s']:.1f}"
        f" files/s, {pick['files_per_s'] / best['files_per_s']:.0%} of the best point "
        f"(queue={best['queue']}, cache={best['preprocess_cache']}, batch={best['batch']}, "
        f"{best['files_per_s']:.1f} files/s; means of two runs), the smallest of "
        f"{len(good)} within {1 - within:.0%}"
        + (" (the run-to-run spread measured here; 5% is below this machine's noise)"
           if within < WITHIN else "")
        + f". Each extra queue/cache slot costs ~{rss_slope:+.1f} MB peak RSS "
        f"(fit over the grid; a decoded 224² item is 0.15 MB) and ~{wait_slope:+.0f} ms of "
        f"in-pipeline wait (fit; Little's law at saturation: {little_ms:.0f} ms per slot), "
        f"and buys no throughput beyond this point."
    )
    return pick, text


def table(points: list[dict[str, Any]], header: str, recommendation: str) -> str:
    gpu = any(p["cuda_reserved_bytes"] for p in points)
    head = ["queue", "cache", "batch", "files/s", "pipe p50", "pipe p99", "lat p50", "lat p99",
            "peak RSS", *(["CUDA rsv"] if gpu else []), "load"]
    lines = [header, "", "  ".join(f"{h:>9}" for h in head)]
    for p in sorted(points, key=lambda p: (p["batch"], p["preprocess_cache"], p["queue"])):
        cells = [p["queue"], p["preprocess_cache"], p["batch"], f"{p['files_per_s']:.1f}",
                 f"{p['in_pipeline_ms']['p50']:.0f}", f"{p['in_pipeline_ms']['p99']:.0f}",
                 f"{p['latency_ms']['p50']:.0f}", f"{p['latency_ms']['p99']:.0f}",
                 f"{p['peak_rss_above_idle'] / MB:.0f} MB"]
        if gpu:
            cells.append(f"{(p['cuda_reserved_bytes'] or 0) / MB:.0f} MB")
        cells.append(p["loadavg"])
        lines.append("  ".join(f"{c!s:>9}" for c in cells))
    lines += ["", "pipe = claimed → inferred (ms, the wait the capacities add); lat = noticed → "
              "result written (ms, mostly the flood's own backlog)", recommendation]
    return "\n".join(lines)


def chart(points: list[dict[str, Any]], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 5))
    fig.suptitle(title)
    combos = sorted({(p["preprocess_cache"], p["batch"]) for p in points})
    for cache, batch in combos:
        line = sorted((p for p in points if (p["preprocess_cache"], p["batch"]) == (cache, batch)),
                      key=lambda p: p["queue"])
        queues = [p["queue"] for p in line]
        label = f"cache {cache}, batch {batch}"
        axes[0].plot(queues, [p["files_per_s"] for p in line], marker="o", label=label)
        axes[1].plot(queues, [p["in_pipeline_ms"]["p50"] for p in line], marker="o", label=label)
        axes[2].plot(queues, [p["peak_rss_above_idle"] / MB for p in line], marker="o",
                     label=label)
    for ax, ylabel in zip(axes, ("files/s", "in-pipeline p50 (ms)", "peak RSS above idle (MB)"),
                          strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("capacity.queue")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", choices=sorted(GRIDS), default=None)
    parser.add_argument("--out", type=Path, default=BENCH_DIR / "out")
    args = parser.parse_args()
    name = args.profile
    if name is None:
        import torch

        name = "gpu" if torch.cuda.is_available() else "cpu"
    grid = GRIDS[name]
    started = time.monotonic()
    photos = [p for p in build_corpus(CORPUS_DIR) if MIXES[grid.mix](p)]
    order = list(itertools.product(grid.queues, grid.caches, grid.batches))
    random.Random(0).shuffle(order)
    points = []
    for index, (queue, cache, batch) in enumerate(order, 1):
        log(f"point {index}/{len(order)}: queue={queue} cache={cache} batch={batch} "
            f"(load average {load_avg()})")
        points.append(measure_point(queue, cache, batch, grid, photos))
        log(f"  {points[-1]['files_per_s']} files/s")
    # One noisy point must not win: re-measure the leaders (and the smallest point) once more,
    # in reverse order, and rank them by the mean of both runs.
    leaders = sorted(points, key=lambda p: -p["files_per_s"])[:CONFIRM]
    leaders += [p for p in [min(points, key=lambda p: p["slots"])] if p not in leaders]
    for point in reversed(leaders):
        log(f"confirm: queue={point['queue']} cache={point['preprocess_cache']} "
            f"batch={point['batch']} (load average {load_avg()})")
        again = measure_point(point["queue"], point["preprocess_cache"], point["batch"], grid,
                              photos)
        point["runs_files_per_s"] = [point["files_per_s"], again["files_per_s"]]
        point["files_per_s"] = round((point["files_per_s"] + again["files_per_s"]) / 2, 2)
    pick, recommendation = recommend(leaders)
    wall_s = time.monotonic() - started
    header = (f"inboxd capacity sweep, profile {name}, {time.strftime('%Y-%m-%d %H:%M')}, "
              f"{grid.flood}-file flood per point of {MIX_TEXT[grid.mix]}; {wall_s:.0f} s")
    text = table(points, header, recommendation)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sweep.txt").write_text(text + "\n")
    (args.out / "sweep.json").write_text(json.dumps(
        {"profile": name, "grid": grid.__dict__, "points": points, "recommended": pick,
         "recommendation": recommendation, "wall_s": round(wall_s, 1)}, indent=1) + "\n")
    chart(points, header, args.out / "sweep.png")
    log(f"wrote {args.out / 'sweep.txt'}, sweep.json and sweep.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
