"""Detection, OCR and ``models:`` on ``engine: ray``, end to end: the real daemon (``inboxd once``
as a subprocess) against a real one-node Ray cluster on the loopback interface, the same photos
through the same config with every task ``local``, every task ``ray``, and one of each. The
replicas run what the local engine runs (a constant YOLO-layout ONNX detector whose boxes are
known exactly, the PP-OCRv4 networks from the wheel), so the results must be the local ones:
the same detections (boxes within 1 px), the same text lines, the same task failure on the photo
the detector fails on.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from support.harness import free_port
from support.photos import png_bytes
from support.text_images import TextImage, receipt_total
from tests import detectors
from tests.conftest import write_config

ray_cluster_utils = pytest.importorskip("ray.cluster_utils")

pytestmark = [pytest.mark.ray, pytest.mark.daemon, pytest.mark.slow, pytest.mark.timeout(1200)]

LOOPBACK = "127.0.0.1"
RESOURCE = "fakegpu"
BOX_TOLERANCE_PX = 1.0


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """One node holding a fakegpu for each replica the tests deploy at once."""
    old = os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")
    # Without it the driver resolves 127.0.0.1 to the machine's external address.
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    port = free_port()
    local = ray_cluster_utils.Cluster(
        initialize_head=True, shutdown_at_exit=True,
        head_node_args={"gcs_server_port": port, "num_cpus": 2, "node_ip_address": LOOPBACK,
                        "include_dashboard": False, "resources": {RESOURCE: 4}})
    yield f"{LOOPBACK}:{port}"
    local.shutdown()
    if old is None:
        os.environ.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
    else:
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = old


def photos(folder: Path) -> dict[str, bytes]:
    """Text stored upright and turned (EXIF 6 and 8), a landscape and a portrait photo, and a
    bright one the detector fails on (a model error of that photo's, in its task section)."""
    total = receipt_total()
    texts = {f"total-{o}": TextImage(f"total-{o}", total.image, total.lines, total.boxes, o)
             for o in (1, 6, 8)}
    out = {path.name: path.read_bytes()
           for path in (text.save(folder) for text in texts.values())}
    return {**out, "landscape.png": png_bytes((700, 300)), "portrait.png": png_bytes((300, 700)),
            "bright.png": png_bytes((640, 480), 250)}


def task_blocks(root: Path, address: str, *on_ray: str) -> dict[str, Any]:
    labels = root / "labels.txt"
    labels.write_text("\n".join(detectors.LABELS) + "\n")
    onnx = detectors.yolo_onnx(root / "yolo.onnx", fails_above_mean=0.6)
    blocks: dict[str, Any] = {
        "things": {"onnx": str(onnx), "output": "detect", "labels": str(labels),
                   "detect": {"score_threshold": detectors.SCORE_THRESHOLD}},
        "text": {"name": "ocr", "max_regions": 20},
    }
    for task in on_ray:
        blocks[task] |= {"engine": "ray", "ray": {
            "address": address, "replicas": 1, "replica_resources": {RESOURCE: 1},
            "app_name": f"inboxd_{task}", "call_timeout_s": 120}}
    return blocks


def run_once(root: Path, address: str, *on_ray: str) -> dict[str, dict[str, Any]]:
    """``inboxd once`` over the photos with the tasks ``on_ray`` on the cluster: the results.
    The crop layer (``capacity.ocr_crops: 2``) is within its bound wherever OCR ran: the
    last stats record's high-water mark is the local reader's, or the replicas'."""
    root.mkdir()
    (root / "inbox").mkdir()
    (root / "seeds").mkdir()
    config = write_config(root, model=None, models=task_blocks(root, address, *on_ray),
                          capacity={"ocr_crops": 2}, batch={"max_size": 4})
    for name, data in photos(root / "seeds").items():
        (root / "inbox" / name).write_bytes(data)
    done = subprocess.run([sys.executable, "-m", "inboxd", "once", "-c", str(config)],
                          capture_output=True, text=True, cwd=root, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    results = {path.name.removesuffix(".json"): json.loads(path.read_text())
               for path in (root / "results").glob("*.json")}
    assert set(results) == set(photos(root / "seeds")), "every photo one result"
    assert not [p for p in (root / "failed").rglob("*") if p.is_file()], "none failed"
    for task in on_ray:  # the started record says where each task runs
        assert f"on Ray Serve application inboxd_{task} at {address}" in done.stderr, task
    [*_, last] = re.findall(r"OCR_CROPS_CAPACITY=(\d+) OCR_CROPS_HIGH_WATER=(\d+)", done.stderr)
    assert last[0] == "2" and 1 <= int(last[1]) <= 2, last
    return results


def assert_same_answers(ours: dict[str, Any], local: dict[str, Any], name: str) -> None:
    things, expected = ours["things"], local["things"]
    if "detections" not in expected:  # the detector's own failure on this photo
        assert "detections" not in things and things["reason_class"] == "model", (name, things)
        assert "the model failed on this input" in things["error"], (name, things)
    else:
        assert len(things["detections"]) == len(expected["detections"]), (name, things)
        for got, want in zip(things["detections"], expected["detections"], strict=True):
            assert (got["label"], got["index"]) == (want["label"], want["index"]), name
            assert abs(got["score"] - want["score"]) < 1e-6, name
            assert all(abs(a - b) <= BOX_TOLERANCE_PX
                       for a, b in zip(got["box"], want["box"], strict=True)), (name, got, want)
        width, height = ours["image"]["width"], ours["image"]["height"]
        assert things["detections"] == detectors.expected_boxes(width, height), name
    text, expected_text = ours["text"]["ocr"], local["text"]["ocr"]
    assert [line["text"] for line in text["lines"]] == [
        line["text"] for line in expected_text["lines"]], name
    assert text["full_text"] == expected_text["full_text"] and text["cut"] == expected_text["cut"]
    for got, want in zip(text["lines"], expected_text["lines"], strict=True):
        assert all(abs(a - b) <= BOX_TOLERANCE_PX for p, q in zip(got["polygon"], want["polygon"],
                                                                  strict=True)
                   for a, b in zip(p, q, strict=True)), (name, got, want)


def test_detection_and_ocr_on_ray_give_the_local_engine_s_results(
        tmp_path: Path, cluster: str) -> None:
    local = run_once(tmp_path / "local", cluster)
    for name in ("total-1", "total-6", "total-8"):
        assert local[f"{name}.{'png' if name.endswith('1') else 'jpg'}"]["text"]["ocr"][
            "full_text"] == "Total 348.20 EUR"
    assert "detections" not in local["bright.png"]["things"]
    for on_ray in (("things", "text"), ("things",)):  # every task on the cluster; one of each
        results = run_once(tmp_path / "-".join(on_ray), cluster, *on_ray)
        for name, result in results.items():
            assert_same_answers(result, local[name], name)
    listed = subprocess.run([sys.executable, "-m", "inboxd", "models", "-c",
                             str(tmp_path / "things-text" / "inboxd.yaml")],
                            capture_output=True, text=True, timeout=600)
    assert listed.returncode == 0, listed.stderr[-3000:]
    for task in ("things", "text"):
        assert f"Ray Serve application inboxd_{task} at {cluster} (already running" in \
            listed.stdout, listed.stdout

    # A running application under the task's name that runs another model (here: another
    # score threshold) is refused, never used: it would answer with its own results.
    changed = tmp_path / "changed"
    changed.mkdir()
    blocks = task_blocks(changed, cluster, "things")
    blocks["things"]["detect"]["score_threshold"] = 0.5
    config = write_config(changed, model=None, models=blocks)
    refused = subprocess.run([sys.executable, "-m", "inboxd", "models", "-c", str(config)],
                             capture_output=True, text=True, timeout=600)
    assert refused.returncode == 78, refused.stdout + refused.stderr[-3000:]
    assert "runs another model" in refused.stderr, refused.stderr[-3000:]
    assert "give this model block its own ray.app_name" in refused.stderr
