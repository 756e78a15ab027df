"""Text detection: the PP-OCRv4 DB network's input, and its probability map turned into
text regions (RapidOCR's ``DetPreProcess`` and ``DBPostProcess``, with the same settings).

The regions are bounded: however many the map holds (a page of small print has thousands),
at most ``max_regions`` are kept, the best by their mean probability, through a heap of that
size; the rest are only counted, so the result can say it was cut.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Any, Literal

import cv2
import numpy as np
import numpy.typing as npt
import pyclipper

Image = npt.NDArray[np.uint8]  # H×W×3 BGR, what the PaddleOCR networks were trained on
Quad = npt.NDArray[np.float32]  # 4×2, clockwise from the top-left corner


@dataclass(frozen=True)
class DetectionSettings:
    """RapidOCR 1.4.4's ``Det`` section: the detector sees the image scaled so that its shorter
    side is at least ``limit_side_len`` (``limit_type: min``), both sides multiples of 32."""

    limit_side_len: int = 736
    limit_type: Literal["min", "max"] = "min"
    threshold: float = 0.3  # a pixel is text above this probability
    box_threshold: float = 0.5  # a region is kept when its mean probability reaches this
    unclip_ratio: float = 1.6  # how far the shrunk DB kernel is grown back to the text's extent
    min_size: int = 3  # regions thinner than this (in the map's pixels) are noise


@dataclass(frozen=True, slots=True)
class Region:
    quad: Quad  # in the pixels of the image the detector was given
    score: float


def input_size(height: int, width: int, settings: DetectionSettings) -> tuple[int, int]:
    """The detector's input height and width for an image of ``height`` × ``width``."""
    if settings.limit_type == "max":
        ratio = min(1.0, settings.limit_side_len / max(height, width))
    else:
        ratio = max(1.0, settings.limit_side_len / min(height, width))
    return (int(round(int(height * ratio) / 32) * 32),
            int(round(int(width * ratio) / 32) * 32))


def detector_input(image: Image, settings: DetectionSettings) -> npt.NDArray[np.float32]:
    """1×3×H×W float32, normalised to [-1, 1] as the network was trained."""
    height, width = input_size(image.shape[0], image.shape[1], settings)
    resized = cv2.resize(image, (max(width, 32), max(height, 32)))
    normalised = (resized.astype(np.float32) * np.float32(1 / 255) - 0.5) / 0.5
    return np.ascontiguousarray(normalised.transpose(2, 0, 1)[np.newaxis], dtype=np.float32)


def text_regions(probability: npt.NDArray[np.float32], height: int, width: int,
                 settings: DetectionSettings, max_regions: int) -> tuple[list[Region], int]:
    """The text regions of a probability map (H'×W'), in the pixels of a ``height`` × ``width``
    image: at most ``max_regions``, the best by score, and how many more there were."""
    mask = cv2.dilate((probability > settings.threshold).astype(np.uint8),
                      np.ones((2, 2), np.uint8))
    contours, _ = cv2.findContours(mask * 255, cv2.RETR_LIST, cv2.CHAIN_APPROX_SIMPLE)
    map_height, map_width = mask.shape
    kept: list[tuple[float, int, Region]] = []  # a min-heap: the worst kept region on top
    found = 0
    for order, contour in enumerate(contours):
        region = _region(contour, probability, settings, (map_height, map_width), (height, width))
        if region is None:
            continue
        found += 1
        entry = (region.score, -order, region)
        if len(kept) < max_regions:
            heapq.heappush(kept, entry)
        elif entry[:2] > kept[0][:2]:
            heapq.heapreplace(kept, entry)
    # Back in the order the contours came, as RapidOCR keeps them before sorting.
    regions = [region for _, _, region in sorted(kept, key=lambda e: -e[1])]
    return regions, found - len(regions)


