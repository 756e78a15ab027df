"""Prometheus metrics, scraped for real: the textfile through a real node_exporter (Debian's
``prometheus-node-exporter``, started here on 127.0.0.1 with only the textfile collector), the
HTTP endpoint directly, both parsed with ``prometheus_client.parser``.

One daemon serves both, through a flood with tiny capacities: every scrape during it must show
each layer's high-water mark within its capacity, and at the end the counters must equal the
files on disk.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from inboxd.config import ConfigError, load_config, parse_config
from inboxd.decode.pillow import decode_image
from inboxd.decode.replies import result_from
from inboxd.decode.spec import PreprocessSpec
from inboxd.files.reading import read_and_hash
from inboxd.item import ModelError, RefusedError, TransientError
from inboxd.models.engines.ray_replica import decode_reply
from inboxd.pipeline.intake import describe_link
from inboxd.pipeline.wiring import Pipeline
from inboxd.service.metrics import Metrics
from inboxd.stats import REASON_CLASSES, classify_failure
from prometheus_client.parser import text_string_to_metric_families

from support.harness import free_port
from tests.conftest import REPO, DaemonProcess, make_image, wait_until, write_config
from tests.fakes import FakeModel

CAPACITY = {"event_buffer": 4, "queue": 1, "preprocess_cache": 2, "preprocess_cache_mb": 64,
            "retry_list": 2}
BATCH = {"max_size": 2, "max_delay_ms": 5}
LAYERS = {"event_buffer": 4, "queue": 1, "preprocess_cache": 2, "batch": 2, "retry_list": 2}
GOOD, BAD = 40, 3
TYPES = {
    **{f"inboxd_{name}": "counter" for name in (
        "accepted", "enqueued", "completed", "failed", "retried", "deferred", "ignored",
        "ignored_names", "released", "duplicates", "taken_over")},
    **{name: "gauge" for name in (
        "inboxd_layer_items", "inboxd_layer_capacity_items", "inboxd_layer_high_water_items",
        "inboxd_preprocess_cache_bytes", "inboxd_rss_bytes")},
    **{name: "histogram" for name in (
        "inboxd_put_wait_seconds", "inboxd_latency_seconds", "inboxd_batch_size",
        "inboxd_inference_seconds")},
}
NODE_EXPORTER = "prometheus-node-exporter"


def scrape(url: str) -> dict[str, object]:
    """name -> family, only inboxd's (node_exporter adds its own)."""
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)
            if f.name.startswith("inboxd_")}


def value(families: dict[str, object], name: str, sample: str | None = None,
          **labels: str) -> float:
    family = families[name]
    for s in family.samples:  # type: ignore[attr-defined]
        if s.name == (sample or name) and all(s.labels.get(k) == v for k, v in labels.items()):
            return float(s.value)
    raise KeyError(f"{sample or name}{labels}")


