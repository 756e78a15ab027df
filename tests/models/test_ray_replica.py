"""What a Ray Serve replica runs, without Ray: ``Replica`` is a plain class Serve calls, so it is
built here from the files the ingest host ships (the originals deleted first) and called as
Serve would. A detector replica answers what the local detector answers; an OCR replica reads
what the local reader reads, within its two bounds (``max_regions`` from the model block,
``capacity.ocr_crops`` sent with each call); a reply that is not the task's answer, or is past
its bound, is that photo's retry on the ingest host. The whole path through a real cluster is
``tests/models/test_ray_tasks.py``'s."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from inboxd.config import ConfigError, ModelConfig, load_config
from inboxd.decode.spec import fit_size
from inboxd.item import DecodedImage, TransientError, WorkItem
from inboxd.models.detect.geometry import Detections
from inboxd.models.engines.local import infer_splitting
from inboxd.models.engines.ray_replica import (
    Expected,
    Replica,
    decode_reply,
    expected_answer,
    model_files,
    model_fingerprint,
)
from inboxd.models.loading import load_model
from inboxd.models.predictions import Classification

from support.text_images import dense_page
from tests import detectors
from tests.conftest import write_config

RAY = {"address": "127.0.0.1:1", "replica_resources": {"CPU": 1}}


def ray_block(tmp_path: Path, model: dict[str, Any]) -> ModelConfig:
    return load_config(write_config(tmp_path, model={**model, "engine": "ray",
                                                     "ray": RAY})).model


def shipped_replica(config: ModelConfig, folder: Path) -> Replica:
    """A replica built as Serve builds it, from the bytes the ingest host sends: the model's
    own folder is gone by then, so a file not shipped would fail the load."""
    files = model_files(config)
    shutil.rmtree(folder)
    return Replica(config.model_dump(mode="json"), files, 4)


def local_answers(model: Any, photos: list[tuple[np.ndarray, tuple[int, int]]]) -> list[Any]:
    items = [WorkItem(Path(), str(n), str(n), "",
                      image=DecodedImage(pixels, width, height, None, "RGB"))
             for n, (pixels, (width, height)) in enumerate(photos)]
    return [outcome for _, outcome in infer_splitting(model, items)]


def fitted_photos(sizes: list[tuple[int, int]], side: int) -> list[tuple[np.ndarray,
                                                                          tuple[int, int]]]:
    """What the decoder gives a detector: each photo fitted into ``side``², and its size."""
    rng = np.random.default_rng(0)
    out = []
    for width, height in sizes:
        fit_w, fit_h = fit_size(width, height, side)
        out.append((rng.integers(0, 200, (fit_h, fit_w, 3), dtype=np.uint8), (width, height)))
    return out


def test_an_onnx_detector_replica_built_from_shipped_files_answers_as_the_local_one(
        tmp_path: Path) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "labels.txt").write_text("\n".join(detectors.LABELS) + "\n")
    onnx = detectors.yolo_onnx(folder / "yolo.onnx")
    config = ray_block(tmp_path, {"onnx": str(onnx), "output": "detect",
                                  "labels": str(folder / "labels.txt"),
                                  "detect": {"score_threshold": detectors.SCORE_THRESHOLD}})
    local = load_model(config)
    photos = fitted_photos([(4000, 3000), (300, 900), (20, 10), (64, 64)], detectors.SIDE)
    expected = local_answers(local, photos)
    reply = shipped_replica(config, folder)(photos)
    answers = decode_reply(reply, len(photos), expected_answer("detect", config))
    assert all(isinstance(a, Detections) for a in answers), answers
    for (_, (width, height)), ours, theirs in zip(photos, answers, expected, strict=True):
        # The ingest host maps the fitted boxes to the displayed photo, as for the local engine.
        assert ours.in_photo(width, height) == theirs.in_photo(width, height)
        assert ours.in_photo(width, height) == detectors.expected_boxes(width, height)


def test_a_torchvision_detector_replica_answers_as_the_local_one(tmp_path: Path) -> None:
    import torchvision

    folder = tmp_path / "model"
    folder.mkdir()
    torch.manual_seed(0)
    network = torchvision.models.get_model("ssdlite320_mobilenet_v3_large", weights=None,
                                           weights_backbone=None, num_classes=91)
    torch.save(network.state_dict(), folder / "ssdlite.pth")
    config = ray_block(tmp_path, {"torchvision": "ssdlite320_mobilenet_v3_large",
                                  "weights": str(folder / "ssdlite.pth"), "output": "detect",
                                  "device": "cpu", "detect": {"score_threshold": 0.001}})
    local = load_model(config)
    photos = fitted_photos([(640, 480), (480, 640)], local.spec.crop)
    expected = local_answers(local, photos)
    answers = decode_reply(shipped_replica(config, folder)(photos), len(photos),
                           expected_answer("detect", config))
    assert sum(len(a.boxes) for a in expected) > 0, "random weights still find boxes"
    for ours, theirs in zip(answers, expected, strict=True):
        assert ours.indices == theirs.indices and ours.fitted_size == theirs.fitted_size
        assert np.allclose(ours.boxes, theirs.boxes, atol=1.0) if ours.boxes else not theirs.boxes


def test_an_ocr_replica_reads_as_the_local_reader_within_both_bounds(tmp_path: Path) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    config = ray_block(tmp_path, {"name": "ocr", "max_regions": 12})
    page = np.asarray(dense_page(1, side=600).image.convert("RGB"))
    displayed = (1200, 1200)  # the decoder fitted a photo twice the size: polygons scale back
    local = load_model(config)
    [expected] = local_answers(local, [(page, displayed)])
    replica = shipped_replica(config, folder)
    reply = replica([(page, displayed)], ocr_crops=3)
    [reading] = decode_reply(reply, 1, expected_answer("ocr", config))
    assert [line.text for line in reading.lines] == [line.text for line in expected.lines]
    assert len(reading.lines) <= 12 and reading.cut == expected.cut > 0, reading.cut
    assert np.allclose([line.polygon for line in reading.lines],
                       [line.polygon for line in expected.lines], atol=1.0)
    assert max(x for line in reading.lines for x, _ in line.polygon) > 600  # displayed pixels
    assert 1 <= reply["ocr_crops_high_water"] <= 3, reply["ocr_crops_high_water"]
    assert replica.model.crops.capacity == 3  # type: ignore[attr-defined]


def test_a_reply_that_is_not_the_task_s_answer_or_past_its_bound_is_that_photo_s_retry() -> None:
    def found(count: int) -> Detections:
        return Detections([[0.0, 0.0, 1.0, 1.0]] * count, [0.5] * count, [0] * count, ["a"],
                          (8, 8))

    expected = Expected((Detections,), max_entries=2)
    label = Classification([{"label": "a", "index": 0, "score": 1.0}])
    skewed = found(2)
    skewed.scores.pop()  # boxes and scores out of step
    outcomes = decode_reply({"outcomes": [("ok", found(2)), ("ok", found(3)), ("ok", label),
                                          ("ok", skewed)]}, 4, expected)
    assert isinstance(outcomes[0], Detections)
    assert all(isinstance(o, TransientError) for o in outcomes[1:]), outcomes


def test_check_config_takes_detect_ocr_and_tasks_on_ray_and_refuses_a_shared_app(
        tmp_path: Path) -> None:
    onnx = detectors.yolo_onnx(tmp_path / "yolo.onnx")
    (tmp_path / "labels.txt").write_text("\n".join(detectors.LABELS) + "\n")
    detect = {"onnx": str(onnx), "output": "detect", "labels": str(tmp_path / "labels.txt")}
    both = {"things": {**detect, "engine": "ray", "ray": {**RAY, "app_name": "things"}},
            "text": {"name": "ocr", "engine": "ray", "ray": {**RAY, "app_name": "text"}},
            "labels": {"name": "efficientnet_lite0"}}
    config = write_config(tmp_path, model=None, models=both)
    done = subprocess.run([sys.executable, "-m", "inboxd", "check-config", "-c", str(config)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    load_config(write_config(tmp_path, model={**detect, "engine": "ray", "ray": RAY}))
    shared = {task: {**block, "ray": RAY} if "ray" in block else block
              for task, block in both.items()}
    with pytest.raises(ConfigError) as caught:
        load_config(write_config(tmp_path, model=None, models=shared))
    assert "give each task its own ray.app_name" in str(caught.value), caught.value
    assert "models.text and models.things" in str(caught.value) or \
        "models.things and models.text" in str(caught.value)


def test_a_model_s_fingerprint_is_what_it_runs_not_where_its_files_are(tmp_path: Path) -> None:
    def fingerprint(folder: str, threshold: float = 0.25, names: str = "cat\ndog\n") -> str:
        root = tmp_path / folder
        root.mkdir(exist_ok=True)
        labels = root / "labels.txt"
        labels.write_text(names)
        onnx = detectors.yolo_onnx(root / "yolo.onnx")
        config = ray_block(root, {"onnx": str(onnx), "output": "detect", "labels": str(labels),
                                  "detect": {"score_threshold": threshold},
                                  "cache_dir": str(root / "cache")})
        return model_fingerprint(config.model_dump(mode="json"), model_files(config))

    same = fingerprint("a")
    assert fingerprint("b") == same  # another host's copy, at other paths
    assert fingerprint("c", threshold=0.5) != same
    assert fingerprint("d", names="cat\nbird\n") != same  # another file's bytes
