"""What one Ray Serve replica runs: the configured model, loaded from files inboxd shipped.

The ingest host sends the model block of its config and the bytes of every file it names
(weights, ``.pt2``, ``.onnx``, labels) as the deployment's init arguments, so a GPU host needs
only the inboxd package installed, not a copy of the model at the same path. The replica writes
them to a private temporary folder, loads the model with the same checks as the local engine
(``load_model``: a classifier, an embedder, a detector or OCR) and warms it up before Serve
routes anything to it.

A call gets a batch of photos as the decoder made them for this task (a crop, or the photo
fitted whole), each with its displayed (width, height), and returns one outcome per photo, in
order, through the local engine's splitting (``infer_splitting``): a model error on one input
fails that input only, CUDA OOM halves the batch. Every task's preprocessing after the decode
runs here exactly as in the local engine, because it is the same model object: a detector's
letterbox and its NMS (boxes come back in the fitted photo's pixels; the ingest host maps them
to the displayed photo, as it does for the local engine), OCR's regions, crops and recognition
(polygons in the displayed pixels the call carried). So OCR's two bounds hold here: at most
``max_regions`` regions per photo (the model block) and at most ``capacity.ocr_crops`` crops
waiting for the recogniser (sent with every call, so a SIGHUP reaches the replicas too). Calls
run one at a time on a replica, as on the local engine's model thread: the crop layer is one
reader's, and the next call waits on the replica already (Serve's ``max_ongoing_requests``).

A device fault poisons this replica's CUDA context: the replica reports the batch as lost (the
ingest host retries it elsewhere) and fails its health check, so Serve replaces it. Nothing
here imports Ray: Serve calls it like any class.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from inboxd.config import ModelConfig
from inboxd.item import DecodedImage, ModelError, PermanentError, TransientError, WorkItem
from inboxd.models.engines.interface import DeviceFault
from inboxd.models.engines.local import infer_splitting
from inboxd.models.predictions import Classification, Embedding, Output, TaskModel

MODEL_FILE_KEYS = ("export", "onnx", "weights", "labels")
# Keys of the model block that say where or how a host reaches the model, not what it runs.
NOT_THE_MODEL = ("engine", "ray", "cache_dir")

# {"replica", "ms", "outcomes": [("ok", Prediction) | (kind, why)]}, and for OCR
# "ocr_crops_high_water": the replica's crop layer's high-water mark.
Reply = dict[str, Any]
# One photo of a call: the pixels the decoder made for this task, and the displayed photo's
# (width, height), EXIF orientation applied (OCR's polygons are given in those pixels).
Photo = tuple[npt.NDArray[np.uint8], tuple[int, int]]


def model_fingerprint(model_config: dict[str, Any], files: dict[str, bytes]) -> str:
    """What a replica runs, as a short hash: the model block (JSON, as shipped) with each
    shipped file's path replaced by its bytes' sha256, less the keys that only say where it
    runs. Two ingest hosts with the same model at other paths agree; a changed threshold,
    region bound or weights file does not."""
    block = {key: value for key, value in model_config.items() if key not in NOT_THE_MODEL}
    for key, data in files.items():
        block[key] = hashlib.sha256(data).hexdigest()
    return hashlib.sha256(json.dumps(block, sort_keys=True).encode()).hexdigest()[:16]


def model_files(config: ModelConfig) -> dict[str, bytes]:
    """The bytes of every file the model block names, keyed by its key (on the ingest host)."""
    files: dict[str, bytes] = {}
    for key in MODEL_FILE_KEYS:
        path = getattr(config, key)
        if path is not None:
            files[key] = Path(path).read_bytes()
    return files


class Replica:
    def __init__(self, model_config: dict[str, Any], files: dict[str, bytes],
                 max_batch_size: int) -> None:
        from inboxd.models.loading import load_model

        self.folder = tempfile.TemporaryDirectory(prefix="inboxd-replica-")
        update: dict[str, Path] = {}
        for key, data in files.items():
            name = Path(model_config[key]).name
            path = Path(self.folder.name) / key / name
            path.parent.mkdir()
            path.write_bytes(data)
            update[key] = path
        config = ModelConfig.model_validate(model_config).model_copy(update=update)
        self.fingerprint = model_fingerprint(model_config, files)
        self.model: TaskModel = load_model(config)
        self.model.warm_up(self.model.warm_up_sizes(max_batch_size))
        self.name = f"{socket.gethostname()}:{os.getpid()}"
        self.broken: str | None = None
        # One call at a time, as on the local engine's model thread.
        self.running = threading.Lock()

    def __call__(self, photos: list[Photo], delay_s: float = 0.0,
                 ocr_crops: int | None = None) -> Reply:
        with self.running:
            return self._call(photos, delay_s, ocr_crops)

    def _call(self, photos: list[Photo], delay_s: float, ocr_crops: int | None) -> Reply:
        if self.broken is not None:
            raise RuntimeError(f"replica {self.name} is broken: {self.broken}")
        started = time.perf_counter()
        if delay_s:
            time.sleep(delay_s)
        crops = getattr(self.model, "crops", None)  # OCR's crop layer (models/ocr/reader.py)
        if crops is not None and ocr_crops is not None:
            crops.resize(ocr_crops)
        items = [_item(n, pixels, displayed) for n, (pixels, displayed) in enumerate(photos)]
        try:
            outcomes = infer_splitting(self.model, items)
        except DeviceFault as fault:
            self.broken = str(fault)
            raise RuntimeError(f"the device of replica {self.name} failed: {fault}") from None
        by_index: dict[int, Any] = {int(item.rel): outcome for item, outcome in outcomes}
        encoded: list[tuple[str, Any]] = []
        for n in range(len(photos)):
            outcome = by_index[n]
            if isinstance(outcome, PermanentError):
                encoded.append(("permanent", str(outcome)))
            elif isinstance(outcome, Exception):
                encoded.append(("transient", str(outcome)))
            else:
                encoded.append(("ok", outcome))
        reply: Reply = {"replica": self.name, "ms": (time.perf_counter() - started) * 1000,
                        "outcomes": encoded}
        if crops is not None:
            reply["ocr_crops_high_water"] = int(crops.high_water)
        return reply

    def check_health(self) -> None:
        """Serve asks every few seconds; a raise makes it replace this replica."""
        if self.broken is not None:
            raise RuntimeError(self.broken)

    def describe(self) -> dict[str, Any]:
        return {"replica": self.name, "device": str(self.model.device), "model": self.model.name,
                "fingerprint": self.fingerprint}


def _item(n: int, pixels: npt.NDArray[np.uint8], displayed: tuple[int, int]) -> WorkItem:
    """A stand-in for the ingest host's item: ``infer_splitting`` reads only the image (its
    pixels, and for OCR the displayed size)."""
    width, height = displayed
    return WorkItem(Path(), str(n), str(n), "",
                    image=DecodedImage(pixels, int(width), int(height), None, "RGB"))


@dataclass(frozen=True)
class Expected:
    """What a reply's predictions must be for the task that sent the call: its answer type,
    and the bound on an answer's length (a detector's ``max_detections``, OCR's
    ``max_regions``), so a replica deployed with other settings cannot hand the result writer
    more than this host's config allows."""

    answer: tuple[type, ...]
    max_entries: int | None = None

    def fits(self, value: Any) -> bool:
        if not isinstance(value, self.answer):
            return False
        return self.max_entries is None or 0 <= _entries(value) <= self.max_entries


