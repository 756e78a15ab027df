"""Helpers for ``test_models.py``: models the tests make and save themselves, the real pipeline
run over real photos, and an independent reference for what the network should have returned.

The reference normalises the decoded pixels with its own numpy arithmetic and calls a fresh copy
of the network, un-batched and in the default memory format, so a difference in how inboxd
stacks, converts, batches or lays out the input would show.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torchvision
from inboxd.config import load_config
from inboxd.decode.pillow import decode_image
from inboxd.decode.spec import PreprocessSpec
from inboxd.models.loading import load_model
from inboxd.models.model import Model
from inboxd.pipeline.wiring import Pipeline
from torch import nn

from tests.conftest import read_json, write_config

NUM_CLASSES = 10
TOLERANCE = 1e-5


def resnet18(seed: int = 0, num_classes: int = NUM_CLASSES) -> nn.Module:
    """A seeded, untrained resnet18: weights=None builds it without downloading anything."""
    torch.manual_seed(seed)
    network: nn.Module = torchvision.models.resnet18(weights=None, num_classes=num_classes)
    return network.eval()


def export(network: nn.Module, path: Path, size: int = 224, max_batch: int = 64) -> Path:
    batch = torch.export.Dim("batch", min=1, max=max_batch)
    example = torch.randn(2, 3, size, size)
    program = torch.export.export(network, (example,), dynamic_shapes=({0: batch},))
    torch.export.save(program, path)
    return path


def run_pipeline(root: Path, photos: dict[str, Path], model: dict[str, Any] | None,
                 **sections: Any) -> tuple[Pipeline, Model]:
    """Copy the photos into a fresh inbox, load the model as the daemon does, and run
    ``inboxd once``'s pipeline over them (``model=None, models={...}``: several tasks)."""
    for name, path in photos.items():
        (root / "inbox").mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, root / "inbox" / f"{name}{path.suffix}")
    inbox = {"settle_ms": 0, **sections.pop("inbox", {})}
    config = load_config(write_config(root, model=model, inbox=inbox, **sections))
    tasks = {task: load_model(block) for task, block in (config.models or {}).items()}
    loaded = next(iter(tasks.values())) if tasks else load_model(config.model)
    pipeline = Pipeline(config, loaded, tasks=tasks or None)
    asyncio.run(pipeline.process_backlog())
    counters = pipeline.stats.counters
    assert (counters.completed, counters.failed) == (len(photos), 0), counters
    return pipeline, loaded


def result(root: Path, name: str, path: Path) -> dict[str, Any]:
    document: dict[str, Any] = read_json(root / "results" / f"{name}{path.suffix}.json")
    return document


def vector(root: Path, name: str, path: Path) -> np.ndarray:
    loaded: np.ndarray = np.load(root / "results" / f"{name}{path.suffix}.npy",
                                 allow_pickle=False)
    return loaded


def reference_input(path: Path, spec: PreprocessSpec) -> torch.Tensor:
    """1×3×crop×crop: inboxd's decode (the same uint8 crop the pipeline made), normalised here."""
    pixels = decode_image(path.read_bytes(), spec, 89_478_485).pixels.astype(np.float32) / 255
    mean, std = np.array(spec.mean, np.float32), np.array(spec.std, np.float32)
    normalised = (pixels - mean) / std
    return torch.from_numpy(normalised.transpose(2, 0, 1).copy()).unsqueeze(0)


def call(network: nn.Module, x: torch.Tensor) -> np.ndarray:
    with torch.inference_mode():
        out: np.ndarray = network(x).float().numpy()[0]
    return out


def softmax(logits: np.ndarray) -> np.ndarray:
    shifted: np.ndarray = np.exp(logits.astype(np.float64) - logits.max())
    normalised: np.ndarray = shifted / shifted.sum()
    return normalised


def scores_by_index(document: dict[str, Any], classes: int) -> np.ndarray:
    """The JSON's top-k as a dense score vector (top_k covers every class in these tests)."""
    scores = np.full(classes, np.nan)
    for entry in document["top_k"]:
        scores[entry["index"]] = entry["score"]
    assert not np.isnan(scores).any(), "top_k must list every class for this comparison"
    return scores


# -- hostile .onnx files, written with the onnx helper API ------------------------------------

ONNX_OPSET = 13  # ReduceMean's axes an attribute, Slice's bounds inputs
ONNX_IR_VERSION = 8


def _save_onnx(nodes: list[Any], initializers: list[Any], path: Path, classes: int,
               batch: int | str = "N") -> Path:
    from onnx import TensorProto, checker, helper, save

    graph = helper.make_graph(
        nodes, "hostile",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [batch, 3, 224, 224])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["M", classes])],
        initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", ONNX_OPSET)])
    model.ir_version = ONNX_IR_VERSION
    checker.check_model(model)
    save(model, str(path))
    return path


def _ints(name: str, values: list[int]) -> Any:
    from onnx import TensorProto, helper

    return helper.make_tensor(name, TensorProto.INT64, [len(values)], values)


