"""The angle classifier and the recogniser over batches of crops (RapidOCR 1.4.4's
``TextClassifier`` and ``TextRecognizer``: the same input sizes, normalisation, batching by
aspect ratio and CTC decoding, so that a crop reads the same).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import cv2
import numpy as np
import numpy.typing as npt

from inboxd.models.ocr.detection import Image

CLASSIFIER_HEIGHT, CLASSIFIER_WIDTH = 48, 192
RECOGNISER_HEIGHT, RECOGNISER_WIDTH = 48, 320
# The classifier's label for a line upside down; it is turned only when this sure.
UPSIDE_DOWN_CERTAINTY = 0.9


@dataclass(frozen=True, slots=True)
class Reading:
    text: str
    score: float  # the mean probability of the characters read; 0.0 when none was


def _by_aspect(crops: Sequence[Image]) -> list[int]:
    """Indices of ``crops`` from the narrowest to the widest: a batch pads to its widest crop,
    so crops of like shape share batches."""
    ratios = np.array([crop.shape[1] / float(crop.shape[0]) for crop in crops])
    return [int(i) for i in np.argsort(ratios)]


def _normalised(crop: Image, height: int, width: int) -> npt.NDArray[np.float32]:
    """3×height×width: the crop scaled to ``height`` (at most ``width`` wide), normalised to
    [-1, 1], zero-padded on the right."""
    fitted_width = min(width, math.ceil(height * crop.shape[1] / float(crop.shape[0])))
    resized = cv2.resize(crop, (fitted_width, height)).astype(np.float32)
    padded = np.zeros((3, height, width), dtype=np.float32)
    padded[:, :, :fitted_width] = (resized.transpose(2, 0, 1) / 255 - 0.5) / 0.5
    return padded


class AngleClassifier:
    def __init__(self, session: Any, batch_size: int) -> None:
        self.session = session
        self.batch_size = batch_size
        self.input_name = session.get_inputs()[0].name

    def upright(self, crops: list[Image]) -> list[Image]:
        """``crops``, each turned half a turn where the classifier is sure it is upside down."""
        order = _by_aspect(crops)
        upright = list(crops)
        for start in range(0, len(order), self.batch_size):
            chosen = order[start:start + self.batch_size]
            batch = np.stack([_normalised(crops[i], CLASSIFIER_HEIGHT, CLASSIFIER_WIDTH)
                              for i in chosen])
            probabilities = self.session.run(None, {self.input_name: batch})[0]
            for i, row in zip(chosen, probabilities, strict=True):
                label = int(np.argmax(row))
                if label == 1 and float(row[label]) > UPSIDE_DOWN_CERTAINTY:
                    upright[i] = np.asarray(cv2.rotate(crops[i], cv2.ROTATE_180), dtype=np.uint8)
        return upright


class Recogniser:
    def __init__(self, session: Any, batch_size: int) -> None:
        self.session = session
        self.batch_size = batch_size
        self.input_name = session.get_inputs()[0].name
        # CTC's blank first, then the dictionary the network was trained with (kept in its
        # metadata), then the space PaddleOCR appends.
        characters = session.get_modelmeta().custom_metadata_map["character"].splitlines()
        self.characters = ["", *characters, " "]

    def read(self, crops: Sequence[Image]) -> list[Reading]:
        order = _by_aspect(crops)
        readings: list[Reading] = [Reading("", 0.0)] * len(crops)
        for start in range(0, len(order), self.batch_size):
            chosen = order[start:start + self.batch_size]
            widest = max([RECOGNISER_WIDTH / RECOGNISER_HEIGHT]
                         + [crops[i].shape[1] / crops[i].shape[0] for i in chosen])
            width = int(RECOGNISER_HEIGHT * widest)
            batch = np.stack([_normalised(crops[i], RECOGNISER_HEIGHT, width) for i in chosen])
            probabilities = self.session.run(None, {self.input_name: batch})[0]
            for i, steps in zip(chosen, probabilities, strict=True):
                readings[i] = self._decode(steps)
        return readings

    def _decode(self, steps: npt.NDArray[np.float32]) -> Reading:
        """Greedy CTC: the best class per step, repeats merged, blanks dropped."""
        best = steps.argmax(axis=1)
        certainty = steps.max(axis=1)
        keep = np.ones(len(best), dtype=bool)
        keep[1:] = best[1:] != best[:-1]
        keep &= best != 0
        text = "".join(self.characters[int(index)] for index in best[keep])
        score = float(np.mean(certainty[keep])) if keep.any() else 0.0
        return Reading(text, score)