ANY_VECTOR_OR_LABELS = Expected((Classification, Embedding))


def expected_answer(output: Output, config: ModelConfig) -> Expected:
    """The answer type of ``output`` (its class is loaded here: this host loaded the same
    model kind for its checks)."""
    if output == "detect":
        from inboxd.models.detect.geometry import Detections

        return Expected((Detections,), config.detect.max_detections)
    if output == "ocr":
        from inboxd.models.ocr.reader import OcrReading

        return Expected((OcrReading,), config.max_regions)
    return Expected((Embedding,) if output == "embed" else (Classification,))


def _entries(answer: Any) -> int:
    """How long an answer is: a detection's boxes, OCR's lines (0 for a fixed-size answer)."""
    boxes = getattr(answer, "boxes", None)
    if boxes is not None:
        if not len(boxes) == len(answer.scores) == len(answer.indices):
            return -1  # boxes, scores and classes out of step: not an answer to trust
        return len(boxes)
    lines = getattr(answer, "lines", None)
    return len(lines) if lines is not None else 0


class BadReply(Exception):
    """A reply that cannot be matched to its batch item by item: the batch is retried."""


def decode_reply(reply: Reply, count: int,
                 expected: Expected = ANY_VECTOR_OR_LABELS) -> list[Any]:
    """The replica's outcomes as predictions or this host's exception types, in order; one per
    crop of the ``count`` sent, or ``BadReply``. Checked, not trusted: a reply one short or one
    long would attach outcomes to the wrong files, and a stray object instead of a prediction
    (or one of another task, or past the task's bound) would crash or bloat the result
    writer."""
    try:
        outcomes = list(reply["outcomes"])
    except (KeyError, TypeError) as exc:
        raise BadReply(f"a reply without outcomes ({type(exc).__name__}: {exc})") from None
    if len(outcomes) != count:
        raise BadReply(f"{len(outcomes)} outcomes for {count} crops")
    decoded: list[Any] = []
    for outcome in outcomes:
        kind, value = outcome if isinstance(outcome, tuple) and len(outcome) == 2 else ("?", "")
        if kind == "ok" and expected.fits(value):
            decoded.append(value)
        elif kind == "permanent":  # the replica's model failed on that input
            decoded.append(ModelError(str(value)))
        elif kind == "transient":
            decoded.append(TransientError(str(value)))
        else:  # that item's own problem: retried like any transient error
            decoded.append(TransientError(f"the replica sent no result for this file "
                                          f"({type(value).__name__} under {kind!r})"))
    return decoded
