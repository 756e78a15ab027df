"""``output: detect``: a detector a user brings, loaded and checked at start-up, run per batch.

Three sources. An ``.onnx`` detector in ONNX Runtime or a ``.pt2`` torch.export program in
torch, in the YOLO layout (an Ultralytics export: one output N×(4+classes)×candidates, no NMS
inside) or the boxes layout (NMS inside: boxes, scores and labels outputs, or one N×K×6 output),
fed the letterbox it was trained on (``models/detect/geometry.py``): the two differ only in the
network that runs on the letterboxed batch. A torchvision detection architecture with a local
state_dict, fed each fitted photo as it is: its own transform normalises and resizes, and its
own post-processing (NMS included) maps boxes back to that photo.

Everything that would otherwise fail on the first photo is checked here with a blank probe batch:
the input size against the graph's, the output layout (from the output shapes, or
``detect.layout`` where they could be either), the class count against the labels. A failure is
a ``ConfigError`` naming the key and the fix (exit 78).
"""

from __future__ import annotations

import ast
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

from inboxd.config import ModelConfig
from inboxd.decode.spec import DEFAULT_DETECT_SIDE, PROBE_BATCH, UNIT_SCALE, PreprocessSpec
from inboxd.models.detect.geometry import (
    Detections,
    Layout,
    PostProcess,
    detections,
    letterbox,
    selected,
    unpadded,
    yolo_boxes,
)
from inboxd.models.device import pick_device
from inboxd.models.model import Model, ModelInfo, Pixels
from inboxd.models.preflight import problem, read_labels
from inboxd.models.runtimes.runner import Runner
from inboxd.models.sources import export_program, load_state_dict, state_dict_mismatch

# torchvision's detection architectures inboxd builds (weights=None, weights_backbone=None)
# and loads strictly from a local state_dict: each takes a list of 0-1 images and returns
# boxes in each image's own pixels.
TORCHVISION_DETECTORS = (
    "fasterrcnn_mobilenet_v3_large_fpn", "fasterrcnn_mobilenet_v3_large_320_fpn",
    "fasterrcnn_resnet50_fpn", "fasterrcnn_resnet50_fpn_v2", "retinanet_resnet50_fpn",
    "retinanet_resnet50_fpn_v2", "fcos_resnet50_fpn", "ssdlite320_mobilenet_v3_large",
    "ssd300_vgg16",
)
COCO_DETECTION_CLASSES = 91  # torchvision's COCO detectors: background + 90 ids (some "N/A")
# onnx and export: a letterboxed batch through a network in one of the two layouts.
Family = Literal["onnx", "export", "torchvision"]


@dataclass(frozen=True, slots=True)
class OutputLayout:
    """Which output is what: ``yolo`` (output 0), or ``boxes`` with the index of each of
    boxes, scores and labels (all 0 for one N×K×6 output)."""

    layout: Layout
    boxes: int = 0
    scores: int = 0
    labels: int = 0
    packed: bool = False  # one N×K×6 output


class OnnxDetectorNetwork(nn.Module):
    """An ONNX Runtime session returning every output (a detector has one to three)."""

    def __init__(self, session: Any) -> None:
        super().__init__()
        self.session = session
        self.input_name = session.get_inputs()[0].name
        self.output_names = [output.name for output in session.get_outputs()]

    def forward(self, batch: torch.Tensor) -> tuple[torch.Tensor, ...]:
        array = np.ascontiguousarray(batch.detach().cpu().numpy(), dtype=np.float32)
        return tuple(torch.from_numpy(np.asarray(out))
                     for out in self.session.run(self.output_names, {self.input_name: array}))


