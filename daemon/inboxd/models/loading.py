"""Build the configured model, or say in a ``ConfigError`` (exit 78) why it cannot work.

Everything that could otherwise fail on the first image is checked here, at start-up, before
any file is touched: the files, the weights' shapes, the labels count, the device's support for
the precision and for ``torch.compile``, and one probe batch through the network (which catches
an input size the architecture cannot take and a program that does not return one tensor).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import shutil
from collections.abc import Iterator

import numpy as np
import torch
from torch import nn

from inboxd.config import ConfigError, ModelConfig, ModelInputConfig
from inboxd.decode.spec import PROBE_BATCH, PreprocessSpec
from inboxd.models.device import pick_device
from inboxd.models.model import Model, ModelInfo, TaskModel, imagenet_labels
from inboxd.models.preflight import label_count_problem, problem, read_labels
from inboxd.models.runtimes.agreement import measure
from inboxd.models.runtimes.choice import Choice, choose, cpu_flags
from inboxd.models.runtimes.runner import Runner
from inboxd.models.sources import (
    IMAGENET_CLASSES,
    Source,
    builtin,
    export_program,
    last_linear,
    torchvision_model,
)

# A program whose outputs for one image change with its batch-mates beyond this is not in eval
# mode (BatchNorm using batch statistics, active dropout).
BATCH_INDEPENDENCE_TOLERANCE = 1e-3


def load_model(config: ModelConfig) -> TaskModel:
    if config.kind == "ocr":
        from inboxd.models.ocr_model import load_ocr

        return load_ocr(config, pick_device(config.device))
    return load_network(config)


def load_network(config: ModelConfig) -> Model:
    if config.output == "detect":
        from inboxd.models.detect_model import load_detector

        return load_detector(config)
    device = pick_device("cpu" if config.kind == "onnx" and config.device == "auto"
                         else config.device)
    choice = choose_runtime(config, device)
    check_device(config, device, choice.precision)
    labels = read_labels(config.labels) if config.labels is not None else None
    source, spec, outputs = network_for(config, device, labels)
    labels = _labels_for(config, source, labels, outputs)
    info = ModelInfo(config.kind, source.description,
                     sum(p.numel() for p in source.network.parameters()), outputs,
                     source.max_batch)
    runner = onnx_source_runner(source.network) if config.kind == "onnx" else None
    # A precision chosen by auto starts in fp32 and is kept only if it agrees (below).
    start = "fp32" if choice.precision_by_auto else choice.precision
    model = Model(source.name, source.network, spec, labels, device, start,
                  config.top_k, output=config.output, color=config.input.color,
                  compile=config.compile, info=info, runner=runner)
    model.choice = choice
    if choice.runtime == "torch" and start != choice.precision:
        model.choice = keep_if_agrees(model, choice)
    if config.compile:
        _compile_now(model)
    return model


def choose_runtime(config: ModelConfig, device: torch.device) -> Choice:
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    return choose(config, device.type, flags=cpu_flags(),
                  cpu_capability=torch.backends.cpu.get_cpu_capability(),
                  gpu_capability=capability)


def keep_if_agrees(model: Model, choice: Choice) -> Choice:
    """Serve at the reduced precision ``auto`` chose only if it agrees with fp32 on the probe
    batch; otherwise fp32, with the reason."""
    agreement = measure(lambda images: model.run(images, model.torch_runner("fp32")),
                        lambda images: model.run(images, model.torch_runner(choice.precision)),
                        model.spec.crop, model.output == "embed")
    if agreement.ok:
        model.use(model.torch_runner(choice.precision))
        return dataclasses.replace(choice, reason=f"{choice.reason}; {agreement.describe()}")
    return dataclasses.replace(choice, precision="fp32", reason=(
        f"{choice.reason}, but {choice.precision} does not agree with fp32 "
        f"({agreement.describe()}): fp32"))


def network_for(config: ModelConfig, device: torch.device, labels: list[str] | None
                ) -> tuple[Source, PreprocessSpec, int]:
    """The configured network as it will run (an embedder's classifier removed), its input
    and its output size, each checked: what the exporter process rebuilds too."""
    source = build(config, device, len(labels) if labels else None)
    spec = input_spec(config.input, source)
    # A program returns what it was exported to return; the others are turned into embedders.
    embed_here = config.output == "embed" and config.kind not in ("export", "onnx")
    embedding_dim = strip_classifier(source) if embed_here else None
    outputs = probe(source.network, spec, device, config.kind in ("export", "onnx"))
    if embedding_dim is not None and outputs != embedding_dim:
        raise problem(f"output: embed: the last Linear layer of {source.name} is not its final "
                      "layer, so inboxd cannot find the pooled features; export a program that "
                      "returns the embedding instead")
    return source, spec, outputs


def build(config: ModelConfig, device: torch.device, label_count: int | None) -> Source:
    if config.kind == "torchvision":
        return torchvision_model(config, label_count)
    if config.kind == "export":
        return export_program(config, device)
    if config.kind == "onnx":
        from inboxd.models.runtimes.onnx import onnx_program

        return onnx_program(config)
    return builtin()


def check_device(config: ModelConfig, device: torch.device, precision: str) -> None:
    """The precision and compile settings against the device ``device: auto`` resolved to."""
    if config.kind == "onnx" and device.type == "cuda":
        raise problem("onnx: models run in onnxruntime on the CPU (the onnxruntime package has "
                      "no CUDA execution provider): set device: cpu or auto")
    if precision == "fp16" and device.type == "cpu":
        raise problem("precision: fp16 needs a CUDA GPU and the device is the CPU (CPUs have no "
                      "fast fp16 kernels): use fp32, or bf16 on a CPU with AVX-512/AMX")
    if (precision == "bf16" and device.type == "cuda"
            and not torch.cuda.is_bf16_supported(including_emulation=False)):
        raise problem(f"precision: bf16 is not supported natively by "
                      f"{torch.cuda.get_device_name(device)} (it needs compute capability 8.0 "
                      "or newer): use fp16 or fp32")
    if not config.compile:
        return
    if device.type == "cuda" and importlib.util.find_spec("triton") is None:
        raise problem("compile: true on a GPU needs the triton package (pip install triton), "
                      "or set compile: false")
    if device.type == "cpu" and not _cxx_compiler():
        raise problem("compile: true on the CPU needs a C++ compiler (g++ or clang++) for "
                      "torch.compile's generated code; install one, or set compile: false")


def _cxx_compiler() -> str | None:
    for candidate in (os.environ.get("CXX"), "g++", "clang++", "c++"):
        if candidate and shutil.which(candidate):
            return candidate
    return None


def input_spec(config: ModelInputConfig, source: Source) -> PreprocessSpec:
    """The configured input keys over the model's defaults."""
    defaults = source.defaults
    spec = PreprocessSpec(
        resize=config.resize or defaults.resize,
        crop=config.crop or defaults.crop,
        interpolation=config.interpolation or defaults.interpolation,
        mean=config.mean or defaults.mean,
        std=config.std or defaults.std,
    )
    if spec.crop > spec.resize:
        raise problem(f"input: crop {spec.crop} is larger than resize {spec.resize} (this "
                      "model's default where unset): set both")
    if source.input_size is not None and source.input_size != (spec.crop, spec.crop):
        height, width = source.input_size
        raise problem(f"export: the program takes {height}×{width} images but the crop is "
                      f"{spec.crop}: set model.input.crop (and resize) to match")
    return spec


def strip_classifier(source: Source) -> int:
    """Turn a classifier into an embedder: its last Linear layer becomes the identity, so the
    network returns that layer's input, the pooled features. Returns their dimension."""
    head = last_linear(source.network)
    if head is None or head[1].out_features != source.classes:
        raise problem(f"output: embed needs a network that ends in a Linear classifier and "
                      f"{source.name} does not; export a program that returns the embedding")
    name, linear = head
    parent, _, child = name.rpartition(".")
    setattr(source.network.get_submodule(parent), child, nn.Identity())
    return linear.in_features


def probe(network: nn.Module, spec: PreprocessSpec, device: torch.device,
          check_batch_independence: bool) -> int:
    """One batch through the network in fp32: it must take N×3×crop×crop and return one N×D
    tensor. Returns D."""
    generator = torch.Generator().manual_seed(0)
    batch = torch.rand(PROBE_BATCH, 3, spec.crop, spec.crop, generator=generator).to(device)
    try:
        with torch.inference_mode(), exact_float32():
            out = network.to(device)(batch)
            singles = ([network(batch[i:i + 1]) for i in range(PROBE_BATCH)]
                       if check_batch_independence else [])
    except Exception as exc:
        raise problem(f"the network fails on a {PROBE_BATCH}×3×{spec.crop}×{spec.crop} input "
                      f"(input.crop is {spec.crop}): {type(exc).__name__}: {str(exc)[:300]}"
                      ) from exc
    if not isinstance(out, torch.Tensor) or out.ndim != 2 or out.shape[0] != PROBE_BATCH:
        what = list(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise problem(f"the network must return one N×D tensor (logits, or the embedding for "
                      f"output: embed); for a batch of {PROBE_BATCH} it returned {what}")
    if singles:
        drift = float((torch.cat(singles) - out).abs().max())
        if drift > BATCH_INDEPENDENCE_TOLERANCE * max(1.0, float(out.abs().max())):
            raise problem("export: the program's output for an image depends on the other "
                          "images in its batch: it was exported in training mode; call "
                          "model.eval() before torch.export.export")
    return int(out.shape[1])


@contextlib.contextmanager
def exact_float32() -> Iterator[None]:
    """TF32 off while the probe runs: with it, a GPU's matmuls and convolutions round to 10
    mantissa bits and differ between batch sizes by ~1e-3, which the batch-independence check
    would take for a program exported in training mode."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _labels_for(config: ModelConfig, source: Source, labels: list[str] | None,
                outputs: int) -> list[str] | None:
    """The class names a classifier reports; None for an embedder. A labels file given for a
    torchvision embedder is still checked against num_classes (both describe the weights)."""
    classify = config.output == "classify"
    if config.kind == "builtin":
        return imagenet_labels() if classify else None
    if not classify and config.kind in ("export", "onnx"):
        return None  # the program returns the embedding: there are no classes to count
    classes = source.classes if source.classes is not None else outputs
    if labels is not None:
        assert config.labels is not None
        what = (f"the model (num_classes: {classes})" if config.kind == "torchvision"
                else "the program")
        mismatch = label_count_problem(labels, config.labels, classes, what)
        if mismatch:
            raise problem(mismatch)
        return labels if classify else None
    if not classify:
        return None
    if classes == IMAGENET_CLASSES:
        return imagenet_labels()  # 1000 outputs: the ImageNet classes, as torchvision's weights
    raise problem(f"labels: the model has {classes} classes: give labels: PATH (one label per "
                  "line, or a JSON list), or set output: embed")


def onnx_source_runner(network: nn.Module) -> Runner:
    from inboxd.models.runtimes import onnx as onnx_runtime

    assert isinstance(network, onnx_runtime.OnnxNetwork)
    return onnx_runtime.runner(network)


def _compile_now(model: Model) -> None:
    """Compile at start-up, where a failure is a config problem with a fix, rather than on the
    first batch."""
    blank = np.zeros((model.spec.crop, model.spec.crop, 3), dtype=np.uint8)
    try:
        model.outputs([blank])
    except Exception as exc:
        raise ConfigError("model", [f"compile: torch.compile failed ({type(exc).__name__}: "
                                    f"{str(exc)[:300]}); set compile: false"]) from exc