@pytest.fixture
def node_exporter(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    binary = shutil.which(NODE_EXPORTER)
    if binary is None:
        message = (f"{NODE_EXPORTER} is not installed (apt-get install "
                   "prometheus-node-exporter; `make setup-test` does it as root)")
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    textfile_dir = tmp_path / "textfile"
    textfile_dir.mkdir()
    port = free_port()
    proc = subprocess.Popen(
        [binary, f"--web.listen-address=127.0.0.1:{port}", "--collector.disable-defaults",
         "--collector.textfile", f"--collector.textfile.directory={textfile_dir}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}/metrics"

    def up() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"node_exporter exited: {proc.stderr.read()}")  # type: ignore[union-attr]
        try:
            urllib.request.urlopen(url, timeout=1).close()
        except OSError:
            return False
        return True

    try:
        wait_until(up, 20, "node_exporter to listen")
        yield url, textfile_dir
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.daemon
@pytest.mark.slow
def test_textfile_via_node_exporter_and_http_during_a_flood(
        tmp_path: Path, node_exporter: tuple[str, Path]) -> None:
    exporter_url, textfile_dir = node_exporter
    port = free_port()
    instance = "metrics-test"
    config = write_config(
        tmp_path, instance=instance, capacity=CAPACITY, batch=BATCH,
        stats={"interval_s": 0.2},
        metrics={"textfile": str(textfile_dir / "inboxd.prom"), "listen": f"127.0.0.1:{port}"})
    daemon = DaemonProcess(config)
    http_url = f"http://127.0.0.1:{port}/metrics"
    scrapes: list[dict[str, object]] = []
    flooding = threading.Event()
    try:
        daemon.wait_for("ready", 120)
        # The file appears with the first stats record, after at most one interval.
        wait_until(lambda: "inboxd_accepted" in scrape(exporter_url), 10, "the textfile")

        def keep_scraping() -> None:
            while flooding.is_set():
                scrapes.append(scrape(exporter_url))
                scrapes.append(scrape(http_url))
                time.sleep(0.05)

        staging = tmp_path / "staging"
        for n in range(GOOD):
            make_image(staging / f"img{n:03}.png", color=(n * 6 % 256, 80, 160))
        (staging / "empty.jpg").write_bytes(b"")
        (staging / "garbage.jpg").write_bytes(os.urandom(2000))
        (staging / "text.png").write_bytes(b"not a png at all\n" * 20)
        old = time.time() - 60  # settled already: taken at once
        for path in staging.iterdir():
            os.utime(path, (old, old))
        flooding.set()
        scraper = threading.Thread(target=keep_scraping, daemon=True)
        scraper.start()
        for path in sorted(staging.iterdir()):
            os.rename(path, tmp_path / "inbox" / path.name)

        def finished() -> bool:
            done = len(list((tmp_path / "done").iterdir())) == GOOD
            failed = len(list((tmp_path / "failed").glob("*.error.json"))) == BAD
            return done and failed

        wait_until(finished, 90, "every file to get an outcome")
        final = wait_until(lambda: (lambda f: f if value(f, "inboxd_completed",
                                                          "inboxd_completed_total") == GOOD
                                    else None)(scrape(exporter_url)), 10, "the final textfile")
        flooding.clear()
        scraper.join(10)
        # The endpoint serves an exposition up to a second old (metrics_http.py).
        direct = wait_until(lambda: (lambda f: f if value(f, "inboxd_completed",
                                                           "inboxd_completed_total") == GOOD
                                     else None)(scrape(http_url)), 10, "the final scrape")
    finally:
        flooding.clear()
        code = daemon.stop()
    assert code == 0, daemon.output()

    assert len(scrapes) >= 6, "too few scrapes during the flood to mean anything"
    for families in (final, direct):
        for name, kind in TYPES.items():
            assert name in families, f"{name} missing"
            assert families[name].type == kind, (name, families[name].type)  # type: ignore[attr-defined]
            for sample in families[name].samples:  # type: ignore[attr-defined]
                assert sample.labels["instance"] == instance, sample
        # The counters are the files on disk; the failures are all undecodable input.
        total = GOOD + BAD
        assert value(families, "inboxd_completed", "inboxd_completed_total") == GOOD
        assert value(families, "inboxd_failed", "inboxd_failed_total",
                     reason_class="decode") == BAD
        assert {s.labels["reason_class"] for s in families["inboxd_failed"].samples  # type: ignore[attr-defined]
                } == set(REASON_CLASSES)
        enqueued = value(families, "inboxd_enqueued", "inboxd_enqueued_total")
        assert enqueued == total
        # The books close: every accepted path was claimed or ignored (a scan may admit a
        # file whose watcher event then comes after its claim: accepted again, ignored);
        # names never admitted are ignored too, and counted apart.
        assert value(families, "inboxd_accepted", "inboxd_accepted_total") == enqueued + value(
            families, "inboxd_ignored", "inboxd_ignored_total") - value(
            families, "inboxd_ignored_names", "inboxd_ignored_names_total")
        assert value(families, "inboxd_latency_seconds", "inboxd_latency_seconds_count") == GOOD
        assert value(families, "inboxd_put_wait_seconds",
                     "inboxd_put_wait_seconds_count") == total
        assert value(families, "inboxd_batch_size", "inboxd_batch_size_sum") == GOOD
        for layer, capacity in LAYERS.items():
            assert value(families, "inboxd_layer_capacity_items", layer=layer) == capacity
    # The flood filled the layers, and no scrape ever saw one above its capacity.
    peak = {layer: 0.0 for layer in LAYERS}
    for families in scrapes:
        for layer in LAYERS:
            capacity = value(families, "inboxd_layer_capacity_items", layer=layer)
            high = value(families, "inboxd_layer_high_water_items", layer=layer)
            now = value(families, "inboxd_layer_items", layer=layer)
            assert now <= high <= capacity, (layer, now, high, capacity)
            peak[layer] = max(peak[layer], high)
    assert peak["queue"] == 1 and peak["event_buffer"] == 4, peak
    # The Grafana dashboard only asks for series that exist (the CUDA ones: on a GPU).
    dashboard = (REPO / "contrib" / "grafana-dashboard.json").read_text()
    exposed = {sample.name for family in direct.values()
               for sample in family.samples}  # type: ignore[attr-defined]
    wanted = set(re.findall(r"inboxd_[a-z_]+", dashboard)) - {
        "inboxd_cuda_allocated_bytes", "inboxd_cuda_reserved_bytes"}
    assert wanted and wanted <= exposed, wanted - exposed
    # node_exporter read a complete file every time: it reports no textfile error.
    with urllib.request.urlopen(exporter_url.replace("/metrics", "/metrics"), timeout=5) as r:
        text = r.read().decode()
    assert "node_textfile_scrape_error 0" in text


@pytest.mark.parametrize(("metrics", "message"), [
    ({"textfile": "/var/lib/inboxd/inboxd.txt"}, "only reads *.prom files: name it inboxd.prom"),
    ({"listen": "9464"}, "give HOST:PORT"),
    ({"listen": "127.0.0.1:99999"}, "give HOST:PORT"),
])
def test_bad_metrics_settings_say_what_to_write(metrics: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(f"metrics: {metrics}\n".replace("'", '"'), "x.yaml")
    assert message in str(caught.value) and "metrics." in str(caught.value)


@pytest.mark.daemon
@pytest.mark.slow
def test_a_listen_port_in_use_exits_78_and_says_what_to_do(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = write_config(tmp_path, metrics={"listen": f"127.0.0.1:{port}"})
        done = subprocess.run([sys.executable, "-m", "inboxd", "run", "-c", str(config)],
                              capture_output=True, text=True, timeout=120, cwd=tmp_path,
                              check=False)
    assert done.returncode == 78, done.stderr[-3000:]
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr
    assert "choose a free port, or use metrics.textfile" in done.stderr


def _raised(work: Callable[[], object]) -> BaseException:
    try:
        work()
    except Exception as exc:
        return exc
    raise AssertionError("expected an exception")


def test_reason_classes_of_the_real_errors(tmp_path: Path) -> None:
    """The label is the class the exception a file really failed with declares (carried over
    a decode worker's pipe and a replica's reply by name): a small fixed set, whatever the
    input."""
    spec = PreprocessSpec(256, 224, "bicubic", (0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    big = make_image(tmp_path / "big.png", size=(200, 200)).read_bytes()
    (tmp_path / "link.jpg").symlink_to(tmp_path / "big.png")
    cases = {
        "decode": [_raised(lambda: decode_image(b"", spec, 10**8)),
                   _raised(lambda: decode_image(b"\x89PNG\r\n\x1a\n" + bytes(99), spec, 10**8))],
        "too_large": [_raised(lambda: decode_image(big, spec, 1000)),
                      # A decode worker's reply names the class, rebuilt on this side.
                      result_from({"ok": False, "permanent": True, "reason_class": "too_large",
                                   "reason": "file is 9 bytes, more than …"}, bytearray()).error],
        "refused": [_raised(lambda: read_and_hash(tmp_path / "link.jpg")),
                    RefusedError(describe_link(str(tmp_path / "link.jpg"), tmp_path))],
        "io": [TransientError("cannot read the file: Input/output error"),
               OSError(28, "No space left on device")],
        "model": [ModelError("the model failed on this input: RuntimeError('shape')"),
                  decode_reply({"outcomes": [("permanent", "the model failed")]}, 1)[0]],
        "other": [RuntimeError("something else")],
    }
    assert set(cases) == set(REASON_CLASSES)
    for reason_class, errors in cases.items():
        for exc in errors:
            assert classify_failure(exc) == reason_class, (reason_class, exc)


def test_an_unwritable_textfile_is_logged_once_and_never_stops_the_pipeline(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """In-process, with the fake model: the textfile's folder is a file (so even root cannot
    write it). Files still get results, the warning comes once, and once the folder can be
    made the next stats record writes a complete file, with no temp file left behind."""
    blocker = tmp_path / "metrics"
    blocker.write_text("not a folder")
    config = load_config(write_config(tmp_path, metrics={"textfile": str(blocker / "i.prom")}))
    pipeline = Pipeline(config, FakeModel())  # type: ignore[arg-type]
    metrics = Metrics(config)
    metrics.attach(pipeline)
    for n in range(3):
        make_image(tmp_path / "inbox" / f"{n}.png")
    with caplog.at_level(logging.WARNING):
        asyncio.run(pipeline.process_backlog())
        pipeline.report.log_stats()
    assert len(list((tmp_path / "results").glob("*.json"))) == 3
    warnings = [r for r in caplog.records if "cannot write the metrics textfile" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
    blocker.unlink()
    pipeline.report.log_stats()
    families = {f.name: f for f in text_string_to_metric_families(
        (blocker / "i.prom").read_text())}
    assert families["inboxd_completed"].samples[0].value == 3
    assert [p.name for p in blocker.iterdir()] == ["i.prom"]
    assert oct((blocker / "i.prom").stat().st_mode & 0o777) == "0o644"


def test_paths_that_are_not_claimed_are_counted_as_ignored(tmp_path: Path) -> None:
    """inboxd_ignored_total: admitted to the event buffer, then gone before the claim, or a
    folder. In-process, with the fake model."""
    config = load_config(write_config(tmp_path))
    inbox = config.inbox.paths[0]
    pipeline = Pipeline(config, FakeModel())  # type: ignore[arg-type]
    make_image(inbox / "real.png")
    (inbox / "folder.png").mkdir()
    # its writer removed it meanwhile
    pipeline.event_buffer.offer(str(inbox / "gone.png"), inbox, 0.0)
    pipeline.event_buffer.offer(str(inbox / "folder.png"), inbox, 0.0)
    asyncio.run(pipeline.process_backlog())
    counters = pipeline.stats.counters
    assert (counters.completed, counters.ignored) == (1, 2)