class ExportedDetectorNetwork(nn.Module):
    """A torch.export program returning its outputs as a tuple: a program may return one
    tensor, a tuple or list of them, or a dict (whose keys name the outputs)."""

    def __init__(self, program: nn.Module) -> None:
        super().__init__()
        self.program = program

    def forward(self, batch: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = self.program(batch)
        if isinstance(out, torch.Tensor):
            return (out,)
        return tuple(out.values() if isinstance(out, dict) else out)


class Detector(Model):
    """A detection model: fitted photos in, ``Detections`` (boxes in each fitted photo's pixels;
    the result writer maps them to the displayed photo) out."""

    # The CUDA launch/collect split stages equal-sized crops; fitted photos differ in size.
    batches_overlap = False

    def __init__(self, name: str, network: nn.Module, spec: PreprocessSpec, labels: list[str],
                 device: torch.device, precision: str, *, family: Family, post: PostProcess,
                 pad_value: int, layout: OutputLayout | None, fixed_batch: int | None,
                 color: Literal["rgb", "bgr", "gray"], info: ModelInfo | None,
                 input_dtype: torch.dtype = torch.float32) -> None:
        runner = (Runner("onnxruntime", "fp32", network, torch.contiguous_format)
                  if family == "onnx" else None)
        super().__init__(name, network, spec, labels, device, precision, 1, output="detect",
                         color=color, info=info, runner=runner)
        self.family = family
        self.post = post
        self.pad_value = pad_value
        self.layout = layout
        self.fixed_batch = fixed_batch  # an ONNX graph exported for one batch size
        # What the network was exported to take: a .pt2 exported in half precision runs in it.
        self.input_dtype = input_dtype
        self.fields: dict[str, Any] = {}  # for the started record: where it runs, and why

    @property
    def side(self) -> int:
        return self.spec.crop

    def predict(self, images: Sequence[Pixels]) -> list[Detections]:
        if self.before_forward is not None:
            self.before_forward(len(images))
        # A decode worker's pixels are writable (a bytearray); Pillow's own arrays are not.
        tensors = [torch.as_tensor(image.copy() if isinstance(image, np.ndarray)
                                   and not image.flags.writeable else image)
                   for image in images]
        with torch.inference_mode():
            if self.family == "torchvision":
                return self._own_transform(tensors)
            return self._letterboxed(tensors)

    def raw_outputs(self, images: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[Any]]:
        """The network's outputs for a letterboxed batch (chunked to a fixed batch size), and
        where each image was put."""
        canvas, placements = letterbox(images, self.side, self.pad_value, self.device)
        inputs = self.normalise(canvas).contiguous().to(self.input_dtype)
        step = self.fixed_batch or self.max_batch or len(images)
        chunks = []
        with self._autocast(self.runner):
            for start in range(0, len(images), step):
                out = self.runner.forward(inputs[start:start + step])
                chunks.append(out if isinstance(out, tuple) else (out,))
        outputs = [torch.cat([chunk[i].float() if chunk[i].is_floating_point() else chunk[i]
                              for chunk in chunks]) for i in range(len(chunks[0]))]
        return outputs, placements

    def _letterboxed(self, images: Sequence[torch.Tensor]) -> list[Detections]:
        outputs, placements = self.raw_outputs(images)
        assert self.layout is not None and self.labels is not None
        if self.layout.layout == "yolo":
            found = yolo_boxes(outputs[0], self.post)
        else:
            found = [selected(boxes, scores, classes.long(), self.post)
                     for boxes, scores, classes in zip(*boxes_layout(outputs, self.layout),
                                                        strict=True)]
        return [detections(unpadded(boxes.float(), where), scores, classes, self.labels,
                           (where.width, where.height))
                for (boxes, scores, classes), where in zip(found, placements, strict=True)]

    def _own_transform(self, images: Sequence[torch.Tensor]) -> list[Detections]:
        assert self.labels is not None
        batch = [self.normalise(image.to(self.device)[None])[0] for image in images]
        with self._autocast(self.runner):
            results = self.network(batch)
        out = []
        for image, result in zip(images, results, strict=True):
            boxes, scores, classes = selected(result["boxes"].float(), result["scores"].float(),
                                              result["labels"], self.post)
            out.append(detections(boxes, scores, classes, self.labels,
                                  (int(image.shape[1]), int(image.shape[0]))))
        return out


def boxes_layout(outputs: list[torch.Tensor], layout: OutputLayout
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if layout.packed:
        packed = outputs[0].float()
        return packed[..., :4], packed[..., 4], packed[..., 5].round().long()
    return (outputs[layout.boxes].float(), outputs[layout.scores].float(),
            outputs[layout.labels].round().long())


# -- loading --------------------------------------------------------------------------------


def load_detector(config: ModelConfig) -> Detector:
    device = pick_device(config.device)
    precision = "fp32" if config.precision == "auto" else config.precision
    if config.kind in ("onnx", "export") and precision != "fp32":
        raise problem(f"an {config.kind}: detector runs at the precision it was exported with: "
                      "set precision: auto or fp32")
    post = PostProcess(config.detect.score_threshold, config.detect.iou_threshold,
                       config.detect.max_detections)
    labels = read_labels(config.labels) if config.labels is not None else None
    if config.kind == "onnx":
        return _onnx_detector(config, device, post, labels)
    if config.kind == "export":
        return _export_detector(config, device, post, labels)
    return _torchvision_detector(config, device, precision, post, labels)


def _input_spec(config: ModelConfig, size: int) -> PreprocessSpec:
    given = config.input
    mean = given.mean or UNIT_SCALE[0]
    std = given.std or UNIT_SCALE[1]
    return PreprocessSpec.fit(size, given.interpolation or "bilinear", mean, std)


def _onnx_detector(config: ModelConfig, device: torch.device, post: PostProcess,
                   labels: list[str] | None) -> Detector:
    from inboxd.models.runtimes import onnx as onnx_runtime

    assert config.onnx is not None
    path = config.onnx
    # On a GPU: ONNX Runtime's CUDA provider where the installed onnxruntime has one, else
    # the CPU, said in the started record (the CPU package is what inboxd installs).
    providers: tuple[str, ...] = onnx_runtime.CPU_PROVIDERS
    note: str | None = None
    if device.type == "cuda":
        providers, note = onnx_runtime.providers_for_gpu("the ONNX detector")
        if note is not None:
            device = torch.device("cpu")
    try:
        session = onnx_runtime.session(str(path), torch.get_num_threads(), providers)
    except Exception as exc:
        raise problem(f"onnx: cannot read {path}: no such file" if not path.is_file() else
                      f"onnx: {path} cannot be loaded by onnxruntime: {type(exc).__name__}: "
                      f"{str(exc)[:300]}") from exc
    inputs = session.get_inputs()
    if len(inputs) != 1 or inputs[0].type != "tensor(float)" or len(inputs[0].shape) != 4:
        raise problem(f"onnx: {path} must take one float N×3×H×W input (it takes "
                      f"{[(i.name, i.type, i.shape) for i in inputs]})")
    batch, channels, height, width = inputs[0].shape
    if channels != 3:
        raise problem(f"onnx: {path} takes {channels} channels; inboxd feeds 3 (RGB)")
    size = _letterbox_size(config, f"onnx: {path}", height, width)
    fixed_batch = batch if isinstance(batch, int) else None
    network = OnnxDetectorNetwork(session)
    metadata_names = _metadata_names(session)
    detector = Detector(path.name, network, _input_spec(config, size),
                        labels or metadata_names or [], device, "fp32", family="onnx", post=post,
                        pad_value=config.detect.pad_value, layout=None, fixed_batch=fixed_batch,
                        color=config.input.color, info=None)
    _settle_layout(detector, config, f"onnx: {path}", network.output_names, labels,
                   metadata_names, 0, f"ONNX detector {path}")
    detector.fields["RUNTIME_REASON"] = f"the ONNX detector runs on ONNX Runtime's {providers[0]}"
    if note is not None:
        detector.fields["MODEL_NOTE"] = note
    _probe(detector)
    return detector


def _export_detector(config: ModelConfig, device: torch.device, post: PostProcess,
                     labels: list[str] | None) -> Detector:
    """A torch.export program in torch on the model's device (``export_program`` moves it),
    fed the letterboxed batch in the dtype it was exported with."""
    assert config.export is not None
    path = config.export
    source = export_program(config, device)
    height, width = source.input_size or (None, None)
    size = _letterbox_size(config, f"export: {path}", height, width)
    network = ExportedDetectorNetwork(source.network)
    parameters = sum(p.numel() for p in network.parameters())
    detector = Detector(path.name, network, _input_spec(config, size), labels or [], device,
                        "fp32", family="export", post=post, pad_value=config.detect.pad_value,
                        layout=None, fixed_batch=None, color=config.input.color,
                        info=ModelInfo("export", "", parameters, 0, source.max_batch),
                        input_dtype=source.input_dtype)
    _settle_layout(detector, config, f"export: {path}", source.output_names, labels, None,
                   parameters, f"torch.export detector {path}")
    detector.fields["RUNTIME_REASON"] = (f"a torch.export program runs in torch on {device}, "
                                         f"fed {str(source.input_dtype).removeprefix('torch.')}")
    _probe(detector)
    return detector


def _settle_layout(detector: Detector, config: ModelConfig, where: str, output_names: list[str],
                   labels: list[str] | None, metadata_names: list[str] | None, parameters: int,
                   description: str) -> None:
    """Run the probe batch through the network, and set the layout its outputs show, the
    labels and the info from them."""
    probe_images = _probe_images(detector.side)
    size = detector.side
    try:
        outputs, _ = detector.raw_outputs(probe_images)
    except Exception as exc:
        raise problem(f"{where} fails on a {len(probe_images)}×3×{size}×{size} letterboxed "
                      f"batch (input.size is {size}): {type(exc).__name__}: {str(exc)[:300]}"
                      ) from exc
    layout = output_layout(outputs, output_names, config.detect.layout, where)
    classes = outputs[0].shape[1] - 4 if layout.layout == "yolo" else None
    detector.labels = _detector_labels(config, labels, metadata_names, classes)
    detector.layout = layout
    max_batch = detector.info.max_batch if detector.info is not None else None
    detector.info = ModelInfo(config.kind, f"{description} ({layout.layout} layout)", parameters,
                              classes or len(detector.labels), max_batch)


def _letterbox_size(config: ModelConfig, where: str, height: Any, width: Any) -> int:
    """The letterbox's side: the network's fixed input, which input.size must agree with;
    input.size or Ultralytics' default for a network that takes any size."""
    wanted = config.input.size
    if isinstance(height, int) and isinstance(width, int):
        if height != width:
            raise problem(f"{where} takes {height}×{width} images; the letterbox is square: "
                          "export it with a square input size (Ultralytics: imgsz)")
        if wanted is not None and wanted != height:
            raise problem(f"input.size is {wanted} but {where} takes {height}×{width} images: "
                          f"set model.input.size to {height} (or remove it)")
        return height
    return wanted or DEFAULT_DETECT_SIDE


def _metadata_names(session: Any) -> list[str] | None:
    """An Ultralytics export's class names, from its ``names`` metadata: ``{0: 'person', ...}``
    (read as a literal, never evaluated)."""
    try:
        text = session.get_modelmeta().custom_metadata_map.get("names")
        names = ast.literal_eval(text) if text else None
    except (ValueError, SyntaxError, AttributeError):
        return None
    if isinstance(names, dict) and sorted(names) == list(range(len(names))):
        return [str(names[i]) for i in range(len(names))]
    return None


def output_layout(outputs: list[torch.Tensor], output_names: list[str], wanted: str,
                  where: str) -> OutputLayout:
    """The layout the probe batch's outputs show, checked against ``detect.layout``.
    ``where``: the key and file, as errors name them (``onnx: PATH``)."""
    shapes = [list(out.shape) for out in outputs]
    # A program returning a tuple names none: its outputs are told apart by shape and dtype.
    names = [(output_names[i] if i < len(output_names) else f"output{i}").lower()
             for i in range(len(outputs))]
    found: OutputLayout | None = None
    ambiguous = False
    if len(outputs) == 1 and outputs[0].ndim == 3:
        rows, columns = shapes[0][1], shapes[0][2]
        yolo = rows >= 5 and columns > rows and columns != 6
        packed = columns == 6 and rows != 6 and (rows > columns or rows < 5)
        if wanted == "yolo" or (wanted == "auto" and yolo and not packed):
            found = OutputLayout("yolo") if rows >= 5 else None
        elif wanted == "boxes" or (wanted == "auto" and packed and not yolo):
            found = OutputLayout("boxes", packed=True) if columns == 6 else None
        else:
            ambiguous = True
    elif len(outputs) in (2, 3, 4):
        found = _named_outputs(outputs, names) if wanted in ("auto", "boxes") else None
    if ambiguous:
        raise problem(f"{where}: its output {shapes[0]} could be the YOLO layout (classes × "
                      "candidates) or the boxes layout (detections × 6): set "
                      "model.detect.layout to yolo or boxes")
    if found is None:
        raise problem(f"{where}: its outputs {shapes} fit no detector layout inboxd reads"
                      + (f" (detect.layout is {wanted})" if wanted != "auto" else "")
                      + ": the YOLO layout is one N×(4+classes)×candidates output (an "
                      "Ultralytics export with nms=False); the boxes layout is boxes N×K×4, "
                      "scores N×K and labels N×K, or one N×K×6 output")
    return found


def _named_outputs(outputs: list[torch.Tensor], names: list[str]) -> OutputLayout | None:
    """Boxes: the N×K×4 output; labels: the integer one (or the one named label/class);
    scores: the other N×K one."""
    boxes = [i for i, out in enumerate(outputs) if out.ndim == 3 and out.shape[-1] == 4]
    flat = [i for i, out in enumerate(outputs) if out.ndim == 2]
    if len(boxes) != 1 or len(flat) < 2:
        return None
    integer = [i for i in flat if not outputs[i].is_floating_point()]
    named = [i for i in flat if "label" in names[i] or "class" in names[i]]
    labels = integer or named
    scores = [i for i in flat if i not in labels]
    if len(labels) != 1 or not scores:
        return None
    return OutputLayout("boxes", boxes[0], scores[0], labels[0])


def _detector_labels(config: ModelConfig, labels: list[str] | None,
                     metadata_names: list[str] | None, classes: int | None) -> list[str]:
    found = labels or metadata_names
    if found is None:
        raise problem("labels: give labels: PATH (one class name per line, in class-index "
                      "order): the detector does not carry its class names")
    if classes is not None and len(found) != classes:
        where = f"labels: {config.labels} has" if labels else "the model's names metadata has"
        raise problem(f"{where} {len(found)} names but the detector outputs {classes} classes: "
                      "give the labels file the model was trained with")
    return found


def _probe_images(size: int) -> list[torch.Tensor]:
    """A landscape and a portrait fitted image: both letterbox paddings are exercised."""
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (max(1, size // 2), size, 3), generator=generator,
                          dtype=torch.uint8),
            torch.randint(0, 256, (size, max(1, size // 2), 3), generator=generator,
                          dtype=torch.uint8)][:PROBE_BATCH]


def _probe(detector: Detector) -> None:
    """The whole path once, post-processing included, before any file is touched."""
    try:
        detector.predict(_probe_images(detector.side))
    except Exception as exc:
        raise problem(f"{detector.name}: the detector fails on a probe batch: "
                      f"{type(exc).__name__}: {str(exc)[:300]}") from exc


def _torchvision_detector(config: ModelConfig, device: torch.device, precision: str,
                          post: PostProcess, labels: list[str] | None) -> Detector:
    import torchvision

    assert config.torchvision is not None and config.weights is not None
    name = config.torchvision
    if name not in TORCHVISION_DETECTORS:
        raise problem(f"torchvision: {name} is not a detection architecture inboxd runs "
                      f"(output: detect takes {', '.join(TORCHVISION_DETECTORS)})")
    state = load_state_dict(config.weights)
    classes = config.num_classes or (len(labels) if labels else COCO_DETECTION_CLASSES)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # weights=None warns of random init: replaced below
        network = torchvision.models.get_model(name, weights=None, weights_backbone=None,
                                               num_classes=classes)
    mismatch = state_dict_mismatch(network, state)
    if mismatch:
        raise problem(f"weights: {config.weights} does not fit torchvision {name} with "
                      f"num_classes {classes}: {mismatch}")
    network.load_state_dict(state, strict=True)
    network.eval()
    if labels is None:
        if classes != COCO_DETECTION_CLASSES:
            raise problem(f"labels: the detector has {classes} classes: give labels: PATH "
                          "(one per line, index 0 the background)")
        from torchvision.models._meta import _COCO_CATEGORIES

        labels = list(_COCO_CATEGORIES)
    elif len(labels) != classes:
        raise problem(f"labels: {config.labels} has {len(labels)} names but num_classes is "
                      f"{classes}: they must agree (index 0 is the background)")
    transform = network.transform
    size = config.input.size or int(max(transform.fixed_size or (transform.max_size,)))
    spec = _input_spec(config, size)
    parameters = sum(p.numel() for p in network.parameters())
    info = ModelInfo("torchvision", f"torchvision {name}, weights {config.weights}",
                     parameters, classes)
    detector = Detector(name, network, spec, labels, device, precision, family="torchvision",
                        post=post, pad_value=config.detect.pad_value, layout=None,
                        fixed_batch=None, color=config.input.color, info=info)
    _probe(detector)
    return detector
