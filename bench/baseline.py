"""The article's design, with the real model and preprocessing in place of its sleep.

One worker, ``asyncio.Queue(maxsize=2)``, batch size 1, preprocessing inline: the worker takes a
path, reads, decodes and classifies it in one thread-pool call (the article's advice for a
synchronous model), then ``task_done()`` in ``finally``; the producer ``await``s every put and
``queue.join()`` ends the run. Results are kept in memory, not written to disk (the article
prints them), which if anything flatters the baseline next to inboxd's durable results.

    python -m bench.baseline --files LIST --count N   →  one JSON line on stdout
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

from inboxd.models.model import Classification, Model

from bench.offline import emit, load, prepare, read_list

QUEUE_MAXSIZE = 2


async def run(model: Model, files: list[Path], count: int, max_pixels: int) -> float:
    queue: asyncio.Queue[Path] = asyncio.Queue(maxsize=QUEUE_MAXSIZE)
    results: list[Classification] = []

    def run_inference(path: Path) -> Classification:
        image = prepare(path, model, max_pixels)
        return model.classify([image.pixels])[0]

    async def producer() -> None:
        for index in range(count):
            await queue.put(files[index % len(files)])

    async def worker() -> None:
        while True:
            path = await queue.get()
            try:
                results.append(await asyncio.to_thread(run_inference, path))
            finally:
                queue.task_done()

    started = time.perf_counter()
    task = asyncio.create_task(worker())
    await producer()
    await queue.join()
    task.cancel()
    elapsed = time.perf_counter() - started
    assert len(results) == count
    return count / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=Path, required=True, help="file listing the images")
    parser.add_argument("--count", type=int, default=300)
    args = parser.parse_args()
    model, max_pixels = load(1)
    files_per_s = asyncio.run(run(model, read_list(args.files), args.count, max_pixels))
    emit({"files_per_s": round(files_per_s, 2), "count": args.count, "batch": 1,
          "queue_maxsize": QUEUE_MAXSIZE, "device": str(model.device)})


if __name__ == "__main__":
    main()
