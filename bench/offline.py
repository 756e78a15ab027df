"""The daemon's own model and preprocessing, called directly: for the ceiling and the article's
two designs, which must run the same code on the same files as inboxd, minus inboxd."""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from inboxd.config import load_config
from inboxd.decode.pillow import decode_image
from inboxd.files.reading import read_and_hash
from inboxd.item import DecodedImage
from inboxd.models.loading import load_network
from inboxd.models.model import Model


def load(warm_batch: int) -> tuple[Model, int]:
    """The model as the default config loads it (device, precision), warmed up like the
    daemon warms it; and the default ``max_image_pixels``."""
    config = load_config(None)
    model = load_network(config.model)
    model.warm_up(model.warm_up_sizes(warm_batch))  # this thread is the one that infers
    return model, config.preprocess.max_image_pixels


def prepare(path: Path, model: Model, max_pixels: int) -> DecodedImage:
    data, _sha256 = read_and_hash(path)
    return decode_image(data, model.spec, max_pixels)


def model_ms(model: Model, image: npt.NDArray[np.uint8], batch: int, repeats: int) -> float:
    """Median wall time of one ``classify`` call on ``batch`` copies of a real image (the
    result is copied back to the host, so a GPU call is complete when it returns)."""
    images = [image] * batch
    model.classify(images)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        model.classify(images)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def read_list(path: Path) -> list[Path]:
    return [Path(line) for line in path.read_text().splitlines() if line]


def emit(result: dict[str, Any]) -> None:
    """The one JSON line a bench subprocess prints on stdout for its parent."""
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
