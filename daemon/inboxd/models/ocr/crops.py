"""Regions in reading order, and each region cut out of the photo as an upright strip.

Both follow RapidOCR 1.4.4 (``sorted_boxes``, ``get_rotate_crop_image``): the recogniser reads
what it is given, so a crop cut any other way reads differently.
"""

from __future__ import annotations

from collections.abc import Sequence

import cv2
import numpy as np
import numpy.typing as npt

from inboxd.models.ocr.detection import Image, Region

# Lines whose top-left corners are this close vertically are one row, read left to right.
SAME_ROW_PX = 10
# A crop this much taller than wide is vertical text: turned a quarter to lie as a line.
VERTICAL_ASPECT = 1.5


def reading_order(regions: Sequence[Region]) -> list[Region]:
    """Top to bottom, and left to right within a row."""
    ordered = sorted(regions, key=lambda r: (float(r.quad[0][1]), float(r.quad[0][0])))
    for i in range(len(ordered) - 1):
        for j in range(i, -1, -1):
            upper, lower = ordered[j], ordered[j + 1]
            if (abs(lower.quad[0][1] - upper.quad[0][1]) < SAME_ROW_PX
                    and lower.quad[0][0] < upper.quad[0][0]):
                ordered[j], ordered[j + 1] = lower, upper
            else:
                break
    return ordered


def rectified_crop(image: Image, quad: npt.NDArray[np.float32]) -> Image:
    """The quadrilateral ``quad`` of ``image``, warped to an axis-aligned rectangle."""
    width = int(max(np.linalg.norm(quad[0] - quad[1]), np.linalg.norm(quad[2] - quad[3])))
    height = int(max(np.linalg.norm(quad[0] - quad[3]), np.linalg.norm(quad[1] - quad[2])))
    target = np.array([[0, 0], [width, 0], [width, height], [0, height]], dtype=np.float32)
    transform = cv2.getPerspectiveTransform(quad, target)
    crop = np.asarray(cv2.warpPerspective(image, transform, (width, height),
                                          borderMode=cv2.BORDER_REPLICATE,
                                          flags=cv2.INTER_CUBIC), dtype=np.uint8)
    if crop.shape[0] / crop.shape[1] >= VERTICAL_ASPECT:
        crop = np.rot90(crop)
    return crop
