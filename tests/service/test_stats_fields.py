"""The stats record's fields are declared once (``inboxd.stats.FIELDS``); the journal record,
the Prometheus exporter and ``inboxd stats`` follow that declaration. A full record (the CUDA
figures with the CUDA memory API faked at the device, the Ray figures from a real RayEngine
that never connected) must be declared field by field, exported series by series and read back.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
from inboxd.config import load_config
from inboxd.models.engines.ray_serve import RayEngine
from inboxd.models.memory import cuda_memory_fields
from inboxd.pipeline.wiring import Pipeline
from inboxd.service.metrics import Metrics
from inboxd.service.readback import clean, format_table
from inboxd.stats import DEPRECATED_LAYER_NAMES, FIELDS, REASON_CLASSES, Window, declared
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import make_image, write_config
from tests.fakes import FakeModel
from tests.models.test_gpu_faults import FakeCudaMemory

# Figures that move between the record and the scrape after it (a clock, files/s since the
# last record, RSS): exported once each, the value not compared.
MOVING = {"UPTIME_S", "FILES_PER_S", "RSS_BYTES"}


def full_pipeline(tmp_path: Path) -> tuple[Pipeline, Metrics]:
    config = load_config(write_config(tmp_path))
    model = FakeModel()
    pipeline = Pipeline(config, model)  # type: ignore[arg-type]
    cuda = FakeCudaMemory()
    pipeline.stats.memory_probe = lambda: cuda_memory_fields(torch.device("cuda", 0), cuda)
    ray = RayEngine(model, config.model, 4)  # type: ignore[arg-type]
    ray.connects, ray.lost_batches = 2, 1
    ray.replica_ms["node1:41"] = Window()
    ray.replica_ms["node1:41"].add(12.5)
    pipeline.engine = pipeline.report.engine = ray  # only its stats_fields is asked for
    metrics = Metrics(config)
    metrics.attach(pipeline)  # before the files: the histograms see every sample
    for n in range(3):
        make_image(tmp_path / "inbox" / f"{n}.png")
    (tmp_path / "inbox" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(40))
    asyncio.run(pipeline.process_backlog())
    return pipeline, metrics


def exported(metrics: Metrics) -> dict[str, list[Any]]:
    """Series name → its samples, every sample name without the _total/_count suffixes."""
    families = text_string_to_metric_families(metrics.exposition().decode())
    return {family.name: family.samples for family in families}


def test_every_field_of_a_full_record_is_declared_exported_and_read_back(
        tmp_path: Path) -> None:
    pipeline, metrics = full_pipeline(tmp_path)
    record = pipeline.report.log_stats()
    assert record["COMPLETED"] == 3 and record["FAILED"] == 1
    assert {"CUDA_PEAK_ALLOCATED_BYTES", "CUDA_OOMS", "RAY_LOST_BATCHES", "IGNORED",
            "EVENT_BUFFER_HIGH_WATER"} <= set(record)
    undeclared = [name for name in record if declared(name) is None]
    assert undeclared == [], "declare these in inboxd.stats.FIELDS"
    series = exported(metrics)
    missing = []
    for name, value in record.items():
        field, layer = declared(name)  # type: ignore[misc]
        if field.metric is None:
            assert field.kind == "journal" and "journal only" in field.help
            continue
        samples = series.get(field.metric, [])
        if field.kind == "histogram":
            if not any(s.name == f"{field.metric}_count" and s.value > 0 for s in samples):
                missing.append(name)
            continue
        wanted = {"layer": layer} if layer is not None else {}
        values = [s.value for s in samples if s.name in (field.metric, f"{field.metric}_total")
                  and all(s.labels.get(k) == v for k, v in wanted.items())]
        if name == "FAILED":  # by reason class, which sum to the record's figure
            assert len(values) == len(REASON_CLASSES)
            values = [sum(values)]
        if name in MOVING:
            if len(values) != 1:
                missing.append(f"{name} as {field.metric}: {values}")
        elif values != [pytest.approx(value * field.scale)]:
            missing.append(f"{name}={value} as {field.metric}: {values}")
    assert missing == [], "not exported (or with another value)"
    # `inboxd stats`: the journal gives every field back as text; all of it is shown.
    entry = {key: str(value) for key, value in record.items()}
    read = clean({**entry, "MESSAGE": "stats", "INBOXD_EVENT": "stats", "INSTANCE": "default"})
    assert {key: read[key] for key in record} == record
    table = format_table(read)
    for name in record:
        field, layer = declared(name)  # type: ignore[misc]
        if layer not in DEPRECATED_LAYER_NAMES.values():
            assert (layer or name.lower()) in table, name
    assert "ignored 0" in table and "cuda_peak_allocated_bytes" in table


def test_the_declaration_names_each_series_once_with_its_unit() -> None:
    """Two fields may share a series only as one histogram's percentiles; base units only."""
    by_metric: dict[str, set[str]] = {}
    for field in FIELDS.values():
        if field.metric is not None:
            by_metric.setdefault(field.metric, set()).add(field.kind)
            assert not field.metric.endswith("_ms"), field
            if field.unit == "ms":
                assert field.metric.endswith("_seconds") and field.scale == 0.001, field
    shared = {metric for metric, kinds in by_metric.items() if kinds != {"histogram"}
              and sum(f.metric == metric for f in FIELDS.values()) > 1}
    assert shared == set()


def test_a_renamed_layer_keeps_its_old_fields_for_one_release(tmp_path: Path) -> None:
    """The preprocess layer was called ``decoding``: a record still carries DECODING_* beside
    PREPROCESS_* (same values), the scrape both labels, and ``inboxd stats`` the new name only."""
    pipeline, metrics = full_pipeline(tmp_path)
    record = pipeline.report.log_stats()
    for part in ("SIZE", "CAPACITY", "HIGH_WATER"):
        assert record[f"DECODING_{part}"] == record[f"PREPROCESS_{part}"], part
    assert record["PREPROCESS_CAPACITY"] > 0
    capacities = {s.labels["layer"]: s.value
                  for s in exported(metrics)["inboxd_layer_capacity_items"]}
    assert capacities["decoding"] == capacities["preprocess"] == record["PREPROCESS_CAPACITY"]
    entry = {key: str(value) for key, value in record.items()}
    table = format_table(clean({**entry, "MESSAGE": "stats", "INBOXD_EVENT": "stats",
                                "INSTANCE": "default"}))
    assert "preprocess " in table and "decoding" not in table
    # The result writer's layer was called ``write_handoff``: the same for it.
    for part in ("SIZE", "CAPACITY", "HIGH_WATER"):
        assert record[f"WRITE_HANDOFF_{part}"] == record[f"RESULT_WRITER_{part}"], part
    assert record["RESULT_WRITER_CAPACITY"] > 0
    assert capacities["write_handoff"] == capacities["result_writer"]
    assert "result_writer " in table and "write_handoff" not in table
    # The model stage's layer was called ``in_flight``: the same for it.
    for part in ("SIZE", "CAPACITY", "HIGH_WATER"):
        assert record[f"IN_FLIGHT_{part}"] == record[f"MODEL_{part}"], part
    assert record["MODEL_CAPACITY"] > 0 and record["MODEL_HIGH_WATER"] >= 1
    assert capacities["in_flight"] == capacities["model"]
    assert "model " in table and "in_flight" not in table