def onnx_wrong_rows(path: Path, wrong_sizes: set[int]) -> Path:
    """A 3-class classifier (each channel's mean is a logit: every row depends on its own image
    only) that answers a batch of any size in ``wrong_sizes`` with one row too few, and every
    other batch rightly. Labels: ``labels_file(root, 3)``."""
    from onnx import TensorProto, helper

    nodes = [helper.make_node("ReduceMean", ["input"], ["means"], axes=[2, 3], keepdims=0),
             helper.make_node("Shape", ["input"], ["shape"]),
             helper.make_node("Slice", ["shape", "zero", "one"], ["n"])]
    initializers = [_ints("zero", [0]), _ints("one", [1])]
    wrong = "no"
    initializers.append(helper.make_tensor("no", TensorProto.BOOL, [1], [False]))
    for size in sorted(wrong_sizes):
        initializers.append(_ints(f"size{size}", [size]))
        nodes += [helper.make_node("Equal", ["n", f"size{size}"], [f"is{size}"]),
                  helper.make_node("Or", [wrong, f"is{size}"], [f"upto{size}"])]
        wrong = f"upto{size}"
    nodes += [helper.make_node("Cast", [wrong], ["short"], to=TensorProto.INT64),
              helper.make_node("Sub", ["n", "short"], ["rows"]),
              helper.make_node("Slice", ["means", "zero", "rows", "zero"], ["output"])]
    return _save_onnx(nodes, initializers, path, 3)


def onnx_fixed_batch(path: Path, batch: int) -> Path:
    """A 3-class classifier (each channel's mean a logit) whose input takes only batches of
    ``batch``: what ``torch.onnx.export`` writes without a dynamic batch axis, made without
    torch's exporter (seconds of tracing for one input shape)."""
    from onnx import helper

    nodes = [helper.make_node("ReduceMean", ["input"], ["output"], axes=[2, 3], keepdims=0)]
    return _save_onnx(nodes, [], path, 3, batch=batch)


def onnx_memory_bomb(path: Path, side: int = 30_000) -> Path:
    """A 3-class classifier whose every call first expands a scalar to N×side×side floats
    (``side`` 30000: 3.6 GB per image), which ONNX Runtime allocates whole."""
    from onnx import TensorProto, helper

    nodes = [helper.make_node("ReduceMean", ["input"], ["means"], axes=[2, 3], keepdims=0),
             helper.make_node("Shape", ["input"], ["shape"]),
             helper.make_node("Slice", ["shape", "zero", "one"], ["n"]),
             helper.make_node("Concat", ["n", "side", "side"], ["huge"], axis=0),
             helper.make_node("Expand", ["scalar", "huge"], ["bomb"]),
             helper.make_node("ReduceMax", ["bomb"], ["peak"], axes=[1, 2], keepdims=0),
             helper.make_node("Unsqueeze", ["peak", "one"], ["column"]),
             helper.make_node("Add", ["means", "column"], ["output"])]
    initializers = [_ints("zero", [0]), _ints("one", [1]), _ints("side", [side]),
                    helper.make_tensor("scalar", TensorProto.FLOAT, [], [0.0])]
    return _save_onnx(nodes, initializers, path, 3)


def value_shaped_bomb(path: Path, per_unit: float = 40_000.0) -> Path:
    """A classifier whose every call also fills a k×k tensor, k = the input's largest value ×
    ``per_unit``: nothing for the probe's all-zero input, 6.4 GB for a pixel of 1.0."""
    from onnx import TensorProto, helper, save

    nodes = [helper.make_node("ReduceMean", ["x"], ["means"], axes=[2, 3], keepdims=0),
             helper.make_node("ReduceMax", ["x"], ["peak"], keepdims=0),
             helper.make_node("Mul", ["peak", "per_unit"], ["kf"]),
             helper.make_node("Cast", ["kf"], ["ki"], to=TensorProto.INT64),
             helper.make_node("Reshape", ["ki", "one"], ["k"]),
             helper.make_node("Concat", ["k", "k"], ["shape"], axis=0),
             helper.make_node("ConstantOfShape", ["shape"], ["big"],
                              value=helper.make_tensor("v", TensorProto.FLOAT, [1], [1.0])),
             helper.make_node("ReduceMin", ["big"], ["low"], keepdims=0),
             helper.make_node("Mul", ["means", "low"], ["y"])]
    graph = helper.make_graph(
        nodes, "value_shaped_bomb",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 224, 224])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])],
        [_ints("one", [1]), helper.make_tensor("per_unit", TensorProto.FLOAT, [], [per_unit])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", ONNX_OPSET)])
    model.ir_version = ONNX_IR_VERSION
    save(model, str(path))
    return path


def labels_file(root: Path, classes: int) -> Path:
    path = root / "labels.txt"
    path.write_text("".join(f"class {i}\n" for i in range(classes)))
    return path
