"""Detection's geometry and post-processing: the letterbox, a detector's raw output → boxes,
and boxes → the displayed photo's own pixels.

The decoder hands each photo fitted into the input square (``decode.spec`` kind ``fit``: EXIF
applied, aspect ratio kept, longer side = the square's). Here a batch of such images is padded
centred into the square (Ultralytics' letterbox arithmetic), the network's boxes are taken back
out of the padding into the fitted image's pixels, and ``Detections.in_photo`` scales them per
axis to the displayed photo (the fitted image was resized edge to edge from it) and clips them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

Layout = Literal["yolo", "boxes"]
# Decimals kept in the JSON: a hundredth of a pixel, a millionth of a score.
BOX_DECIMALS = 2
SCORE_DECIMALS = 6


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a fitted ``width``×``height`` image sits in the letterbox square."""

    left: int
    top: int
    width: int
    height: int


def placement(width: int, height: int, side: int) -> Placement:
    """Ultralytics' centred padding: ``round(pad / 2 ∓ 0.1)`` on the left/top."""
    return Placement(round((side - width) / 2 - 0.1), round((side - height) / 2 - 0.1),
                     width, height)


def letterbox(images: Sequence[torch.Tensor], side: int, pad_value: int,
              device: torch.device) -> tuple[torch.Tensor, list[Placement]]:
    """H×W×3 uint8 images (each at most ``side`` each way) → N×side×side×3 uint8 on ``device``,
    each centred on ``pad_value`` grey, and where each went."""
    canvas = torch.full((len(images), side, side, 3), pad_value, dtype=torch.uint8,
                        device=device)
    placements = []
    for n, image in enumerate(images):
        height, width = int(image.shape[0]), int(image.shape[1])
        where = placement(width, height, side)
        canvas[n, where.top:where.top + height, where.left:where.left + width] = image.to(
            device, non_blocking=True)
        placements.append(where)
    return canvas, placements


@dataclass(slots=True)
class Detections:
    """One photo's boxes (x0, y0, x1, y1 in the pixels of the image the model was given, the
    fitted one, the padding already taken out), scores and class indices, best first."""

    boxes: list[list[float]]
    scores: list[float]
    indices: list[int]
    labels: list[str]
    fitted_size: tuple[int, int]  # (width, height) of that image

    def not_finite(self) -> str | None:
        bad = sum(not math.isfinite(v) for box, score in zip(self.boxes, self.scores, strict=True)
                  for v in (*box, score))
        return f"{bad} of the detections' box coordinates and scores" if bad else None

    def result_fields(self, width: int, height: int, vector_file: str) -> dict[str, Any]:
        # In the displayed photo's pixels, whatever size the model saw it at.
        return {"detections": self.in_photo(width, height)}

    def in_photo(self, width: int, height: int) -> list[dict[str, Any]]:
        """The result's ``detections``: each box scaled to the displayed ``width``×``height``
        photo and clipped to it."""
        scale_x, scale_y = width / self.fitted_size[0], height / self.fitted_size[1]
        out = []
        for box, score, index in zip(self.boxes, self.scores, self.indices, strict=True):
            x0, y0, x1, y1 = box
            shown = [_clip(x0 * scale_x, width), _clip(y0 * scale_y, height),
                     _clip(x1 * scale_x, width), _clip(y1 * scale_y, height)]
            out.append({"label": self.labels[index] if 0 <= index < len(self.labels)
                        else str(index), "index": index, "score": round(score, SCORE_DECIMALS),
                        "box": [round(v, BOX_DECIMALS) for v in shown]})
        return out


def _clip(value: float, limit: int) -> float:
    return min(max(value, 0.0), float(limit))


@dataclass(frozen=True, slots=True)
class PostProcess:
    score_threshold: float
    iou_threshold: float
    max_detections: int


def yolo_boxes(output: torch.Tensor, post: PostProcess
               ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """N×(4+C)×A (cx, cy, w, h, then one score per class) → per image (boxes xyxy, scores,
    class indices) after the score threshold, class-wise NMS and ``max_detections``."""
    from torchvision.ops import batched_nms, box_convert

    found = []
    for candidates in output.float():
        rows = candidates.transpose(0, 1)  # A×(4+C)
        scores, classes = rows[:, 4:].max(dim=1)
        keep = scores > post.score_threshold
        boxes = box_convert(rows[keep, :4], "cxcywh", "xyxy")
        scores, classes = scores[keep], classes[keep]
        kept = batched_nms(boxes, scores, classes, post.iou_threshold)[:post.max_detections]
        found.append((boxes[kept], scores[kept], classes[kept]))
    return found


def selected(boxes: torch.Tensor, scores: torch.Tensor, classes: torch.Tensor,
             post: PostProcess) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A detector's own already-suppressed boxes: the threshold and the bound, best first."""
    keep = scores > post.score_threshold
    boxes, scores, classes = boxes[keep], scores[keep], classes[keep]
    order = scores.argsort(descending=True, stable=True)[:post.max_detections]
    return boxes[order], scores[order], classes[order]


def unpadded(boxes: torch.Tensor, where: Placement) -> torch.Tensor:
    """Boxes in the letterbox square → in the fitted image's pixels."""
    shift = torch.tensor([where.left, where.top, where.left, where.top], dtype=boxes.dtype,
                         device=boxes.device)
    return boxes - shift


def detections(boxes: torch.Tensor, scores: torch.Tensor, classes: torch.Tensor,
               labels: list[str], fitted_size: tuple[int, int]) -> Detections:
    return Detections(boxes.double().cpu().tolist(), scores.double().cpu().tolist(),
                      [int(c) for c in classes.cpu().tolist()], labels, fitted_size)
