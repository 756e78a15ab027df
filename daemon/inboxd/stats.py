"""Counters at every boundary, every layer's fill, and the periodic ``stats`` record.

The names follow the article: *accepted* (noticed and admitted to the event buffer), *enqueued*
(``queue.put()`` returned), *completed* (result durable); plus *failed*, *retried*, *deferred*
(noticed while the event buffer was full: left on disk for the next scan) and *released*
(handed back to the inbox on disk: retry list full, or shutdown) and *ignored* (not taken:
admitted to the event buffer, then not claimed — gone before the claim, a folder, or already
done — or, counted in *ignored_names* too, a name the daemon never takes, logged once).

Failures are also counted by ``reason_class``, a small fixed set (never free text or a path),
so that a metrics label can never grow with the inputs.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

# Percentiles are taken over the most recent samples only, so this window never grows.
SAMPLE_WINDOW = 2048


class Layer(Protocol):
    """A bounded container on the way from the watcher to the results: its size now, its
    capacity, and the largest size it has ever had (the proof that the bound held)."""

    name: str
    high_water: int

    @property
    def size(self) -> int: ...

    @property
    def capacity(self) -> int: ...


@dataclass
class Window:
    samples: deque[float] = field(default_factory=lambda: deque(maxlen=SAMPLE_WINDOW))
    max_seen: float = 0.0
    # Every sample is also handed here (the metrics histograms), when something listens.
    on_add: Callable[[float], None] | None = None

    def add(self, value: float) -> None:
        self.samples.append(value)
        self.max_seen = max(self.max_seen, value)
        if self.on_add is not None:
            self.on_add(value)

    def percentile(self, q: float) -> float:
        if not self.samples:
            return 0.0
        ordered = sorted(self.samples)
        index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
        return ordered[index]


@dataclass
class Counters:
    accepted: int = 0
    enqueued: int = 0
    completed: int = 0
    failed: int = 0
    retried: int = 0
    deferred: int = 0
    released: int = 0
    duplicates: int = 0  # same name and content as an existing result: finished without inference
    # Not taken: admitted to the event buffer, then not claimed (gone, a folder, done), or a
    # name never admitted (no include pattern, hidden: ``ignored_names``, said once each).
    ignored: int = 0
    ignored_names: int = 0
    # Claimed by an instance that died, returned to the inbox by this one (files.takeover).
    taken_over: int = 0


# Why a file failed, coarsely: the metrics label. Each exception class declares its own
# (``reason_class``, inboxd.item); classify_failure() reads it.
REASON_CLASSES = ("decode", "too_large", "io", "model", "refused", "other")


def classify_failure(exc: BaseException) -> str:
    """The reason class of the exception that made a file fail (one of REASON_CLASSES)."""
    declared = getattr(exc, "reason_class", None)
    if declared in REASON_CLASSES:
        return str(declared)
    if isinstance(exc, OSError):
        return "io"
    return "other"


# -- the stats record's fields, declared once ---------------------------------------------------
# The journal record (Stats.snapshot and the pipeline's additions), the Prometheus exporter
# (service.metrics) and ``inboxd stats`` (service.readback) are all derived from FIELDS; a test
# builds a full record and checks that every field in it is declared, exported and read back.

Kind = Literal["counter", "gauge", "histogram", "journal"]


@dataclass(frozen=True)
class StatsField:
    """One figure of the ``stats`` record. ``metric``: the Prometheus family it is exported as
    (counters without ``_total``; a histogram's percentiles all name their histogram), or None
    for a figure only the journal has (``help`` then says why). ``scale``: record value ×
    scale = the metric's value (milliseconds to the seconds Prometheus wants)."""

    name: str
    kind: Kind
    unit: str
    group: str  # where ``inboxd stats`` shows it: counters, layer, timing, memory, cuda, ray
    help: str
    metric: str | None
    scale: float = 1.0


def _counter(name: str, help_text: str) -> StatsField:
    return StatsField(name.upper(), "counter", "files", "counters", help_text, f"inboxd_{name}")


COUNTER_FIELDS = (
    _counter("accepted", "Paths noticed and admitted to the event buffer."),
    _counter("enqueued", "Claimed files whose queue.put() returned."),
    _counter("completed", "Files whose result is durable (duplicates included)."),
    # Exported by reason class (inboxd_failed_total{reason_class}); their sum is FAILED.
    _counter("failed", "Files moved to failed/, by reason class."),
    _counter("retried", "Transient failures put on the retry list for another attempt."),
    _counter("deferred", "Paths noticed while the event buffer was full (left on disk)."),
    _counter("released", "Claimed files handed back to the inbox (retry list full, shutdown)."),
    _counter("duplicates", "Files finished without inference: same name and sha256 as a "
             "result."),
    _counter("ignored", "Paths not taken: admitted but not claimed (gone, a folder, done), or "
             "a name never taken (logged once)."),
    _counter("ignored_names", "Names never taken (no include pattern, hidden, format not "
             "decoded here), each logged once with what to do; part of ignored."),
    _counter("taken_over", "Files a dead instance had claimed, returned to the inbox by this "
             "one."),
)
# Layers renamed, new name -> old: the record (and so the metrics) carries the old name's fields
# too, for one release, so dashboards and alerts keep working while they are moved over.
# New layer name → the old one, whose fields a record still carries (renamed in 0.2.0; the old
# names are gone in 0.3.0).
DEPRECATED_LAYER_NAMES = {"preprocess": "decoding", "result_writer": "write_handoff",
                          "model": "in_flight"}

# Per layer: the record's field is <LAYER>_<name>, the metric carries the layer as a label.
LAYER_FIELDS = (
    StatsField("SIZE", "gauge", "items", "layer", "Items in each bounded layer now.",
               "inboxd_layer_items"),
    StatsField("CAPACITY", "gauge", "items", "layer",
               "Each bounded layer's capacity (from the config).", "inboxd_layer_capacity_items"),
    StatsField("HIGH_WATER", "gauge", "items", "layer",
               "The most items each layer has held since start.", "inboxd_layer_high_water_items"),
)
MS = 0.001
OTHER_FIELDS = (
    StatsField("PREPROCESS_CACHE_BYTES", "gauge", "bytes", "memory",
               "Bytes of decoded images in the preprocess cache.",
               "inboxd_preprocess_cache_bytes"),
    StatsField("PREPROCESS_CACHE_CAPACITY_BYTES", "gauge", "bytes", "memory",
               "The preprocess cache's byte bound (capacity.preprocess_cache_mb).",
               "inboxd_preprocess_cache_capacity_bytes"),
    StatsField("PREPROCESS_CACHE_HIGH_WATER_BYTES", "gauge", "bytes", "memory",
               "The most bytes the preprocess cache has held since start.",
               "inboxd_preprocess_cache_high_water_bytes"),
    StatsField("PUT_WAIT_MS_P50", "histogram", "ms", "timing",
               "How long queue.put() waited for room.", "inboxd_put_wait_seconds", MS),
    StatsField("PUT_WAIT_MS_P99", "histogram", "ms", "timing",
               "How long queue.put() waited for room.", "inboxd_put_wait_seconds", MS),
    StatsField("PUT_WAIT_MS_MAX", "histogram", "ms", "timing",
               "How long queue.put() waited for room.", "inboxd_put_wait_seconds", MS),
    StatsField("LATENCY_MS_P50", "histogram", "ms", "timing",
               "From noticing a file to its durable result.", "inboxd_latency_seconds", MS),
    StatsField("LATENCY_MS_P99", "histogram", "ms", "timing",
               "From noticing a file to its durable result.", "inboxd_latency_seconds", MS),
    StatsField("BATCH_SIZE_P50", "histogram", "images", "timing", "Images per model call.",
               "inboxd_batch_size"),
    StatsField("FILES_PER_S", "gauge", "files/s", "timing",
               "Files completed per second since the last stats record.",
               "inboxd_files_per_second"),
    StatsField("UPTIME_S", "gauge", "s", "timing", "Seconds since the daemon started.",
               "inboxd_uptime_seconds"),
    StatsField("MODEL_UNAVAILABLE_S", "gauge", "s", "timing",
               "Seconds the model has been unreachable (0 while it answers).",
               "inboxd_model_unavailable_seconds"),
    StatsField("OUTPUT_FULL_S", "gauge", "s", "timing",
               "Seconds an output folder has been full or read-only, the daemon waiting for "
               "room (0 while every output takes writes).", "inboxd_output_full_seconds"),
    StatsField("OUTPUT_FULL_WAITS", "counter", "waits", "timing",
               "Times an output folder was found full or read-only and the daemon began to "
               "wait for room.", "inboxd_output_full_waits"),
    StatsField("OUTPUT_PROBES", "counter", "probes", "timing",
               "Probes of full output folders (one small durable write each).",
               "inboxd_output_probes"),
    StatsField("RSS_BYTES", "gauge", "bytes", "memory", "Resident set size of the daemon.",
               "inboxd_rss_bytes"),
    # On a GPU only (models.memory), as of the last stats record: reading them resets the peak.
    StatsField("CUDA_ALLOCATED_BYTES", "gauge", "bytes", "cuda",
               "torch.cuda.memory_allocated(): what live tensors use.",
               "inboxd_cuda_allocated_bytes"),
    StatsField("CUDA_RESERVED_BYTES", "gauge", "bytes", "cuda",
               "torch.cuda.memory_reserved(): what the caching allocator holds.",
               "inboxd_cuda_reserved_bytes"),
    StatsField("CUDA_PEAK_ALLOCATED_BYTES", "gauge", "bytes", "cuda",
               "torch.cuda.max_memory_allocated() since the stats record before.",
               "inboxd_cuda_max_allocated_bytes"),
    StatsField("CUDA_FREE_BYTES", "gauge", "bytes", "cuda",
               "The device's free memory (torch.cuda.mem_get_info).", "inboxd_cuda_free_bytes"),
    StatsField("CUDA_TOTAL_BYTES", "gauge", "bytes", "cuda",
               "The device's total memory (torch.cuda.mem_get_info).",
               "inboxd_cuda_total_bytes"),
    StatsField("CUDA_ALLOC_RETRIES", "counter", "retries", "cuda",
               "Times the caching allocator freed its cache to satisfy a request.",
               "inboxd_cuda_alloc_retries"),
    StatsField("CUDA_OOMS", "counter", "errors", "cuda",
               "CUDA out-of-memory errors the allocator raised.", "inboxd_cuda_ooms"),
    StatsField("CUDA_PINNED_HOST_BYTES", "gauge", "bytes", "cuda",
               "Pinned host memory allocated for copies to the device.",
               "inboxd_cuda_pinned_host_bytes"),
    # engine: ray only (models.engines.ray_serve.RayEngine.stats_fields).
    StatsField("RAY_CONNECTED", "gauge", "bool", "ray",
               "1 while the Ray cluster is connected.", "inboxd_ray_connected"),
    StatsField("RAY_CONNECTS", "counter", "connections", "ray",
               "Connections made to the Ray cluster (reconnections included).",
               "inboxd_ray_connects"),
    StatsField("RAY_LOST_BATCHES", "counter", "batches", "ray",
               "Batches lost on the cluster (a replica or node died) and retried.",
               "inboxd_ray_lost_batches"),
    StatsField("RAY_REPLICA_LATENCY_MS", "journal", "ms", "ray",
               "Per replica p50/p95 as JSON: journal only, since replica names change with "
               "every restart (a label per name would grow without bound); "
               "inboxd_inference_seconds covers the latency.", None),
)
FIELDS: dict[str, StatsField] = {f.name: f for f in (*COUNTER_FIELDS, *OTHER_FIELDS)}


def declared(name: str) -> tuple[StatsField, str | None] | None:
    """The declaration of record field ``name``, and the layer it belongs to (lowercase) when
    it is one of a layer's fields; None for a name the record must not carry."""
    if name in FIELDS:
        return FIELDS[name], None
    for field_ in LAYER_FIELDS:
        layer = name.removesuffix(f"_{field_.name}")
        if layer != name and layer and layer not in FIELDS:
            return field_, layer.lower()
    return None


class Stats:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.counters = Counters()
        self.failed_by_class = dict.fromkeys(REASON_CLASSES, 0)
        self.layers: list[Layer] = []
        self.put_wait_ms = Window()
        self.latency_ms = Window()
        self.batch_sizes = Window()
        self.inference_ms = Window()  # one sample per model call (a whole batch)
        self.started_s = clock()
        self._last_completed = 0
        self._last_s = self.started_s
        self.memory_probe: Callable[[], dict[str, int]] = lambda: {}
        self.last_memory: dict[str, int] = {}  # the probe's reading at the last record

    def register(self, *layers: Layer) -> None:
        self.layers.extend(layers)

    def recent_files_per_s(self) -> float:
        """Completions per second since the last stats record (for STATUS=, between records)."""
        elapsed = max(self.clock() - self._last_s, 1e-9)
        return (self.counters.completed - self._last_completed) / elapsed

    def snapshot(self, reset: bool = True) -> dict[str, Any]:
        """Every figure of the ``stats`` record, as uppercase journal field names (declared in
        FIELDS). ``reset``: this is a record, which starts the next interval (files/s, the CUDA
        peak); a scrape passes False and sees the memory figures of the last record."""
        now = self.clock()
        files_per_s = self.recent_files_per_s()
        if reset:
            self._last_completed, self._last_s = self.counters.completed, now
            self.last_memory = self.memory_probe()
        fields: dict[str, Any] = {k.upper(): v for k, v in vars(self.counters).items()}
        for layer in self.layers:
            for name in (layer.name, DEPRECATED_LAYER_NAMES.get(layer.name)):
                if name is not None:
                    prefix = name.upper()
                    fields[f"{prefix}_SIZE"] = layer.size
                    fields[f"{prefix}_CAPACITY"] = layer.capacity
                    fields[f"{prefix}_HIGH_WATER"] = layer.high_water
        fields.update(
            PUT_WAIT_MS_P50=round(self.put_wait_ms.percentile(50), 3),
            PUT_WAIT_MS_P99=round(self.put_wait_ms.percentile(99), 3),
            PUT_WAIT_MS_MAX=round(self.put_wait_ms.max_seen, 3),
            LATENCY_MS_P50=round(self.latency_ms.percentile(50), 3),
            LATENCY_MS_P99=round(self.latency_ms.percentile(99), 3),
            BATCH_SIZE_P50=self.batch_sizes.percentile(50),
            FILES_PER_S=round(files_per_s, 3),
            UPTIME_S=round(now - self.started_s, 3),
            RSS_BYTES=rss_bytes(),
        )
        fields.update(self.last_memory)
        return fields


def rss_bytes() -> int:
    """Resident set size now (not the peak), from /proc: cheap enough for every stats record."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
