"""What runs a network's forward: torch (eager or compiled, under autocast) or ONNX Runtime."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Runner:
    """What runs the network on a normalised batch (N×3×H×W float32 → N×D float32), and how
    results say it ran: torch eager or compiled under autocast, or ONNX Runtime."""

    runtime: str  # torch | onnxruntime
    precision: str  # fp32 | fp16 | bf16: the autocast dtype for torch
    forward: Callable[[torch.Tensor], torch.Tensor]
    # The input layout it is fastest with: channels_last for torch's convolutions; ONNX
    # Runtime takes a contiguous NCHW array without a copy.
    memory_format: torch.memory_format = torch.channels_last
