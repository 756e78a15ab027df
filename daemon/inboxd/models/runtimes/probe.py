"""The probe batch a faster runner must agree on before it serves, torch-free (a model served
from its cached artifact checks OpenVINO against ONNX Runtime without importing torch).

The probe images are seeded smooth colour fields, not noise: on noise every class scores alike
and the top-1 is a coin toss that even float rounding may flip.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

PROBE_IMAGES = 4
PROBE_SEED = 31
# The most any class score may move on a probe image: the fidelity contract's bound on the
# top-1 score.
SCORE_TOLERANCE = 0.01
_GRID = 6  # the colour field's control points per side, bilinearly upscaled to the crop


def probe_images(crop: int, count: int = PROBE_IMAGES) -> list[npt.NDArray[np.uint8]]:
    """``count`` crop×crop×3 uint8 images, the same on every run (bilinear with the corners
    aligned, as torch's ``interpolate(align_corners=True)``)."""
    generator = np.random.default_rng(PROBE_SEED)
    grid = generator.uniform(0, 255, (count, 3, _GRID, _GRID)).astype(np.float32)
    at = np.linspace(0, _GRID - 1, crop, dtype=np.float32)
    low = np.minimum(np.floor(at).astype(int), _GRID - 2)
    frac = at - low
    rows = grid[:, :, low, :] * (1 - frac)[:, None] + grid[:, :, low + 1, :] * frac[:, None]
    fields = rows[..., low] * (1 - frac) + rows[..., low + 1] * frac
    pixels = np.clip(np.round(fields), 0, 255).astype(np.uint8).transpose(0, 2, 3, 1)
    return [np.ascontiguousarray(image) for image in pixels]


def softmax(logits: npt.NDArray[np.float32]) -> npt.NDArray[np.float64]:
    values = np.asarray(logits, dtype=np.float64)
    shifted = np.exp(values - values.max(axis=1, keepdims=True))
    return np.asarray(shifted / shifted.sum(axis=1, keepdims=True))
