"""Whether a faster runner gives the results the reference does, on one probe batch.

A runner is swapped in (or a reduced precision kept) only when, for every probe image, its
top-1 class is the reference's and no class score moves by more than ``SCORE_TOLERANCE`` (the
fidelity contract's bound on the top-1 score); for an embedder, when every vector's cosine
similarity with the reference is at least ``MIN_COSINE``. The probe images are seeded smooth
colour fields, not noise: on noise every class scores alike and the top-1 is a coin toss that
even float rounding may flip.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

PROBE_IMAGES = 4
PROBE_SEED = 31
SCORE_TOLERANCE = 0.01
MIN_COSINE = 0.999
_GRID = 6  # the colour field's control points per side, bilinearly upscaled to the crop


def probe_images(crop: int, count: int = PROBE_IMAGES) -> list[npt.NDArray[np.uint8]]:
    """``count`` crop×crop×3 uint8 images, the same on every run."""
    generator = np.random.default_rng(PROBE_SEED)
    grid = torch.from_numpy(generator.uniform(0, 255, (count, 3, _GRID, _GRID))).float()
    fields = torch.nn.functional.interpolate(grid, size=(crop, crop), mode="bilinear",
                                             align_corners=True)
    pixels = fields.round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()
    return [np.ascontiguousarray(image) for image in pixels]


@dataclass(frozen=True)
class Agreement:
    images: int
    top1_equal: int  # classify; for embed, vectors within MIN_COSINE
    max_score_diff: float  # classify: max |Δ softmax score|; embed: 1 - min cosine
    ok: bool

    def describe(self) -> str:
        return (f"top-1 equal on {self.top1_equal}/{self.images} probe images, max |Δ score| "
                f"{self.max_score_diff:.2e} (at most {SCORE_TOLERANCE} allowed)")

    def fields(self) -> dict[str, str | float]:
        return {"PROBE_TOP1_EQUAL": f"{self.top1_equal}/{self.images}",
                "PROBE_MAX_SCORE_DIFF": float(f"{self.max_score_diff:.3g}")}


def compare(reference: torch.Tensor, candidate: torch.Tensor, embed: bool) -> Agreement:
    """Two runners' float outputs for the same batch (logits, or embeddings)."""
    images = int(reference.shape[0])
    if candidate.shape != reference.shape or not bool(torch.isfinite(candidate).all()):
        return Agreement(images, 0, float("inf"), False)
    if embed:
        cosine = torch.nn.functional.cosine_similarity(reference.double(), candidate.double())
        close = int((cosine >= MIN_COSINE).sum())
        return Agreement(images, close, float(1 - cosine.min()), close == images)
    ref_scores, cand_scores = torch.softmax(reference, 1), torch.softmax(candidate, 1)
    equal = int((ref_scores.argmax(1) == cand_scores.argmax(1)).sum())
    diff = float((ref_scores - cand_scores).abs().max())
    return Agreement(images, equal, diff, equal == images and diff <= SCORE_TOLERANCE)


def measure(run: Callable[[Sequence[npt.NDArray[np.uint8]]], torch.Tensor],
            run_candidate: Callable[[Sequence[npt.NDArray[np.uint8]]], torch.Tensor],
            crop: int, embed: bool) -> Agreement:
    images = probe_images(crop)
    return compare(run(images), run_candidate(images), embed)
