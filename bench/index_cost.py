"""The search index's cost: files/s of the flood with and without it, and ``inboxd search``'s
latency at 100,000 indexed photos.

- Flood: the pipeline-overhead scenario's daemon (null model, tiny JPEGs, batches of 64:
  ``bench/overhead.py``), where the index's share of a file's cost is the largest it can be.
  Two daemons, one with the index and one with ``index: null``, flooded in turns (off, on,
  off, on, …): each "on" flood is divided by the mean of the "off" floods either side, which
  cancels a steady drift of this shared machine's speed. The target: at most 5 % slower.
- Search: an index of ``--rows`` synthetic results (five labels from a 1,000-word vocabulary,
  a line of text on one in ten, a ``--dim`` float32 embedding each) written through the
  index's own insert; then the median of ``REPEATS`` calls of each query kind: a common label,
  a rare one, a text phrase, and ``--like`` (exact cosine over every vector, in chunks).

    python -m bench.index_cost [--count 2000] [--turns 3] [--rows 100000] [--dim 1280]
      →  one JSON line on stdout
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from bench import report
from bench.overhead import Scratch, make_inputs, measured_flood, start, write_config

BENCH_DIR = Path(__file__).resolve().parent
WORK_DIR = BENCH_DIR / "out" / "index"
REPEATS = 5
VOCABULARY = 1000


def log(message: str) -> None:
    print(f"[index {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def flood_in_turns(count: int, turns: int) -> dict[str, Any]:
    scratch = Scratch()
    program, labels, photos = make_inputs(BENCH_DIR / "out" / "overhead")
    runs = {}
    for name, index in (("off", False), ("on", True)):
        root = scratch(f"index-{name}")
        config = write_config(root, program, labels)
        settings = yaml.safe_load(config.read_text())
        if not index:
            settings["index"] = None
        config.write_text(yaml.safe_dump(settings, sort_keys=False))
        runs[name] = start(root, config)
    off: list[float] = []
    on: list[float] = []
    try:
        for turn in range(turns):
            off.append(measured_flood(runs["off"], photos, count, f"off{turn}-")["files_per_s"])
            on.append(measured_flood(runs["on"], photos, count, f"on{turn}-")["files_per_s"])
            log(f"turn {turn}: without the index {off[-1]} files/s, with it {on[-1]}")
        off.append(measured_flood(runs["off"], photos, count, f"off{turns}-")["files_per_s"])
    finally:
        for run in runs.values():
            run.stop()
        scratch.clean()
    ratios = [on[turn] / ((off[turn] + off[turn + 1]) / 2) for turn in range(turns)]
    ratio = statistics.median(ratios)
    return {"count": count, "turns": turns, "files_per_s_without": off,
            "files_per_s_with": on, "ratios": [round(r, 3) for r in ratios],
            "ratio": round(ratio, 3), "slower_percent": round((1 - ratio) * 100, 1),
            "target_percent": 5.0}


def synthetic_index(root: Path, rows: int, dim: int) -> tuple[Any, Any]:
    from inboxd.config import load_config
    from inboxd.files.index import ResultIndex
    from inboxd.files.index_rows import SINGLE_TASK, IndexRow, Label
    from inboxd.files.lifecycle import Lifecycle

    root.mkdir(parents=True, exist_ok=True)
    (root / "inbox").mkdir(exist_ok=True)
    config_path = root / "inboxd.yaml"
    config_path.write_text(yaml.safe_dump({
        "inbox": {"paths": [str(root / "inbox")]}, "results_dir": str(root / "results"),
        "done_dir": str(root / "done"), "failed_dir": str(root / "failed")}))
    config = load_config(config_path)
    index = ResultIndex(config, Lifecycle(config).results)
    rng = np.random.default_rng(39)
    words = [f"word{n:04d}" for n in range(VOCABULARY)]
    vectors = rng.standard_normal((rows, dim)).astype(np.float32)
    started = time.perf_counter()
    batch = 1000
    for first in range(0, rows, batch):
        with index._transaction():  # one transaction per batch, as the commit writes them
            for n in range(first, min(rows, first + batch)):
                # A Zipf-like choice: a few labels are everywhere, most are rare.
                chosen = rng.zipf(1.3, 5) % VOCABULARY
                row = IndexRow(
                    name=f"photos/{n:06d}.jpg", sha256=f"{n:064x}", source=f"photos/{n:06d}.jpg",
                    photo=f"/srv/done/photos/{n:06d}.jpg", model="bench", model_sha256=None,
                    instance="default", size_bytes=1000, width=640, height=480,
                    completed_at="2026-12-05T00:00:00Z",
                    labels=[Label(SINGLE_TASK, words[int(w)], float(s), "class")
                            for w, s in zip(chosen, sorted(rng.random(5), reverse=True),
                                            strict=True)],
                    texts=([(SINGLE_TASK, f"invoice {n} total {words[n % VOCABULARY]} paid")]
                           if n % 10 == 0 else []),
                    embeddings=[(SINGLE_TASK, vectors[n])])
                index._insert(row)
    build_s = time.perf_counter() - started
    index.close()
    assert config.index is not None
    return config, {"rows": rows, "dim": dim, "build_s": round(build_s, 1),
                    "index_mb": round(config.index.stat().st_size / 2**20, 1)}


def timed_ms(call: Any) -> tuple[float, int]:
    times, found = [], 0
    for _ in range(REPEATS):
        started = time.perf_counter()
        found = len(call())
        times.append((time.perf_counter() - started) * 1000)
    return round(statistics.median(times), 2), found


def search_latency(rows: int, dim: int) -> dict[str, Any]:
    from inboxd.files import index_search
    from inboxd.files.index import connect

    root = WORK_DIR / "search"
    shutil.rmtree(root, ignore_errors=True)
    config, built = synthetic_index(root, rows, dim)
    figures: dict[str, Any] = dict(built)
    log(f"{rows} synthetic rows written in {figures['build_s']} s ({figures['index_mb']} MB)")
    conn = connect(config.index, read_only=True)
    query = np.random.default_rng(1).standard_normal(dim).astype(np.float32)
    for name, call in {
        "label_common_ms": lambda: index_search.by_words(conn, ["word0001"]),
        "label_rare_ms": lambda: index_search.by_words(conn, ["word0777"]),
        "text_ms": lambda: index_search.by_words(conn, ["invoice", "paid"]),
        "like_ms": lambda: index_search.like(conn, query, "model"),
    }.items():
        figures[name], figures[name.replace("_ms", "_found")] = timed_ms(call)
    conn.close()
    shutil.rmtree(root, ignore_errors=True)
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=1280)  # the built-in model's embedding
    parser.add_argument("--emit", action="store_true", help="also print the table (stderr)")
    args = parser.parse_args()
    result: dict[str, Any] = {}
    if args.rows:
        result["search"] = search_latency(args.rows, args.dim)
    if args.count:
        result["flood"] = flood_in_turns(args.count, args.turns)
    if args.emit:
        emit_table(result)
    print(json.dumps(result))
    return 0


def emit_table(result: dict[str, Any]) -> None:
    print("\n".join(report.index_lines(result)), file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