def _region(contour: npt.NDArray[Any], probability: npt.NDArray[np.float32],
            settings: DetectionSettings, map_size: tuple[int, int],
            image_size: tuple[int, int]) -> Region | None:
    points, short_side = _min_box(contour)
    if short_side < settings.min_size:
        return None
    score = _mean_inside(probability, points)
    if score < settings.box_threshold:
        return None
    grown, short_side = _min_box(_unclip(points, settings.unclip_ratio))
    if short_side < settings.min_size + 2:
        return None
    (map_height, map_width), (height, width) = map_size, image_size
    grown[:, 0] = np.clip(np.round(grown[:, 0] / map_width * width), 0, width)
    grown[:, 1] = np.clip(np.round(grown[:, 1] / map_height * height), 0, height)
    quad = _clockwise(grown.astype(np.int32).astype(np.float32))
    # RapidOCR's filter_tag_det_res: clipped inside the image, slivers dropped.
    quad[:, 0] = np.clip(quad[:, 0], 0, width - 1).astype(np.int32)
    quad[:, 1] = np.clip(quad[:, 1], 0, height - 1).astype(np.int32)
    if (int(np.linalg.norm(quad[0] - quad[1])) <= 3
            or int(np.linalg.norm(quad[0] - quad[3])) <= 3):
        return None
    return Region(quad, float(score))


def _min_box(contour: npt.NDArray[Any]) -> tuple[npt.NDArray[np.float32], float]:
    """The minimum-area rectangle around ``contour``, its corners from the top-left, and its
    shorter side."""
    rectangle = cv2.minAreaRect(contour)
    points = sorted(cv2.boxPoints(rectangle), key=lambda point: float(point[0]))
    first, fourth = (0, 1) if points[1][1] > points[0][1] else (1, 0)
    second, third = (2, 3) if points[3][1] > points[2][1] else (3, 2)
    box = np.array([points[first], points[second], points[third], points[fourth]],
                   dtype=np.float32)
    return box, float(min(rectangle[1]))


def _mean_inside(probability: npt.NDArray[np.float32], box: npt.NDArray[np.float32]) -> float:
    """The mean probability inside ``box`` (RapidOCR's ``box_score_fast``)."""
    height, width = probability.shape
    x_min = int(np.clip(np.floor(box[:, 0].min()), 0, width - 1))
    x_max = int(np.clip(np.ceil(box[:, 0].max()), 0, width - 1))
    y_min = int(np.clip(np.floor(box[:, 1].min()), 0, height - 1))
    y_max = int(np.clip(np.ceil(box[:, 1].max()), 0, height - 1))
    mask = np.zeros((y_max - y_min + 1, x_max - x_min + 1), dtype=np.uint8)
    shifted = box - np.array([x_min, y_min], dtype=np.float32)
    cv2.fillPoly(mask, [shifted.reshape(-1, 2).astype(np.int32)], 1)
    return float(cv2.mean(probability[y_min:y_max + 1, x_min:x_max + 1], mask)[0])


def _unclip(box: npt.NDArray[np.float32], ratio: float) -> npt.NDArray[np.int64]:
    """``box`` grown by area × ratio / perimeter, with round joins (the DB paper's offset)."""
    x, y = box[:, 0].astype(np.float64), box[:, 1].astype(np.float64)
    area = abs(float(np.dot(x, np.roll(y, -1)) - np.dot(y, np.roll(x, -1)))) / 2
    perimeter = float(np.sum(np.hypot(x - np.roll(x, -1), y - np.roll(y, -1))))
    offset = pyclipper.PyclipperOffset()
    offset.AddPath(box.tolist(), pyclipper.JT_ROUND, pyclipper.ET_CLOSEDPOLYGON)
    expanded = offset.Execute(area * ratio / perimeter)
    return np.array(expanded).reshape((-1, 1, 2))


def _clockwise(points: npt.NDArray[np.float32]) -> Quad:
    """Top-left, top-right, bottom-right, bottom-left (RapidOCR's order_points_clockwise)."""
    by_x = points[np.argsort(points[:, 0]), :]
    left, right = by_x[:2, :], by_x[2:, :]
    top_left, bottom_left = left[np.argsort(left[:, 1]), :]
    top_right, bottom_right = right[np.argsort(right[:, 1]), :]
    return np.array([top_left, top_right, bottom_right, bottom_left], dtype=np.float32)
