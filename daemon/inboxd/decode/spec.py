"""What a model wants its input to look like (set by the model, applied by the decoder)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# fast: JPEGs decoded by libjpeg at a reduced scale (DCT scaling) and resized through Pillow's
# reducing_gap, within the fidelity contract (bench/fidelity.py); exact: torchvision's pixels;
# fastest (opt-in, outside the contract): DCT scaling right down to the target, as libvips'
# shrink-on-load does.
ResizeMode = Literal["fast", "exact", "fastest"]
RESIZE_MODES: tuple[ResizeMode, ...] = ("fast", "exact", "fastest")


def resize_mode(value: object) -> ResizeMode:
    """``value`` as a ResizeMode (a worker reads it from the daemon's request pipe)."""
    for mode in RESIZE_MODES:
        if value == mode:
            return mode
    raise ValueError(f"resize mode {value!r} is none of {', '.join(RESIZE_MODES)}")


@dataclass(frozen=True, slots=True)
class PreprocessSpec:
    """How a model wants its input: resize the shorter side, then center-crop a square."""

    resize: int
    crop: int
    interpolation: str
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    # Set by the daemon's preprocess.resize, not by the model: a model describes its input,
    # and either mode gives that input. "exact" here, so a bare spec means torchvision's pixels.
    resize_mode: ResizeMode = "exact"
