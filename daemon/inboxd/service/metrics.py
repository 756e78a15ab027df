"""Prometheus metrics: every figure of the journal's ``stats`` record, scrapeable.

Two ways out, both off by default (``metrics:`` in the YAML): a textfile for node_exporter's
textfile collector, rewritten atomically after every stats record, and an HTTP endpoint. Only
this module imports ``prometheus_client``, and only when one of the two is configured; the
HTTP server (``service/metrics_http.py``, on the daemon's event loop, with a connection cap and
time-outs) only exists with ``metrics.listen``.

Which series exist, their names, kinds and help, is derived from ``inboxd.stats.FIELDS``, the
declaration the journal record follows too. Counters and gauges are read from the pipeline at
scrape time, so a scrape is never staler than the pipeline itself and a reload's new capacity
shows at once; only the CUDA figures are those of the last stats record (reading them resets
the per-interval peak).
Histograms are fed sample by sample through the stats windows' ``on_add`` hooks. Names follow
Prometheus conventions: base units (seconds, bytes), ``_total`` on counters, and every series
carries ``instance`` (the config's instance name).
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

from inboxd import logs
from inboxd.config import Config, ConfigError
from inboxd.files.durable import unlink_quietly, write_tmp
from inboxd.pipeline.wiring import Pipeline
from inboxd.service.metrics_http import MetricsServer
from inboxd.stats import FIELDS, MS, REASON_CLASSES, Stats, StatsField, Window, declared

# Buckets in base units, spanning what the journal's percentiles show on a CPU and a GPU.
PUT_WAIT_BUCKETS_S = (0.0001, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60)
LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
INFERENCE_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Histograms, fed sample by sample: (metric, Stats window attribute, buckets). Help and scale
# come from the record's fields that summarise them (stats.FIELDS).
HISTOGRAMS: tuple[tuple[str, Callable[[Stats], Window], tuple[float, ...]], ...] = (
    ("inboxd_put_wait_seconds", lambda stats: stats.put_wait_ms, PUT_WAIT_BUCKETS_S),
    ("inboxd_latency_seconds", lambda stats: stats.latency_ms, LATENCY_BUCKETS_S),
    ("inboxd_batch_size", lambda stats: stats.batch_sizes, BATCH_SIZE_BUCKETS),
    ("inboxd_inference_seconds", lambda stats: stats.inference_ms, INFERENCE_BUCKETS_S),
)
# The one histogram no record field summarises (the record has no inference percentiles).
INFERENCE = StatsField("INFERENCE_MS", "histogram", "ms", "timing",
                       "Duration of each model call (one batch).", "inboxd_inference_seconds",
                       MS)


class StatsCollector(Collector):
    """Counters and gauges, read from the pipeline when scraped."""

    def __init__(self, pipeline: Pipeline, instance: str) -> None:
        self.pipeline = pipeline
        self.instance = instance

    def collect(self) -> Iterator[Metric]:
        """Every counter and gauge of the stats record (``inboxd.stats.FIELDS``), as of now."""
        stats, instance = self.pipeline.stats, [self.instance]
        families: dict[str, Metric] = {}
        for name, value in self.pipeline.report.stats_fields(reset=False).items():
            found = declared(name)
            if found is None or found[0].metric is None or found[0].kind == "histogram":
                continue  # undeclared (a test forbids it), journal only, or fed sample-wise
            field, layer = found
            metric = str(field.metric)
            if name == "FAILED":
                failed = CounterMetricFamily(metric, field.help,
                                             labels=["instance", "reason_class"])
                for reason_class in REASON_CLASSES:
                    failed.add_metric([*instance, reason_class],
                                      stats.failed_by_class[reason_class])
                families[metric] = failed
                continue
            labels = ["instance"] if layer is None else ["instance", "layer"]
            family = families.get(metric)
            if family is None:
                kind = CounterMetricFamily if field.kind == "counter" else GaugeMetricFamily
                family = families[metric] = kind(metric, field.help, labels=labels)
            assert isinstance(family, CounterMetricFamily | GaugeMetricFamily)
            family.add_metric(instance if layer is None else [*instance, layer],
                              value * field.scale)
        yield from families.values()


class Metrics:
    """``start()`` before the model loads (a port in use fails in a second, not after the
    model's warm-up), ``attach()`` once the pipeline exists; until then a scrape is empty."""

    def __init__(self, config: Config) -> None:
        self.config = config.metrics
        self.instance = config.instance
        self.registry = CollectorRegistry(auto_describe=False)
        self._server: MetricsServer | None = None
        self._textfile_failing = False

    def attach(self, pipeline: Pipeline) -> None:
        self.registry.register(StatsCollector(pipeline, self.instance))
        stats = pipeline.stats
        for name, window_of, buckets in HISTOGRAMS:
            field = next((f for f in FIELDS.values() if f.metric == name), INFERENCE)
            child = Histogram(name, field.help, ["instance"], registry=self.registry,
                              buckets=buckets).labels(self.instance)
            window = window_of(stats)
            window.on_add = _observer(child.observe, field.scale)
        if self.config.textfile is not None:
            pipeline.report.on_stats.append(self.write_textfile)

    def exposition(self) -> bytes:
        return bytes(generate_latest(self.registry))

    def write_textfile(self) -> None:
        """Atomically: a hidden temp file in the same folder (node_exporter reads only
        ``*.prom``), mode 0644 so node_exporter's own user can read it, then rename."""
        path = self.config.textfile
        assert path is not None
        try:
            # A unique O_EXCL temp (never through a planted link), fsynced; its name ends in
            # .tmp, which node_exporter ignores.
            tmp = write_tmp(path.parent, self.exposition(), ".prom")
            try:
                os.chmod(tmp, 0o644)  # the unit's UMask=0027 would hide it from node_exporter
                os.replace(tmp, path)
            except OSError:
                unlink_quietly(tmp)
                raise
        except OSError as exc:
            if not self._textfile_failing:  # once per episode, not every interval
                logs.emit(logging.WARNING, "metrics_error",
                          f"cannot write the metrics textfile {path}: {exc.strerror or exc}; "
                          "under the shipped unit it must be below /var/lib/inboxd "
                          "(ReadWritePaths=)", path=str(path), error=str(exc))
            self._textfile_failing = True
            return
        self._textfile_failing = False

    async def start(self) -> None:
        """Serve ``metrics.listen`` on the running event loop, if set. An address that cannot
        be bound is a configuration error (exit 78): restarting into it would not help."""
        if self.config.listen is None:
            return
        server = MetricsServer(self.exposition)
        try:
            await server.start(self.config.listen)
        except OSError as exc:
            hint = ("the shipped unit has no network (PrivateNetwork=yes, "
                    "RestrictAddressFamilies=AF_UNIX): use a unix socket (unix:/PATH below "
                    "/var/lib/inboxd), add the drop-in from the README, or use "
                    "metrics.textfile" if exc.errno in (errno.EAFNOSUPPORT, errno.EPERM,
                                                        errno.EADDRNOTAVAIL)
                    else "choose a free port, or use metrics.textfile")
            raise ConfigError("metrics.listen", [
                f"cannot listen on {self.config.listen}: {exc.strerror or exc}; {hint}"
            ]) from exc
        self._server = server
        where = (self.config.listen if self.config.listen.startswith("unix:")
                 else f"http://{self.config.listen}/metrics")
        logs.emit(logging.INFO, "metrics", f"metrics on {where}", listen=self.config.listen)

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None


def _observer(observe: Callable[[float], None], scale: float) -> Callable[[float], None]:
    return lambda value: observe(value * scale)
