"""A scrape storm against the pipeline: files/s of a flood with and without local clients asking
GET /metrics as fast as ``metrics_http.MAX_CONNECTIONS`` connections allow (issue 36, class 5).

One daemon (the default config, ``metrics.listen`` on a unix socket) serves every turn: flood,
flood under a storm, flood, flood under a storm, ... The machine drifts, so each storm turn is
divided by the mean of the quiet turns either side of it, and the median of those ratios is the
figure (1.0: the storm costs nothing). The storm's own rate (scrapes/s) is reported beside it.

    python -m bench.scrape_storm [--count 150] [--turns 3]  →  one JSON line on stdout
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from inboxd.service.metrics_http import MAX_CONNECTIONS

from bench.photos import build_corpus
from bench.scenarios import flood, start

BENCH_DIR = Path(__file__).resolve().parent
WORK_DIR = BENCH_DIR / "out" / "scrape-storm"
CORPUS_DIR = BENCH_DIR / "out" / "photos"
FLOOD_TIMEOUT_S = 600


class Storm:
    """``MAX_CONNECTIONS`` threads, each asking GET /metrics on a new connection, in a loop."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.stop = threading.Event()
        self.replies = 0
        self.threads = [threading.Thread(target=self._scrape, daemon=True)
                        for _ in range(MAX_CONNECTIONS)]

    def __enter__(self) -> Storm:
        self.started_s = time.monotonic()
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(10)
        self.elapsed_s = time.monotonic() - self.started_s

    def _scrape(self) -> None:
        while not self.stop.is_set():
            try:
                with socket.socket(socket.AF_UNIX) as client:
                    client.connect(str(self.path))
                    client.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
                    while client.recv(65536):
                        pass
                self.replies += 1
            except OSError:
                time.sleep(0.001)  # refused at the cap: ask again


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--count", type=int, default=150)
    parser.add_argument("--turns", type=int, default=3)
    args = parser.parse_args()
    photos = build_corpus(CORPUS_DIR, sizes=["0.3MP"], formats=["jpg"])
    sock = WORK_DIR / "metrics.sock"
    run = start(WORK_DIR, {"metrics": {"listen": f"unix:{sock}"}})
    quiet: list[float] = []
    stormy: list[float] = []
    scrapes_per_s: list[float] = []
    try:
        flood(run, photos, args.count, FLOOD_TIMEOUT_S, "warm")  # the fast path, if any, built
        for turn in range(args.turns):
            quiet.append(flood(run, photos, args.count, FLOOD_TIMEOUT_S,
                               f"q{turn}")["files_per_s"])
            with Storm(sock) as storm:
                stormy.append(flood(run, photos, args.count, FLOOD_TIMEOUT_S,
                                    f"s{turn}")["files_per_s"])
            scrapes_per_s.append(storm.replies / storm.elapsed_s)
        quiet.append(flood(run, photos, args.count, FLOOD_TIMEOUT_S, "qlast")["files_per_s"])
    finally:
        run.stop()
    ratios = [s / statistics.mean(quiet[i:i + 2]) for i, s in enumerate(stormy)]
    figures: dict[str, Any] = {
        "count": args.count, "turns": args.turns,
        "files_per_s_quiet": quiet, "files_per_s_storm": stormy,
        "ratio_storm_to_quiet": [round(r, 3) for r in ratios],
        "ratio_median": round(statistics.median(ratios), 3),
        "scrapes_per_s": [round(s) for s in scrapes_per_s],
    }
    shutil.rmtree(WORK_DIR, ignore_errors=True)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
