"""The unit of work that travels down the pipeline: one claimed file."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt


class PermanentError(Exception):
    """The input itself is bad (not an image, truncated, too large): retrying cannot help.

    ``reason_class`` is the failure's coarse class (``inboxd.stats.REASON_CLASSES``: the
    metrics label and ``.error.json``'s field), declared by each class, never read from text."""

    reason_class = "decode"


class RefusedError(PermanentError):
    """Not a file inboxd reads at all: a link, a FIFO, a folder, a name outside the inbox."""

    reason_class = "refused"


class TooLargeError(PermanentError):
    """Over a bound checked before the work: file bytes, decoded pixels, decode memory."""

    reason_class = "too_large"


class ModelError(PermanentError):
    """The model failed on this input (or gave no usable output for it)."""

    reason_class = "model"


class TransientError(Exception):
    """Something around the input failed (disk full, file locked, CUDA OOM): try again later.
    Out of attempts, it is an ``io`` failure."""

    reason_class = "io"


PERMANENT_BY_CLASS: dict[str, type[PermanentError]] = {
    error.reason_class: error for error in (PermanentError, RefusedError, TooLargeError,
                                            ModelError)}


def permanent(reason_class: str, message: str) -> PermanentError:
    """The permanent error of a declared class, rebuilt from its class name (a decode worker's
    reply, a replica's outcome carry the name, not the object)."""
    return PERMANENT_BY_CLASS.get(reason_class, PermanentError)(message)


@dataclass(slots=True)
class DecodedImage:
    pixels: npt.NDArray[np.uint8]  # H×W×3, RGB, as the spec asked: a crop, or fitted (whole)
    width: int  # of the source image, after EXIF rotation
    height: int
    format: str | None
    mode: str
    # Set instead of ``pixels`` (then empty) when the crop was decoded on the model's device
    # (decode/tensor.py): a crop×crop×3 uint8 torch tensor there, counted in ``nbytes`` like
    # host pixels, so the preprocess cache's MB bound covers what the GPU holds for it.
    device_pixels: Any = None
    # With several tasks (``models:``): the outputs of the other tasks' specs, in task order,
    # made from the same decode (the photo is read and decoded once, each task's input cut or
    # fitted from it).
    others: tuple[npt.NDArray[np.uint8], ...] = ()

    @classmethod
    def on_device(cls, tensor: Any, width: int, height: int, format_: str | None,
                  mode: str) -> DecodedImage:
        return cls(np.empty((0, 0, 3), dtype=np.uint8), width, height, format_, mode, tensor)

    @property
    def nbytes(self) -> int:
        others = sum(int(array.nbytes) for array in self.others)
        if self.device_pixels is not None:
            return int(self.device_pixels.numel() * self.device_pixels.element_size()) + others
        return int(self.pixels.nbytes) + others

    def for_task(self, index: int) -> DecodedImage:
        """Task ``index``'s own image (0: the first spec's), the photo's facts shared."""
        if index == 0:
            return DecodedImage(self.pixels, self.width, self.height, self.format, self.mode,
                                self.device_pixels)
        return DecodedImage(self.others[index - 1], self.width, self.height, self.format,
                            self.mode)

    @property
    def model_input(self) -> Any:
        """What the model takes: the host array, or the tensor already on its device."""
        return self.device_pixels if self.device_pixels is not None else self.pixels


@dataclass(slots=True)
class WorkItem:
    inbox: Path  # the inbox folder the file was found in
    rel: str  # path relative to that inbox, "/"-separated
    key: str  # the name under results/, done/ and failed/ (rel, or inbox-name/rel)
    # Where the file lives while we own it: <inbox>/.processing/<instance>/rel. A str, as every
    # per-file path is: pathlib would intern each file's name (files.names.relative_inside).
    claimed_path: str
    noticed_s: float = field(default_factory=time.monotonic)
    # (inode, size, mtime_ns) when claimed: a file that changes after its claim was still
    # being written; with after_success: keep, the result records it to recognise the file.
    identity: tuple[int, int, int] | None = None
    # Once the outcome is decided and recorded, only the source's move is left: "success" (its
    # result is durable under ``name``) or "failure" (``failure_report`` says why).
    finishing: str | None = None
    finish_attempts: int = 0
    name: str | None = None  # the name its result / failed entry is filed under
    failure_report: dict[str, Any] | None = None
    attempts: int = 0
    decode_timeouts: int = 0  # a second time-out fails the file for good
    errors: list[str] = field(default_factory=list)  # one per failed attempt, max_attempts at most
    sha256: str | None = None
    size_bytes: int | None = None
    image: DecodedImage | None = None
    image_info: dict[str, Any] = field(default_factory=dict)  # kept after the pixels are freed
    # Monotonic stage stamps, turned into per-stage timings in the result.
    enqueued_s: float = 0.0
    dequeued_s: float = 0.0
    preprocessed_s: float = 0.0
    inferred_s: float = 0.0
    inference_ms: float = 0.0
    # What ran it (the local engine swaps runners between batches): "" until inferred here.
    runtime: str = ""
    precision: str = ""

    @property
    def inbox_path(self) -> str:
        """Where the file was found (and goes back to when released), as a str."""
        return os.path.join(self.inbox, self.rel)

    def timings_ms(self, now_s: float) -> dict[str, float]:
        """Per-stage milliseconds, each rounded once to the microsecond, as the stats record's:
        ``batch_wait`` is decoded → answered less the model call itself."""
        def ms(seconds: float) -> float:
            return round(max(0.0, seconds) * 1000, 3)

        inference_s = self.inference_ms / 1000
        return {
            "queue_wait": ms(self.dequeued_s - self.enqueued_s),
            "preprocess": ms(self.preprocessed_s - self.dequeued_s),
            "batch_wait": ms(self.inferred_s - self.preprocessed_s - inference_s),
            "inference": ms(inference_s),
            "total": ms(now_s - self.noticed_s),
        }

    def reset_for_retry(self) -> None:
        """Drop everything derived from the file so the next attempt starts clean."""
        self.image = None
        self.sha256 = None
        self.size_bytes = None

