"""One photo from pixels to text lines: detect, cut, turn upright, recognise, in reading order.

The fan-out is bounded twice. A photo keeps at most ``max_regions`` regions (the best by the
detector's score; the result's ``cut`` counts the others). And the crops cut out of it wait for
the recogniser in the ``ocr_crops`` layer: regions are cut ``capacity`` at a time, read, and
let go before the next are cut, so a page of small print never holds more than ``capacity``
crops however many lines it has. The layer's size, capacity and high-water mark are in every
stats record, like every other layer's.

The image comes in as the decoder made it: RGB, EXIF orientation applied, fitted inside the
detector's working size; ``displayed`` is the photo's own size as a viewer shows it, and every
polygon is given in those pixels.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import cv2
import numpy as np
import numpy.typing as npt

from inboxd.models.ocr.crops import reading_order, rectified_crop
from inboxd.models.ocr.detection import (
    DetectionSettings,
    Image,
    Region,
    detector_input,
    text_regions,
)
from inboxd.models.ocr.recognition import AngleClassifier, Recogniser


@dataclass(frozen=True)
class OcrSettings:
    """RapidOCR 1.4.4's ``Global`` settings, and the bounds of the fan-out."""

    max_regions: int = 1000  # regions kept per photo, the best by score (RapidOCR: 1000)
    batch_size: int = 6  # crops per classifier and recogniser call (RapidOCR: 6)
    text_score: float = 0.5  # lines read with a lower mean certainty are left out
    # The working image: larger photos are scaled to fit ``max_side_px`` (the decoder does it,
    # ``fit_px``); smaller sides are scaled up to ``min_side_px``.
    max_side_px: int = 2000
    min_side_px: int = 30
    # Short or very wide images get black bands above and below, so the detector sees lines
    # in proportions it was trained on.
    min_height_px: int = 30
    max_width_to_height: float = 8.0
    detection: DetectionSettings = field(default_factory=DetectionSettings)


@dataclass(frozen=True, slots=True)
class OcrLine:
    text: str
    score: float
    polygon: list[list[float]]  # 4 corners, clockwise from the top-left, displayed pixels

    def as_json(self) -> dict[str, Any]:
        return {"text": self.text, "score": self.score, "polygon": self.polygon}


@dataclass(frozen=True, slots=True)
class OcrReading:
    lines: list[OcrLine]
    cut: int  # regions found beyond max_regions and not read (0: none)

    @property
    def full_text(self) -> str:
        return "\n".join(line.text for line in self.lines)

    def as_json(self) -> dict[str, Any]:
        return {"lines": [line.as_json() for line in self.lines], "full_text": self.full_text,
                "cut": self.cut}


class CropLayer:
    """Crops cut out of a photo and waiting for the recogniser (``capacity.ocr_crops``)."""

    name = "ocr_crops"
    DEFAULT = 32  # capacity.ocr_crops's default; the pipeline sets the configured one

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._size = 0
        self.high_water = 0
        self._lock = threading.Lock()  # the model thread fills it, the stats thread reads

    @property
    def size(self) -> int:
        return self._size

    @property
    def capacity(self) -> int:
        return self._capacity

    def resize(self, capacity: int) -> None:
        """SIGHUP: the next photo's crops are cut in groups of the new size."""
        self._capacity = capacity

    def saw_elsewhere(self, high_water: int) -> None:
        """``engine: ray``: the crops are cut on the replicas, each holding this layer at this
        capacity; the stats record shows the highest mark a replica reported."""
        with self._lock:
            self.high_water = max(self.high_water, high_water)

    @contextmanager
    def holding(self, count: int) -> Iterator[None]:
        with self._lock:
            if self._size + count > self._capacity:
                raise RuntimeError(f"ocr_crops: {count} more crops do not fit "
                                   f"({self._size} of {self._capacity} held)")
            self._size += count
            self.high_water = max(self.high_water, self._size)
        try:
            yield
        finally:
            with self._lock:
                self._size -= count


@dataclass(frozen=True)
class Working:
    """The image the detector and the crops see, and how to map its pixels back."""

    image: Image  # BGR
    top_px: int  # black band added above
    scale_y: float  # working pixel → input pixel
    scale_x: float


