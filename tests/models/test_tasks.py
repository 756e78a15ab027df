"""Several tasks per photo (``models:``): one read and one decode per photo, each task its own
input cut from it, one result with a section per task, and a task that fails on one photo
leaving the other tasks' answers and the photo's one outcome intact."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from inboxd.config import ConfigError, load_config
from inboxd.decode import pillow
from inboxd.decode.pool import DecodePool
from inboxd.decode.spec import PreprocessSpec, fit_size
from inboxd.item import DecodedImage, ModelError, TransientError, WorkItem
from inboxd.models.tasks import joined, task_copy
from PIL import Image

from support.photos import png_bytes
from tests import detectors
from tests.conftest import write_config
from tests.decode.test_pool import settings

MAX_PIXELS = 89_478_485
CROP = PreprocessSpec(256, 224, "bicubic", (0.5,) * 3, (0.5,) * 3)
FIT = PreprocessSpec.fit(320, "bilinear", (0.0,) * 3, (1.0,) * 3)


def test_one_decode_gives_each_task_its_own_input(monkeypatch: pytest.MonkeyPatch) -> None:
    """Opened and decoded once; the crop is the one-task crop, the fitted image the one-task
    fitted image, to the bit."""
    data = png_bytes((900, 600))
    opened = []
    real_open = pillow.Image.open

    def counting_open(*args: Any, **kwargs: Any) -> Image.Image:
        opened.append(1)
        return real_open(*args, **kwargs)

    monkeypatch.setattr(pillow.Image, "open", counting_open)
    both = pillow.decode_image(data, CROP, MAX_PIXELS, [FIT])
    assert len(opened) == 1
    assert both.pixels.shape == (224, 224, 3) and both.others[0].shape == (213, 320, 3)
    assert both.nbytes == 224 * 224 * 3 + 213 * 320 * 3  # the cache counts every task's bytes
    assert np.array_equal(both.pixels, pillow.decode_image(data, CROP, MAX_PIXELS).pixels)
    assert np.array_equal(both.others[0], pillow.decode_image(data, FIT, MAX_PIXELS).pixels)
    assert np.array_equal(both.for_task(1).pixels, both.others[0])
    assert (both.for_task(1).width, both.for_task(1).height) == (900, 600)


def test_a_decode_worker_replies_with_every_task_s_input_for_one_read(tmp_path: Path) -> None:
    pool = DecodePool(1, replace(settings(CROP), other_specs=(FIT,)))
    try:
        paths = []
        for n, size in enumerate([(900, 600), (500, 1000)]):
            paths.append(tmp_path / f"{n}.png")
            paths[-1].write_bytes(png_bytes(size))
        results = pool.decode_many([(p, None) for p in paths])
        assert pool.answered == 2  # one answer per file, holding both tasks' images
        for result, size in zip(results, [(900, 600), (500, 1000)], strict=True):
            assert result.error is None and result.image is not None, result
            w, h = fit_size(*size, 320)
            assert result.image.pixels.shape == (224, 224, 3)
            assert [o.shape for o in result.image.others] == [(h, w, 3)]
    finally:
        pool.close()


def item_with(image: DecodedImage) -> WorkItem:
    item = WorkItem(Path("/in"), "a.png", "a.png", "/in/.processing/a.png")
    item.image = image
    return item


def test_a_task_s_own_failure_stays_in_its_section_and_a_transient_one_retries_the_photo(
) -> None:
    image = DecodedImage(np.zeros((224, 224, 3), np.uint8), 10, 10, "PNG", "RGB",
                         others=(np.zeros((32, 32, 3), np.uint8),))
    item = item_with(image)
    twins = [task_copy(item, 0), task_copy(item, 1)]
    assert twins[1].image is not None and twins[1].image.pixels.shape == (32, 32, 3)
    failed = ModelError("the model failed on this input: boom")
    detections = detectors_result()
    photo, outcome = joined(item, {"labels": (twins[0], failed), "things": (twins[1],
                                                                            detections)})
    assert photo is item
    assert not isinstance(outcome, Exception)
    assert outcome.sections == {"labels": failed, "things": detections}  # type: ignore[union-attr]
    _, again = joined(item, {"labels": (twins[0], TransientError("CUDA out of memory")),
                             "things": (twins[1], detections)})
    assert isinstance(again, TransientError)


def detectors_result() -> Any:
    from inboxd.models.detect.geometry import Detections

    return Detections([[1.0, 2.0, 3.0, 4.0]], [0.5], [0], ["cat"], (32, 32))


def test_models_config_is_checked_with_the_task_s_key(tmp_path: Path) -> None:
    config = write_config(tmp_path, model=None, models={
        "labels": {"name": "efficientnet_lite0"},
        "things": {"onnx": str(tmp_path / "missing.onnx"), "output": "detect"}})
    done = subprocess.run([sys.executable, "-m", "inboxd", "check-config", "-c", str(config)],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert done.returncode == 78
    assert "models.things.onnx: cannot read" in done.stderr
    both = tmp_path / "both.yaml"
    both.write_text("model: {name: efficientnet_lite0}\nmodels: {labels: {}}\n")
    with pytest.raises(ConfigError, match=r"give model: \(one task\) or models: \(several\), not"):
        load_config(both)


@pytest.fixture(scope="module")
def tasks_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tasks")
    labels = root / "labels.txt"
    labels.write_text("\n".join(detectors.LABELS) + "\n")
    # Fails on a photo whose letterbox is brighter than 0.6 on average: a real model error.
    onnx = detectors.yolo_onnx(root / "yolo.onnx", fails_above_mean=0.6)
    return write_config(root, model=None, models={
        "labels": {"name": "efficientnet_lite0", "runtime": "torch", "precision": "fp32",
                   "top_k": 3},
        "text": {"name": "ocr"},
        "things": {"onnx": str(onnx), "output": "detect", "labels": str(labels),
                   "detect": {"score_threshold": detectors.SCORE_THRESHOLD}}})


@pytest.mark.daemon
@pytest.mark.slow  # a costly run: `make test`, not the fast tier
def test_one_result_holds_every_task_s_section_and_a_task_s_failure_leaves_the_rest(
        tasks_config: Path) -> None:
    root = tasks_config.parent
    from support.text_images import receipt_total

    (root / "models").mkdir(exist_ok=True)
    photos = {"dark.png": png_bytes((640, 480), 20), "noisy.png": png_bytes((500, 800)),
              "bright.png": png_bytes((640, 480), 250),
              "receipt.png": receipt_total().save(root / "models").read_bytes()}
    for name, data in photos.items():
        (root / "inbox" / name).write_bytes(data)
    done = subprocess.run([sys.executable, "-m", "inboxd", "once", "-c", str(tasks_config)],
                          capture_output=True, text=True, cwd=root, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    for name in photos:
        result = json.loads((root / "results" / f"{name}.json").read_text())
        assert "top_k" not in result and "model" not in result  # sections only
        labels, things, text = result["labels"], result["things"], result["text"]
        assert text["model"] == "ocr" and "full_text" in text["ocr"]
        if name == "receipt.png":
            assert text["ocr"]["full_text"] == "Total 348.20 EUR"
        assert labels["model"] == "efficientnet_lite0" and len(labels["top_k"]) == 3
        assert things["model"] == "yolo.onnx" and things["runtime"] == "onnxruntime"
        width, height = result["image"]["width"], result["image"]["height"]
        if name == "bright.png":  # the detector raises on it
            assert "detections" not in things
            assert things["reason_class"] == "model"
            assert "the model failed on this input" in things["error"]
        else:
            assert things["detections"] == detectors.expected_boxes(width, height)
        assert (root / "done" / name).is_file()
    assert not list((root / "failed").glob("*")) if (root / "failed").exists() else True
    listed = subprocess.run([sys.executable, "-m", "inboxd", "models", "-c", str(tasks_config)],
                            capture_output=True, text=True, cwd=root, timeout=600)
    assert listed.returncode == 0, listed.stderr[-2000:]
    assert "task labels" in listed.stdout and "task things" in listed.stdout
    assert "detect: up to 100 boxes" in listed.stdout


@pytest.mark.daemon
@pytest.mark.slow  # a detector and a classifier daemon: `make test`, not the fast tier
def test_each_real_task_batches_at_its_own_size_within_the_join(tmp_path: Path) -> None:
    """Two real models of different speeds (EfficientNet-Lite0 in eager torch, a constructed
    YOLO-layout ONNX) with batch sizes 3 and 2: the stats record's batch layers show each
    task's own size, every layer stays within its capacity (the task join at 5), and every
    photo gets one result with both tasks' answers."""
    labels = tmp_path / "labels.txt"
    labels.write_text("\n".join(detectors.LABELS) + "\n")
    onnx = detectors.yolo_onnx(tmp_path / "yolo.onnx")
    config = write_config(tmp_path, model=None, capacity={"task_join": 5}, models={
        "labels": {"name": "efficientnet_lite0", "runtime": "torch", "precision": "fp32",
                   "top_k": 1, "batch": {"max_size": 3, "max_delay_ms": 200}},
        "things": {"onnx": str(onnx), "output": "detect", "labels": str(labels),
                   "batch": {"max_size": 2, "max_delay_ms": 200}}})
    for n in range(24):
        (tmp_path / "inbox" / f"p{n:02}.png").write_bytes(png_bytes((320 + n, 240)))
    done = subprocess.run([sys.executable, "-m", "inboxd", "once", "-c", str(config)],
                          capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "torch fp32, batches of 3, 1 in flight" in done.stderr  # the started record
    assert "onnxruntime fp32, batches of 2, 1 in flight" in done.stderr
    assert "5 photos in the task join" in done.stderr
    shown = subprocess.run([sys.executable, "-m", "inboxd", "stats", "-c", str(config),
                            "--json"], capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert shown.returncode == 0, shown.stderr[-2000:]
    record = json.loads(shown.stdout.splitlines()[-1])
    figure = {key: int(value) for key, value in record.items()
              if key.endswith(("_SIZE", "_CAPACITY", "_HIGH_WATER"))
              and not key.startswith("PREPROCESS_CACHE_")}  # its bytes are checked elsewhere
    assert figure["BATCH_LABELS_HIGH_WATER"] == figure["BATCH_LABELS_CAPACITY"] == 3
    assert figure["BATCH_THINGS_HIGH_WATER"] == figure["BATCH_THINGS_CAPACITY"] == 2
    assert figure["TASK_JOIN_CAPACITY"] == 5 and 1 <= figure["TASK_JOIN_HIGH_WATER"] <= 5
    layers = [key.removesuffix("_CAPACITY") for key in figure if key.endswith("_CAPACITY")]
    assert {"MODEL_LABELS", "MODEL_THINGS"} <= set(layers) and "IN_FLIGHT" not in layers
    assert [layer for layer in layers
            if figure[f"{layer}_HIGH_WATER"] > figure[f"{layer}_CAPACITY"]] == []
    for n in range(24):
        result = json.loads((tmp_path / "results" / f"p{n:02}.png.json").read_text())
        assert len(result["labels"]["top_k"]) == 1 and "detections" in result["things"]
        assert (tmp_path / "done" / f"p{n:02}.png").is_file()
