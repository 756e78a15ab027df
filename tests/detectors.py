"""Detectors whose output is known, for the detection tests, the docs' example and the bench.

``yolo_onnx`` builds an ONNX graph in the YOLO layout (Ultralytics: input N×3×S×S, one output
N×(4+C)×A, cx/cy/w/h in the letterboxed input, no NMS) whose output is a constant: the candidates
below, the same for every image. The boxes inboxd reports for a photo are then exactly
computable from the photo's displayed size alone (``expected_boxes``): the letterbox undone and
the scale back to the photo are the only things between the two. ``yolo_pt2`` is the same
detector as a torch.export program.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import numpy as np
import onnx
import torch
from inboxd.decode.spec import fit_size
from inboxd.models.detect.geometry import placement
from onnx import TensorProto, helper, numpy_helper

SIDE = 64
LABELS = ["cat", "dog"]
# (cx, cy, w, h) in the SIDE² letterbox, then one score per class.
CANDIDATES = [
    (32.0, 32.0, 20.0, 10.0, 0.9, 0.1),  # a cat in the middle
    (33.0, 32.0, 20.0, 10.0, 0.8, 0.0),  # the same cat again, shifted 1 px: NMS drops it
    (32.0, 32.0, 20.0, 10.0, 0.0, 0.6),  # a dog on the same box: another class, kept
    (10.0, 55.0, 8.0, 12.0, 0.05, 0.7),  # a dog low on the left: in the padding of wide photos
    (50.0, 10.0, 6.0, 6.0, 0.1, 0.2),  # below the score threshold
]
SCORE_THRESHOLD = 0.25
# (box in the letterbox as x0, y0, x1, y1, score, class index) of what survives, best first.
SURVIVORS = [((22.0, 27.0, 42.0, 37.0), 0.9, 0), ((22.0, 27.0, 42.0, 37.0), 0.6, 1),
             ((6.0, 49.0, 14.0, 61.0), 0.7, 1)]


# Candidates in all, the rest scoring 0 (a real export has thousands: more than its rows).
CANDIDATE_COUNT = 100


def candidates_array() -> np.ndarray:
    """1×(4+C)×A float32, as an Ultralytics export lays it out."""
    rows = np.zeros((CANDIDATE_COUNT, 4 + len(LABELS)), dtype=np.float32)
    rows[:, :4] = (20.0, 20.0, 4.0, 4.0)
    rows[:len(CANDIDATES)] = CANDIDATES
    return rows.T[None]


def yolo_onnx(path: Path, fixed_batch: int | None = None, side: int = SIDE,
              packed: bool = False, fails_above_mean: float | None = None) -> Path:
    """The constant detector as an ONNX file (batch axis dynamic unless ``fixed_batch``).
    ``packed``: the boxes layout instead, one N×K×6 output (x0, y0, x1, y1, score, label),
    the survivors as an export with NMS inside would give them. ``fails_above_mean``: ONNX
    Runtime raises on a batch holding an image whose letterbox is brighter on average (0-1)
    than that, a real model error on one input (an Expand to a shape that cannot broadcast)."""
    batch: int | str = fixed_batch if fixed_batch is not None else "batch"
    image = helper.make_tensor_value_info("images", TensorProto.FLOAT, [batch, 3, side, side])
    if packed:
        rows = np.array([[*box, score, index] for box, score, index in SURVIVORS],
                        dtype=np.float32)[None]
        out_shape: list[int | str] = [batch, len(SURVIVORS), 6]
    else:
        rows = candidates_array()
        out_shape = [batch, rows.shape[1], rows.shape[2]]
    output = helper.make_tensor_value_info("output0", TensorProto.FLOAT, out_shape)
    nodes = [
        # 0 × the mean of each image, N×1×1: the output's batch axis comes from the input's.
        helper.make_node("ReduceMean", ["images", "axes"], ["mean"], keepdims=1),
        helper.make_node("Reshape", ["mean", "shape"], ["per_image"]),
        helper.make_node("Mul", ["per_image", "zero"], ["zeros"]),
        helper.make_node("Add", ["zeros", "rows"], ["output0" if fails_above_mean is None
                                                    else "constant"]),
    ]
    initializers = [
        numpy_helper.from_array(np.array([1, 2, 3], dtype=np.int64), "axes"),
        numpy_helper.from_array(np.array([-1, 1, 1], dtype=np.int64), "shape"),
        numpy_helper.from_array(np.zeros((1,), dtype=np.float32), "zero"),
        numpy_helper.from_array(rows, "rows"),
    ]
    if fails_above_mean is not None:
        # rows × (1 + floor(brightest mean / limit)): the output's own row count while every
        # image is darker than the limit, twice it (which cannot broadcast) otherwise.
        nodes += [
            helper.make_node("ReduceMax", ["per_image"], ["brightest"], keepdims=0),
            helper.make_node("Div", ["brightest", "limit"], ["ratio"]),
            helper.make_node("Floor", ["ratio"], ["floor"]),
            helper.make_node("Cast", ["floor"], ["times"], to=TensorProto.INT64),
            helper.make_node("Add", ["times", "one"], ["factor"]),
            helper.make_node("Mul", ["factor", "row_count"], ["rows_wanted"]),
            helper.make_node("Reshape", ["rows_wanted", "one_dim"], ["rows_1d"]),
            helper.make_node("Concat", ["one", "rows_1d", "candidate_count"], ["target"],
                             axis=0),
            helper.make_node("Expand", ["constant", "target"], ["output0"]),
        ]
        initializers += [
            numpy_helper.from_array(np.array(fails_above_mean, dtype=np.float32), "limit"),
            numpy_helper.from_array(np.array([1], dtype=np.int64), "one"),
            numpy_helper.from_array(np.array([1], dtype=np.int64), "one_dim"),
            numpy_helper.from_array(np.array(rows.shape[1], dtype=np.int64), "row_count"),
            numpy_helper.from_array(np.array([rows.shape[2]], dtype=np.int64),
                                    "candidate_count"),
        ]
    graph = helper.make_graph(nodes, "constant_detector", [image], [output], initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


def expected_boxes(width: int, height: int, side: int = SIDE) -> list[dict[str, object]]:
    """The detections inboxd must report for a photo displayed at ``width``×``height``."""
    fit_w, fit_h = fit_size(width, height, side)
    where = placement(fit_w, fit_h, side)
    out = []
    for (x0, y0, x1, y1), score, index in sorted(SURVIVORS, key=lambda s: -s[1]):
        box = [(x0 - where.left) * width / fit_w, (y0 - where.top) * height / fit_h,
               (x1 - where.left) * width / fit_w, (y1 - where.top) * height / fit_h]
        clipped = [min(max(v, 0.0), limit) for v, limit in zip(box, (width, height) * 2,
                                                                strict=True)]
        out.append({"label": LABELS[index], "index": index, "score": score,
                    "box": [round(v, 2) for v in clipped]})
    return out


Pt2Layout = Literal["yolo", "boxes", "neither"]


class ConstantDetector(torch.nn.Module):
    """0 × the mean of a convolution of each image + constant outputs: the batch axis is the
    input's, the values the candidates' (the convolution takes only its own dtype). ``boxes``:
    a dict of boxes, scores and labels (the survivors, as a program with NMS inside returns
    them); ``neither``: one N×7 output, which no layout reads."""

    def __init__(self, layout: Pt2Layout) -> None:
        super().__init__()
        self.layout = layout
        self.features = torch.nn.Conv2d(3, 1, kernel_size=1)
        survivors = np.array([[*box, score, index] for box, score, index in SURVIVORS],
                             dtype=np.float32)
        # Contiguous copies: torch.export.save warns of a strided view's storage.
        candidates = np.ascontiguousarray(candidates_array())
        self.register_buffer("candidates", torch.from_numpy(candidates))
        self.register_buffer("survivors", torch.from_numpy(survivors[None].copy()))

    def forward(self, images: torch.Tensor) -> torch.Tensor | dict[str, torch.Tensor]:
        zeros = self.features(images).mean(dim=(1, 2, 3)).view(-1, 1, 1) * 0
        if self.layout == "yolo":
            return zeros + self.candidates
        if self.layout == "neither":
            return zeros[:, :, 0] + self.candidates[:, 0, :7]
        rows = zeros + self.survivors
        return {"boxes": rows[..., :4], "scores": rows[..., 4],
                "labels": rows[..., 5].round().long()}


def yolo_pt2(path: Path, side: int = SIDE, layout: Pt2Layout = "yolo",
             dtype: torch.dtype = torch.float32, any_size: bool = False) -> Path:
    """The constant detector as a torch.export program with a dynamic batch, saved as a user
    would save theirs; ``dtype``: exported in that precision (weights and input);
    ``any_size``: height and width dynamic too."""
    example = torch.rand(2, 3, side, side, dtype=dtype)
    axes = {0: torch.export.Dim("batch")}
    if any_size:
        axes |= {2: torch.export.Dim("height"), 3: torch.export.Dim("width")}
    program = torch.export.export(ConstantDetector(layout).to(dtype).eval(), (example,),
                                  dynamic_shapes={"images": axes})
    torch.export.save(program, path)
    return path


def yolo_block(root: Path) -> dict[str, object]:
    """The constant YOLO-layout detector as a config block (its files under ``root/models``):
    a cheap real detector whose boxes are known, for daemons with several tasks."""
    folder = root / "models"
    folder.mkdir(exist_ok=True)
    labels = folder / "coco.txt"
    labels.write_text("\n".join(LABELS) + "\n")
    return {"onnx": str(yolo_onnx(folder / "yolo.onnx")), "output": "detect",
            "labels": str(labels)}
