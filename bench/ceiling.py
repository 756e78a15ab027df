"""The ceiling: inboxd's model and preprocessing in a tight offline loop, nothing else.

``preprocess.workers`` threads read, hash and decode (the daemon's own functions) while the
main thread runs the model on batches, so decoding of batch n+1 overlaps inference of batch n,
exactly the overlap inboxd aims for. No watcher, no queue, no claims, no result files. Every
batch size in ``--batch-sizes`` gets a short probe; the best one gets the measured run.

    python -m bench.ceiling --files LIST --count N   →  one JSON line on stdout
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from inboxd.config import load_config
from inboxd.item import DecodedImage
from inboxd.models.model import Model

from bench.offline import emit, load, model_ms, prepare, read_list
from bench.procs import peak_rss_bytes, reset_peak_rss, rss_bytes

# Decoded images allowed ahead of the model: enough that the decoders never wait on it.
READ_AHEAD_PER_WORKER = 8


def run_loop(model: Model, files: list[Path], count: int, batch: int, workers: int,
             max_pixels: int) -> float:
    """Files/s over ``count`` files (cycling through ``files``)."""
    ahead = max(batch, workers * READ_AHEAD_PER_WORKER)
    pending: collections.deque[Future[DecodedImage]] = collections.deque()
    started = time.perf_counter()
    with ThreadPoolExecutor(workers, thread_name_prefix="ceiling-decode") as pool:
        submitted = 0
        done = 0
        while done < count:
            while submitted < count and len(pending) < ahead:
                pending.append(pool.submit(prepare, files[submitted % len(files)], model,
                                           max_pixels))
                submitted += 1
            take = min(batch, count - done)
            images = [pending.popleft().result().pixels for _ in range(take)]
            model.classify(images)
            done += take
    return count / (time.perf_counter() - started)


def model_rss_mb(model: Model, image: DecodedImage, sizes: list[int]) -> dict[str, float]:
    """Peak RSS one ``classify`` call adds above the settled process, per batch size: the
    model's own working set (activations, oneDNN scratch), which no capacity can remove."""
    found = {}
    for batch in sizes:
        before = rss_bytes(os.getpid())
        reset_peak_rss(os.getpid())
        model.classify([image.pixels] * batch)
        found[str(batch)] = round((peak_rss_bytes(os.getpid()) - before) / 2**20, 1)
    return found


def preprocess_ms(model: Model, files: list[Path], max_pixels: int) -> dict[str, float]:
    """Single-thread read+hash+decode time per file, median by size-and-format label."""
    by_label: dict[str, list[float]] = collections.defaultdict(list)
    for path in files:
        started = time.perf_counter()
        prepare(path, model, max_pixels)
        label = path.name.split("-")[-1]  # "12MP.png"
        by_label[label].append((time.perf_counter() - started) * 1000)
    return {label: round(statistics.median(times), 2) for label, times in by_label.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=Path, required=True, help="file listing the images")
    parser.add_argument("--count", type=int, default=600,
                        help="files in the measured run (at most, with --seconds)")
    parser.add_argument("--seconds", type=float, default=0,
                        help="size the measured run to about this long at the probed rate")
    parser.add_argument("--probe-count", type=int, default=96, help="files per batch probe")
    parser.add_argument("--batch-sizes", default="1,4,8,16,32")
    parser.add_argument("--latency-files", type=Path, default=None,
                        help="also time single-thread preprocessing of these files")
    args = parser.parse_args()
    files = read_list(args.files)
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    workers = load_config(None).preprocess.workers
    model, max_pixels = load(max(sizes))
    decoded = prepare(files[0], model, max_pixels)
    sample = decoded.pixels

    result: dict[str, Any] = {"workers": workers, "device": str(model.device),
                              "precision": model.precision}
    # Few repeats: on a busy machine each large batch can take seconds.
    result["model_ms"] = {str(b): round(model_ms(model, sample, b, max(3, 32 // b)), 2)
                          for b in sizes}
    result["model_rss_mb"] = model_rss_mb(model, decoded, sizes)
    probes = {b: run_loop(model, files, args.probe_count, b, workers, max_pixels)
              for b in sizes}
    best = max(probes, key=lambda b: probes[b])
    result["probe_files_per_s"] = {str(b): round(v, 2) for b, v in probes.items()}
    result["best_batch"] = best
    count = args.count
    if args.seconds > 0:  # a slow (busy) machine gets a shorter run, not a longer wait
        count = max(args.probe_count, min(count, round(probes[best] * args.seconds)))
    result["files_per_s"] = round(run_loop(model, files, count, best, workers, max_pixels), 2)
    result["count"] = count
    if args.latency_files is not None:
        result["preprocess_ms"] = preprocess_ms(model, read_list(args.latency_files), max_pixels)
    emit(result)


if __name__ == "__main__":
    main()