def working_image(rgb: npt.NDArray[np.uint8], settings: OcrSettings) -> Working:
    """RapidOCR's ``preprocess`` and ``maybe_add_letterbox`` on the decoded image."""
    image: Image = np.ascontiguousarray(rgb[:, :, ::-1])
    height, width = image.shape[:2]
    scale = 1.0
    if max(height, width) > settings.max_side_px:
        scale = settings.max_side_px / max(height, width)
    elif min(height, width) < settings.min_side_px:
        scale = settings.min_side_px / min(height, width)
    scale_y = scale_x = 1.0
    if scale != 1.0:
        new_height = max(32, int(round(int(height * scale) / 32) * 32))
        new_width = max(32, int(round(int(width * scale) / 32) * 32))
        image = np.asarray(cv2.resize(image, (new_width, new_height)), dtype=np.uint8)
        scale_y, scale_x = height / new_height, width / new_width
        height, width = new_height, new_width
    top = 0
    if height <= settings.min_height_px or width / height > settings.max_width_to_height:
        banded = max(int(width / settings.max_width_to_height), settings.min_height_px) * 2
        top = int(abs(banded - height) / 2)
        image = np.asarray(cv2.copyMakeBorder(image, top, top, 0, 0, cv2.BORDER_CONSTANT,
                                              value=(0, 0, 0)), dtype=np.uint8)
    return Working(image, top, scale_y, scale_x)


class OcrReader:
    """The three networks and the steps between them. Call ``read`` from one thread at a time
    (the model thread): the crop layer is this reader's."""

    def __init__(self, detector: Any, classifier: Any, recogniser: Any,
                 settings: OcrSettings, crops: CropLayer) -> None:
        self.detector = detector
        self.detector_input_name = detector.get_inputs()[0].name
        self.classifier = AngleClassifier(classifier, settings.batch_size)
        self.recogniser = Recogniser(recogniser, settings.batch_size)
        self.settings = settings
        self.crops = crops

    def regions(self, working: Working) -> tuple[list[Region], int]:
        image = working.image
        batch = detector_input(image, self.settings.detection)
        probability = self.detector.run(None, {self.detector_input_name: batch})[0][0, 0]
        return text_regions(probability, image.shape[0], image.shape[1],
                            self.settings.detection, self.settings.max_regions)

    def read(self, rgb: npt.NDArray[np.uint8], displayed: tuple[int, int]) -> OcrReading:
        """The text of ``rgb`` (H×W×3), polygons in a ``displayed`` (width, height) frame."""
        working = working_image(rgb, self.settings)
        regions, cut = self.regions(working)
        regions = reading_order(regions)
        to_displayed = _Mapping(working, rgb.shape[1], rgb.shape[0], displayed)
        lines: list[OcrLine] = []
        for start in range(0, len(regions), max(1, self.crops.capacity)):
            group = regions[start:start + max(1, self.crops.capacity)]
            with self.crops.holding(len(group)):
                crops = [rectified_crop(working.image, region.quad) for region in group]
                readings = self.recogniser.read(self.classifier.upright(crops))
                del crops
            for region, reading in zip(group, readings, strict=True):
                if reading.score >= self.settings.text_score:
                    lines.append(OcrLine(reading.text, round(reading.score, 6),
                                         to_displayed(region.quad)))
        return OcrReading(lines, cut)


class _Mapping:
    """Working-image pixels → the input's pixels (clipped, as RapidOCR) → displayed pixels."""

    def __init__(self, working: Working, width: int, height: int,
                 displayed: tuple[int, int]) -> None:
        self.working = working
        self.width, self.height = width, height
        self.to_x, self.to_y = displayed[0] / width, displayed[1] / height

    def __call__(self, quad: npt.NDArray[np.float32]) -> list[list[float]]:
        w = self.working
        x = np.clip((quad[:, 0].astype(np.float64)) * w.scale_x, 0, self.width)
        y = np.clip((quad[:, 1].astype(np.float64) - w.top_px) * w.scale_y, 0, self.height)
        return [[round(float(px) * self.to_x, 2), round(float(py) * self.to_y, 2)]
                for px, py in zip(x, y, strict=True)]
