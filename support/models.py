"""The tiny networks the benchmarks measure with and the tests run the real daemon on, so that
a test and a figure use the same model: ``NullModel`` (costs nothing: the pipeline's own
overhead shows) and ``TinyNet`` (a small convolution, for the Ray engine)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn


class NullModel(nn.Module):
    """Costs nothing: per-channel means → 10 scores."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc(x.mean(dim=(2, 3)))
        return out


class TinyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 8, 3, stride=2)
        self.fc = nn.Linear(8, 1000)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc(torch.relu(self.conv(x)).mean(dim=(2, 3)))
        return out


def tiny_program(path: Path) -> Path:
    """``TinyNet`` as a torch.export program at ``path`` (batches of 1 to 64)."""
    batch = torch.export.Dim("batch", min=1, max=64)
    program = torch.export.export(TinyNet().eval(), (torch.randn(2, 3, 32, 32),),
                                  dynamic_shapes=({0: batch},))
    torch.export.save(program, path)
    return path
