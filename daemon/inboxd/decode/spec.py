"""What a model wants its input to look like (set by the model, applied by the decoder)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PreprocessSpec:
    """How a model wants its input: resize the shorter side, then center-crop a square."""

    resize: int
    crop: int
    interpolation: str
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
