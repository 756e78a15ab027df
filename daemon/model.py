"""The model: loaded once, on CUDA when there is one, run under ``torch.inference_mode()``.

Images arrive as uint8 H×W×3 arrays. They are stacked on the host (pinned when the target is a
GPU, so the copy can be asynchronous), copied once, and converted and normalised on the device
in a single batched operation; the network runs in channels_last, which is what cuDNN and the
CPU kernels are fastest with for convolutions.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from torch import nn

from daemon.config import ModelConfig
from daemon.preprocess import PreprocessSpec

PRECISIONS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def imagenet_labels() -> list[str]:
    from torchvision.models._meta import _IMAGENET_CATEGORIES

    return list(_IMAGENET_CATEGORIES)


def pick_device(requested: str) -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(requested)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            f"model.device is {requested!r} but no CUDA GPU is visible to this process "
            "(check the driver with nvidia-smi, CUDA_VISIBLE_DEVICES, and the unit's DeviceAllow=); "
            "set model.device: auto to fall back to the CPU"
        )
    return device


@dataclass
class Classification:
    top_k: list[dict[str, Any]]


class Model:
    """One network with its preprocessing, labels and device."""

    def __init__(
        self,
        name: str,
        network: nn.Module,
        spec: PreprocessSpec,
        labels: list[str],
        device: torch.device,
        precision: str,
        top_k: int,
    ) -> None:
        self.name = name
        self.spec = spec
        self.labels = labels
        self.device = device
        self.precision = precision
        self.top_k = min(top_k, len(labels))
        self.network = network.eval().to(device, memory_format=torch.channels_last)
        self._mean = torch.tensor(spec.mean, device=device).view(1, 3, 1, 1) * 255
        self._std = torch.tensor(spec.std, device=device).view(1, 3, 1, 1) * 255
        # A test seam: the fault tests make a chosen batch raise (CUDA OOM, a model error).
        self.before_forward: Callable[[int], None] | None = None

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=PRECISIONS[self.precision])

    def to_input(self, images: Sequence[npt.NDArray[np.uint8]]) -> torch.Tensor:
        host = torch.from_numpy(np.stack(images))  # N×H×W×3 uint8
        if self.on_gpu:
            host = host.pin_memory()
        batch = host.to(self.device, non_blocking=True).permute(0, 3, 1, 2)  # channels_last view
        return ((batch.float() - self._mean) / self._std).contiguous(
            memory_format=torch.channels_last
        )

    def logits(self, images: Sequence[npt.NDArray[np.uint8]]) -> torch.Tensor:
        if self.before_forward is not None:
            self.before_forward(len(images))
        with torch.inference_mode(), self._autocast():
            return self.network(self.to_input(images)).float()

    def classify(self, images: Sequence[npt.NDArray[np.uint8]]) -> list[Classification]:
        logits = self.logits(images)
        with torch.inference_mode():
            scores, indices = torch.softmax(logits, dim=1).topk(self.top_k, dim=1)
        scores_host, indices_host = scores.cpu().tolist(), indices.cpu().tolist()
        return [
            Classification(
                [
                    {"label": self.labels[i], "index": i, "score": round(s, 6)}
                    for s, i in zip(row_scores, row_indices, strict=True)
                ]
            )
            for row_scores, row_indices in zip(scores_host, indices_host, strict=True)
        ]

    def warm_up(self, batch_size: int) -> float:
        """Run the largest batch once (cuDNN picks its kernels, the allocator fills its pool),
        so the first real file is not the slow one. Returns seconds taken."""
        started = time.perf_counter()
        blank = np.zeros((self.spec.crop, self.spec.crop, 3), dtype=np.uint8)
        for size in sorted({1, batch_size}):
            self.classify([blank] * size)
        if self.on_gpu:
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - started

    def memory_fields(self) -> dict[str, int]:
        """CUDA memory for the stats record: allocated = live tensors, reserved = what the
        caching allocator holds (reserved above allocated is the cache, not a leak)."""
        if not self.on_gpu:
            return {}
        return {
            "CUDA_ALLOCATED_BYTES": torch.cuda.memory_allocated(self.device),
            "CUDA_RESERVED_BYTES": torch.cuda.memory_reserved(self.device),
            "CUDA_MAX_ALLOCATED_BYTES": torch.cuda.max_memory_allocated(self.device),
        }


def load_model(config: ModelConfig) -> Model:
    from daemon import efficientnet_lite

    device = pick_device(config.device)
    network = efficientnet_lite.load_efficientnet_lite0()
    spec = PreprocessSpec(
        resize=efficientnet_lite.RESIZE_SHORTER_SIDE,
        crop=efficientnet_lite.CROP_SIZE,
        interpolation=efficientnet_lite.RESIZE_INTERPOLATION,
        mean=efficientnet_lite.MEAN,
        std=efficientnet_lite.STD,
    )
    return Model(config.name, network, spec, imagenet_labels(), device, config.precision,
                 config.top_k)
