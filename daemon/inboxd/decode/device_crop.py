"""The device decode's crop arithmetic and its refusal, without torch: the route that picks the
files (``decode/device_route.py``) needs them, and loads the decoder itself only on a GPU."""

from __future__ import annotations

from inboxd.decode.jpeg_header import JpegHeader
from inboxd.decode.spec import PreprocessSpec

# As decode/pillow.py: past this many times the resize target's square the CPU path resizes only
# the crop window (bounded memory); here such a strip simply takes the CPU path.
FULL_RESIZE_MAX_RATIO = 16


class DecodeFailed(Exception):
    """The device decoder refused this file: it takes the CPU path, which decides its outcome."""


def resized_size(width: int, height: int, spec: PreprocessSpec) -> tuple[int, int]:
    """torchvision's Resize(int) arithmetic, exactly as ``decode/pillow.py`` does it."""
    if width <= height:
        return spec.resize, int(spec.resize * height / width)
    return int(spec.resize * width / height), spec.resize


def fits(header: JpegHeader, spec: PreprocessSpec) -> bool:
    """False for extreme aspect ratios, which the CPU path handles in bounded memory (``fit``
    is bounded by its square whatever the ratio)."""
    if spec.kind != "center_crop":
        return True
    new_w, new_h = resized_size(*header.oriented_size, spec)
    return new_w * new_h <= FULL_RESIZE_MAX_RATIO * spec.resize**2
