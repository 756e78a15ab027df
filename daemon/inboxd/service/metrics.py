"""Prometheus metrics: every figure of the journal's ``stats`` record, scrapeable.

Two ways out, both off by default (``metrics:`` in the YAML): a textfile for node_exporter's
textfile collector, rewritten atomically after every stats record, and an HTTP endpoint. Only
this module imports ``prometheus_client``, and only when one of the two is configured; the
HTTP server (``service/metrics_http.py``, on the daemon's event loop, with a connection cap and
time-outs) only exists with ``metrics.listen``.

Counters and gauges are read from :class:`~inboxd.stats.Stats` and the layers at scrape time,
so a scrape is never staler than the pipeline itself and a reload's new capacity shows at once.
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
from inboxd.stats import REASON_CLASSES, rss_bytes

# (name without _total, help, Counters attribute)
COUNTERS = (
    ("accepted", "Paths noticed and admitted to the event buffer.", "accepted"),
    ("enqueued", "Claimed files whose queue.put() returned.", "enqueued"),
    ("completed", "Files whose result is durable (duplicates included).", "completed"),
    ("retried", "Transient failures put on the retry list for another attempt.", "retried"),
    ("deferred", "Paths noticed while the event buffer was full (left on disk).", "deferred"),
    ("ignored", "Paths not taken: admitted but not claimed (gone, a folder, done), or a name "
     "never taken (logged once).", "ignored"),
    ("ignored_names", "Names never taken (no include pattern, hidden, format not decoded "
     "here), each logged once with what to do; part of ignored.", "ignored_names"),
    ("released", "Claimed files handed back to the inbox (retry list full, shutdown).",
     "released"),
    ("duplicates", "Files finished without inference: same name and sha256 as a result.",
     "duplicates"),
    ("taken_over", "Files a dead instance had claimed, returned to the inbox by this one.",
     "taken_over"),
)
# Buckets in base units, spanning what the journal's percentiles show on a CPU and a GPU.
PUT_WAIT_BUCKETS_S = (0.0001, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60)
LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
INFERENCE_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Journal memory fields that become gauges (only present on a GPU).
CUDA_FIELDS = {
    "CUDA_ALLOCATED_BYTES": ("inboxd_cuda_allocated_bytes",
                             "torch.cuda.memory_allocated(): what live tensors use."),
    "CUDA_RESERVED_BYTES": ("inboxd_cuda_reserved_bytes",
                            "torch.cuda.memory_reserved(): what the caching allocator holds."),
    "CUDA_MAX_ALLOCATED_BYTES": ("inboxd_cuda_max_allocated_bytes",
                                 "torch.cuda.max_memory_allocated(): the peak of allocated."),
}


class StatsCollector(Collector):
    """Counters and gauges, read from the pipeline when scraped."""

    def __init__(self, pipeline: Pipeline, instance: str) -> None:
        self.pipeline = pipeline
        self.instance = instance

    def collect(self) -> Iterator[Metric]:
        stats, instance = self.pipeline.stats, [self.instance]
        for name, doc, attribute in COUNTERS:
            counter = CounterMetricFamily(f"inboxd_{name}", doc, labels=["instance"])
            counter.add_metric(instance, getattr(stats.counters, attribute))
            yield counter
        failed = CounterMetricFamily("inboxd_failed", "Files moved to failed/, by reason class.",
                                     labels=["instance", "reason_class"])
        for reason_class in REASON_CLASSES:
            failed.add_metric([*instance, reason_class], stats.failed_by_class[reason_class])
        yield failed
        families = {
            "items": GaugeMetricFamily("inboxd_layer_items", "Items in each bounded layer now.",
                                       labels=["instance", "layer"]),
            "capacity": GaugeMetricFamily("inboxd_layer_capacity_items",
                                          "Each bounded layer's capacity (from the config).",
                                          labels=["instance", "layer"]),
            "high_water": GaugeMetricFamily("inboxd_layer_high_water_items",
                                            "The most items each layer has held since start.",
                                            labels=["instance", "layer"]),
        }
        for layer in stats.layers:
            labels = [*instance, layer.name]
            families["items"].add_metric(labels, layer.size)
            families["capacity"].add_metric(labels, layer.capacity)
            families["high_water"].add_metric(labels, layer.high_water)
        yield from families.values()
        cache = self.pipeline.cache
        for name, doc, value in (
            ("inboxd_preprocess_cache_bytes", "Bytes of decoded images in the preprocess cache.",
             cache.size_bytes),
            ("inboxd_preprocess_cache_capacity_bytes",
             "The preprocess cache's byte bound (capacity.preprocess_cache_mb).",
             cache.capacity_bytes),
            ("inboxd_preprocess_cache_high_water_bytes",
             "The most bytes the preprocess cache has held since start.",
             cache.high_water_bytes),
            ("inboxd_rss_bytes", "Resident set size of the daemon.", rss_bytes()),
        ):
            gauge = GaugeMetricFamily(name, doc, labels=["instance"])
            gauge.add_metric(instance, value)
            yield gauge
        for field, value in stats.memory_probe().items():
            if field in CUDA_FIELDS:
                name, doc = CUDA_FIELDS[field]
                gauge = GaugeMetricFamily(name, doc, labels=["instance"])
                gauge.add_metric(instance, value)
                yield gauge


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
        for name, doc, buckets, window, scale in (
            ("inboxd_put_wait_seconds", "How long queue.put() waited for room.",
             PUT_WAIT_BUCKETS_S, stats.put_wait_ms, 0.001),
            ("inboxd_latency_seconds", "From noticing a file to its durable result.",
             LATENCY_BUCKETS_S, stats.latency_ms, 0.001),
            ("inboxd_batch_size", "Images per model call.", BATCH_SIZE_BUCKETS,
             stats.batch_sizes, 1.0),
            ("inboxd_inference_seconds", "Duration of each model call (one batch).",
             INFERENCE_BUCKETS_S, stats.inference_ms, 0.001),
        ):
            child = Histogram(name, doc, ["instance"], registry=self.registry,
                              buckets=buckets).labels(self.instance)
            window.on_add = _observer(child.observe, scale)
        if self.config.textfile is not None:
            pipeline.on_stats.append(self.write_textfile)

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
