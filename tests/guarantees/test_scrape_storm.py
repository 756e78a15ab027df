"""Scraping /metrics costs the pipeline nothing measurable (issue 36, class 5): any local user
may request it as fast as the connections allow, and the exposition (the whole stats record,
~11 KB, built on the daemon's event loop) is still built at most once a second. The files/s
with and without such a storm are measured by ``bench/scrape_storm.py``."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from pathlib import Path

from inboxd.config import load_config
from inboxd.pipeline.wiring import Pipeline
from inboxd.service.metrics import Metrics
from inboxd.service.metrics_http import EXPOSITION_MAX_AGE_S, MAX_CONNECTIONS

from tests.conftest import write_config
from tests.fakes import FakeModel

STORM_S = 3.0


def scrape_until(path: Path, deadline_s: float, replies: list[int]) -> None:
    """One connection after another, each a whole GET /metrics, until ``deadline_s``."""
    while time.monotonic() < deadline_s:
        with socket.socket(socket.AF_UNIX) as client:
            client.connect(str(path))
            client.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            reply = b""
            while chunk := client.recv(65536):
                reply += chunk
        if reply.startswith(b"HTTP/1.1 200 OK") and b"inboxd_completed_total" in reply:
            replies.append(len(reply))


def test_a_scrape_storm_builds_the_exposition_at_most_once_a_second(tmp_path: Path) -> None:
    """Before: one build per request (hundreds a second, each on the event loop)."""
    sock = tmp_path / "metrics.sock"
    config = load_config(write_config(tmp_path, metrics={"listen": f"unix:{sock}"}))
    builds: list[float] = []  # seconds each build took

    async def storm() -> int:
        metrics = Metrics(config)
        metrics.attach(Pipeline(config, FakeModel()))  # type: ignore[arg-type]
        build = metrics.exposition

        def counted() -> bytes:
            started = time.perf_counter()
            body = build()
            builds.append(time.perf_counter() - started)
            return body

        metrics.exposition = counted  # type: ignore[method-assign]
        await metrics.start()
        replies: list[int] = []
        deadline_s = time.monotonic() + STORM_S
        scrapers = [threading.Thread(target=scrape_until, args=(sock, deadline_s, replies))
                    for _ in range(MAX_CONNECTIONS)]
        try:
            for scraper in scrapers:
                scraper.start()
            while any(s.is_alive() for s in scrapers):
                await asyncio.sleep(0.05)
        finally:
            metrics.close()
        return len(replies)

    served = asyncio.run(storm())
    assert served >= 100, f"only {served} scrapes: not a storm"
    assert len(builds) <= STORM_S / EXPOSITION_MAX_AGE_S + 2, (len(builds), served)
