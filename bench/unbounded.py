"""The anti-pattern the article starts from, for its memory only: ``pending.append(upload)``.

Every file of the flood is accepted the moment it arrives: its bytes (what an upload handler
holds) go onto a plain list, and one worker (batch 1, preprocessing inline, the real model)
takes them off the front. Nothing tells the producer to wait, so RSS grows with the flood. A
guard stops accepting once RSS is ``--guard-mb`` above idle, so the bench itself cannot take
the machine down; the report says where it stopped.

    python -m bench.unbounded --files LIST --count N   →  one JSON line on stdout
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from pathlib import Path

from inboxd.models.model import Model

from bench.offline import emit, load, prepare, read_list
from bench.procs import RssSampler, peak_rss_bytes, reset_peak_rss, rss_bytes

MB = 1024 * 1024
# Reading /proc on every append would dominate the producer; every 16th is fine-grained enough.
GUARD_CHECK_EVERY = 16


async def flood(model: Model, files: list[Path], count: int, max_pixels: int,
                guard_bytes: int, idle: int) -> tuple[int, int, bool]:
    """Accept ``count`` uploads as fast as they come. Returns (accepted, processed, guarded)."""
    pending: list[tuple[Path, bytes]] = []
    processed = 0
    producing = True

    def run_inference(upload: tuple[Path, bytes]) -> None:
        model.classify([prepare(upload[0], model, max_pixels).pixels])

    async def worker() -> None:
        nonlocal processed
        while producing or pending:
            if not pending:
                await asyncio.sleep(0)
                continue
            await asyncio.to_thread(run_inference, pending.pop(0))
            processed += 1

    task = asyncio.create_task(worker())
    accepted, guarded = 0, False
    for index in range(count):
        path = files[index % len(files)]
        pending.append((path, path.read_bytes()))  # the article's `pending.append(...)`
        accepted += 1
        if accepted % GUARD_CHECK_EVERY == 0:
            if rss_bytes(os.getpid()) - idle > guard_bytes:
                guarded = True
                break
            await asyncio.sleep(0)  # uploads arrive on the event loop, between worker steps
    producing = False
    pending.clear()  # the run ends here: only the peak matters
    task.cancel()
    return accepted, processed, guarded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=Path, required=True, help="file listing the images")
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--guard-mb", type=int, default=3072)
    args = parser.parse_args()
    model, max_pixels = load(1)
    files = read_list(args.files)
    prepare(files[0], model, max_pixels)  # the decoder's own buffers are part of idle
    sampler = RssSampler(os.getpid(), interval_s=0.01)
    idle = rss_bytes(os.getpid())
    reset_peak_rss(os.getpid())
    started = time.monotonic()
    accepted, processed, guarded = asyncio.run(
        flood(model, files, args.count, max_pixels, args.guard_mb * MB, idle))
    ended = time.monotonic()
    peak = max(sampler.peak(started, ended), peak_rss_bytes(os.getpid()))
    sampler.stop()
    step = max(1, len(sampler.samples) // 200)
    series = [(round(t - started, 2), round((v - idle) / MB, 1))
              for t, v in sampler.samples[::step] if started <= t <= ended]
    emit({"count": args.count, "accepted": accepted, "processed": processed,
          "guard_stopped": guarded, "guard_mb": args.guard_mb, "idle_rss": idle,
          "peak_rss_above_idle": peak - idle, "window_s": round(ended - started, 2),
          "rss_series": series})


if __name__ == "__main__":
    main()
