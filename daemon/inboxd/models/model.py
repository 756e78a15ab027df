"""The model at run time: loaded once, on CUDA when there is one, run under ``inference_mode``.

Images arrive as uint8 H×W×3 RGB arrays. They are stacked on the host (pinned when the target is
a GPU, so the copy can be asynchronous; on the CPU into buffers each thread keeps), copied once,
and colour-converted and normalised on the device in a single batched operation; the network
runs in channels_last, which is what cuDNN and the CPU kernels are fastest with for convolutions.

What to load, and every check that the configured files and device can work, lives in
``inboxd.models.loading``; this module only runs what it was given.

Longer than 300 lines because the whole run-time path of a batch (stacking, normalisation, the
runner that serves, reduce, predictions, warm-up) reads best in one place.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from torch import nn

from inboxd.config import ConfigError
from inboxd.decode.spec import PreprocessSpec
from inboxd.item import DecodedImage
from inboxd.models.host_buffers import HostStaging
from inboxd.models.memory import cuda_memory_fields
from inboxd.models.predictions import (
    LUMA_WEIGHTS,
    Classification,
    Color,
    Embedding,
    ModelInfo,
    Output,
    Prediction,
    TaskAnswer,
    TaskModel,
    TaskResults,
    UnfitAnswer,
    not_finite,
)
from inboxd.models.runtimes.runner import Runner

# The predictions' types live in models/predictions.py (no torch there); their names are this
# module's too.
__all__ = ["Classification", "Color", "Embedding", "Model", "ModelInfo", "Output", "Pixels",
           "Prediction", "TaskAnswer", "TaskModel", "TaskResults", "UnfitAnswer", "imagenet_labels",
           "not_finite", "on_host"]

PRECISIONS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

# One image for the model: H×W×3 uint8 RGB, a host array or a tensor already on the device.
Pixels = npt.NDArray[np.uint8] | torch.Tensor


def on_host(images: Sequence[Pixels]) -> bool:
    """Whether every crop of a batch is a host array (none was decoded on the device)."""
    return all(isinstance(image, np.ndarray) for image in images)


def imagenet_labels() -> list[str]:
    from torchvision.models._meta import _IMAGENET_CATEGORIES

    return list(_IMAGENET_CATEGORIES)


class Model:
    """One network with its preprocessing, labels, output kind and device.

    ``network`` must already be in eval mode (a ``torch.export`` program cannot be switched).
    """

    # Whether the CUDA launch/collect split (engines/cuda_overlap.py) may run its batches: it
    # stages equal-sized crops, which a detector's fitted photos are not.
    batches_overlap = True
    # torch parallelises inside a call (its intra-op threads): two calls would oversubscribe.
    concurrent_calls = 1

    def __init__(
        self,
        name: str,
        network: nn.Module,
        spec: PreprocessSpec,
        labels: list[str] | None,
        device: torch.device,
        precision: str,
        top_k: int,
        *,
        output: Output = "classify",
        color: Color = "rgb",
        compile: bool = False,
        info: ModelInfo | None = None,
        runner: Runner | None = None,
    ) -> None:
        """``runner``: what runs ``network`` when it is not torch itself (an ``.onnx`` file)."""
        if output == "classify" and not labels:
            raise ValueError("a classifying model needs its labels")
        self.name = name
        self.spec = spec
        self.labels = labels
        self.device = device
        self.output = output
        self.color = color
        self.top_k = min(top_k, len(labels)) if labels else 0
        self.info = info
        self.network = network.to(device).to(memory_format=torch.channels_last)
        # The runner that serves; the local engine swaps a faster one in between two batches
        # (``use``), on the model thread, so a batch runs on one runner from start to end.
        self.runner = runner or Runner(
            "torch", precision, torch.compile(self.network) if compile else self.network)
        self._mean = torch.tensor(spec.mean, device=device).view(1, 3, 1, 1) * 255
        self._std = torch.tensor(spec.std, device=device).view(1, 3, 1, 1) * 255
        self._luma = torch.tensor(LUMA_WEIGHTS, dtype=torch.int32, device=device).view(1, 3, 1, 1)
        # The largest batch the network accepts (a .pt2 program's dynamic-dimension bound).
        self.max_batch: int | None = info.max_batch if info is not None else None
        # A test seam: the fault tests make a chosen batch raise (CUDA OOM, a model error).
        self.before_forward: Callable[[int], None] | None = None
        # The device boundary of the stats probe: a test puts a fake memory API here.
        self.cuda_memory: Any = torch.cuda
        self._staging = HostStaging()
        # What one blank batch of each warmed size took, warm-up included: the start-up
        # compares the largest with the watchdog's timeout.
        self.batch_seconds: dict[int, float] = {}
        # What runtime_choice decided and why (set by loading; None for a model built by hand).
        self.choice: Any = None

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"

    @property
    def precision(self) -> str:
        return self.runner.precision

    @property
    def runtime(self) -> str:
        return self.runner.runtime

    def use(self, runner: Runner) -> None:
        """Serve with ``runner`` from the next batch on. Call it on the thread that runs
        inference, between two batches."""
        self.runner = runner

    def torch_runner(self, precision: str) -> Runner:
        """The network in torch eager at ``precision``: the reference a fast runner is checked
        against, or the same network at another autocast dtype."""
        return Runner("torch", precision, self.network)

    def _autocast(self, runner: Runner) -> contextlib.AbstractContextManager[Any]:
        if runner.precision == "fp32" or runner.runtime != "torch":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=PRECISIONS[runner.precision])

    def input_of(self, image: DecodedImage) -> Pixels:
        """What ``predict`` takes for one decoded photo: its pixels (host or device)."""
        pixels: Pixels = image.model_input
        return pixels

    def to_device(self, images: Sequence[Pixels]) -> torch.Tensor:
        """N×H×W×3 uint8 on the device. Host arrays are stacked (pinned on a GPU, so the copy
        is asynchronous); crops decoded on the device (``decode/tensor.py``) are used in place."""
        if on_host(images):
            host = torch.from_numpy(np.stack(images))
            if self.on_gpu:
                host = host.pin_memory()
            return host.to(self.device, non_blocking=True)
        tensors = [torch.as_tensor(image, device=self.device) for image in images]
        if self.on_gpu:
            # Decoded on another stream and freed once stacked: the allocator must not hand
            # their memory back to that stream before this one has read it.
            stream = torch.cuda.current_stream(self.device)
            for tensor in tensors:
                tensor.record_stream(stream)
        return torch.stack(tensors)

    def to_input(self, images: Sequence[Pixels]) -> torch.Tensor:
        return self.normalise(self.to_device(images))

    def normalise(self, pixels: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """N×H×W×3 uint8 on the device → the network's N×3×H×W float input, channels_last;
        written into ``out`` when given (float32, that shape, channels_last)."""
        batch = pixels.permute(0, 3, 1, 2)  # channels_last view
        if self.color == "bgr":
            batch = batch.flip(1)
        elif self.color == "gray":
            luma = ((batch.int() * self._luma).sum(1, keepdim=True) + 0x8000) >> 16
            batch = luma.expand(-1, 3, -1, -1)
        if out is not None:  # the same operations in the same order: the same bits
            return out.copy_(batch).sub_(self._mean).div_(self._std)
        return ((batch.float() - self._mean) / self._std).contiguous(
            memory_format=torch.channels_last
        )

    def outputs(self, images: Sequence[Pixels]) -> torch.Tensor:
        """The network's output for a batch, as float32: logits, or embeddings for ``embed``."""
        if self.before_forward is not None:
            self.before_forward(len(images))
        return self.run(images, self.runner)

    def run(self, images: Sequence[Pixels], runner: Runner) -> torch.Tensor:
        """``outputs`` through a chosen runner (a probe compares two), without the test seam."""
        with torch.inference_mode():
            if self.on_gpu or not on_host(images):
                return self.forward(self.to_device(images), runner=runner)
            pixels, inputs = self._staging.stage(images, runner.memory_format)  # type: ignore[arg-type]
            return self.forward(pixels, inputs, runner)

    def forward(self, pixels: torch.Tensor, out: torch.Tensor | None = None,
                runner: Runner | None = None) -> torch.Tensor:
        """N×H×W×3 uint8 on the device → the network's float32 output (call in inference_mode);
        ``out`` as for ``normalise``."""
        runner = runner or self.runner
        with self._autocast(runner):
            return runner.forward(self.normalise(pixels, out)).float()

    def reduce(self, outputs: torch.Tensor) -> list[torch.Tensor]:
        """On the device, what the predictions need: top-k (scores, indices), or the vectors."""
        if self.output == "embed":
            return [outputs]
        scores, indices = torch.softmax(outputs, dim=1).topk(self.top_k, dim=1)
        return [scores, indices]

    def predictions(self, reduced: Sequence[torch.Tensor]) -> list[Prediction]:
        """``reduce``'s tensors, on the host, as one prediction per image."""
        if self.output == "embed":
            # A copy per row, so one image's result does not keep the whole batch alive.
            return [Embedding(np.array(row, dtype=np.float32)) for row in reduced[0].numpy()]
        assert self.labels is not None
        labels = self.labels
        scores, indices = reduced[0].tolist(), reduced[1].tolist()
        return [Classification([{"label": labels[i], "index": i, "score": round(s, 6)}
                                for s, i in zip(row_scores, row_indices, strict=True)])
                for row_scores, row_indices in zip(scores, indices, strict=True)]

    def predict(self, images: Sequence[Pixels]) -> Sequence[Prediction]:
        """What the config asked for: top-k classes, or embedding vectors. ``UnfitAnswer``
        when the network's output cannot be one prediction per image."""
        outputs = self.outputs(images)
        self.check_answer(outputs, len(images))
        with torch.inference_mode():
            return self.predictions([t.cpu() for t in self.reduce(outputs)])

    def check_answer(self, outputs: torch.Tensor, batch_size: int) -> None:
        """``outputs`` must be batch_size × D, D what the probe found at start-up, and finite.
        A network can pass the probe and still answer some batch sizes wrongly (a program with
        a data-dependent shape), or one batch with NaN (fp16 overflow)."""
        self.check_shape(outputs, batch_size)
        self.check_finite(outputs, batch_size)

    def check_shape(self, outputs: torch.Tensor, batch_size: int) -> None:
        """``check_answer``'s half that needs no device sync."""
        columns = self.info.outputs if self.info is not None else None
        shape = list(outputs.shape)
        if outputs.ndim != 2 or shape[0] != batch_size or columns not in (None, shape[1]):
            wanted = f"{batch_size}×{columns if columns is not None else 'D'}"
            raise UnfitAnswer(f"the model answered a batch of {batch_size} with a {shape} "
                              f"tensor, not {wanted}")

    def check_finite(self, outputs: torch.Tensor, batch_size: int) -> None:
        """``check_answer``'s other half (on a GPU it waits for ``outputs``)."""
        if not bool(torch.isfinite(outputs).all()):
            raise UnfitAnswer(f"the model's output for a batch of {batch_size} is not a number "
                              "(NaN or infinite values)")

    def classify(self, images: Sequence[Pixels]) -> list[Classification]:
        assert self.output == "classify"
        return [p for p in self.predict(images) if isinstance(p, Classification)]

    def embed(self, images: Sequence[Pixels]) -> list[Embedding]:
        assert self.output == "embed"
        return [p for p in self.predict(images) if isinstance(p, Embedding)]

    def check_batch_size(self, max_size: int) -> None:
        """A ``ConfigError`` when the network cannot take batches of ``max_size``."""
        if self.max_batch is not None and max_size > self.max_batch:
            raise ConfigError("model", [
                f"the program accepts batches of at most {self.max_batch} images, "
                f"but batch.max_size is {max_size}: lower batch.max_size, or export again with "
                "a larger max in torch.export.Dim"
            ])

    def warm_up_sizes(self, max_size: int) -> list[int]:
        """The batch sizes to warm up: every size the batcher can produce on a GPU (cuDNN
        builds its plans per input shape, and the first batch of a size that was not warmed
        pays for them all), only 1 and the largest on the CPU (oneDNN's per-shape set-up is
        small next to a forward, and warming every size would cost max²/2 images of CPU
        time at each start)."""
        self.check_batch_size(max_size)
        if self.on_gpu:
            return list(range(1, max_size + 1))
        return sorted({1, max_size})

    def warm_up(self, sizes: Sequence[int]) -> float:
        """Run one blank batch of each size (cuDNN picks its kernels, the allocator fills its
        pool, torch.compile compiles), so no real file is the slow one. Call it on the thread
        that runs inference: cuDNN's handles and plan caches are per thread. Returns seconds;
        ``batch_seconds`` keeps what each size took. A ``ConfigError`` when the model's answer
        to a size does not fit it (``check_answer``)."""
        started = time.perf_counter()
        blank = np.zeros((self.spec.crop, self.spec.crop, 3), dtype=np.uint8)
        for size in sizes:
            size_started = time.perf_counter()
            try:
                self.predict([blank] * size)
            except UnfitAnswer as exc:
                # Every size warmed is a size the batcher will send: a model that cannot
                # answer one would fail every batch of it, so it is refused now.
                fits = [s for s in self.batch_seconds if s < size]
                hint = (f"set batch.max_size to {max(fits)} (it answered batches of "
                        f"{', '.join(map(str, sorted(fits)))})" if fits else
                        "export the model again with a dynamic batch axis it honours")
                raise ConfigError("model", [f"{exc}: {hint}"]) from exc
            if self.on_gpu:
                torch.cuda.synchronize(self.device)
            self.batch_seconds[size] = time.perf_counter() - size_started
        return time.perf_counter() - started

    def health_problem(self) -> str | None:
        """Why a blank image cannot go through the model now, or None: asked after an input
        failed alone, because only an input that fails on a healthy device is at fault."""
        blank = np.zeros((self.spec.crop, self.spec.crop, 3), dtype=np.uint8)
        try:
            self.predict([blank])
            if self.on_gpu:
                torch.cuda.synchronize(self.device)
        except Exception as exc:  # any failure here means the input was not the cause
            return f"{type(exc).__name__}: {exc}"
        return None

    def memory_fields(self) -> dict[str, int]:
        """CUDA memory for the stats record (``inboxd.models.memory``); nothing on the CPU."""
        if not self.on_gpu:
            return {}
        return cuda_memory_fields(self.device, self.cuda_memory)
