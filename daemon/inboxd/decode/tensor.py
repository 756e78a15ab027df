"""Baseline JPEGs decoded in batches on the model's device, then oriented, resized, cropped there.

On a GPU the bytes go to nvJPEG through ``torchvision.io.decode_jpeg(list, device="cuda")``;
on the CPU (the tests, and the parity they prove) the same call decodes with libjpeg-turbo, and
everything after it is the same tensor code: EXIF orientation (read on the CPU from the header,
``decode/jpeg_header.py``) as flips/transposes, torchvision's antialiased ``resize`` of the
shorter side, the centre crop with ``decode/pillow.py``'s arithmetic (or, for a ``fit`` spec, the
resize that fits the whole photo in ``crop``²). The result is a ``crop``×``crop``×3 (at most)
uint8 tensor on the device, which the preprocess cache counts in its bytes.

**Why torchvision, not torchcodec.** torchvision 0.29 deprecates its image decoders for
torchcodec's. We still call torchvision's: it is installed wherever torch is, its batched
``decode_jpeg(list, device="cuda")`` has run nvJPEG since 0.19, and the same call decodes on
the CPU for the tests; torchcodec is a native extension built per torch release, one more ABI
pairing to ship (the versions weighed: docs/decisions.md). The call sits in
``_decode_many`` alone: moving to ``torchcodec.decoders.decode_jpeg`` is that function.
pyproject pins ``torchvision<0.31`` so the removal cannot arrive unannounced; a torchvision
without ``decode_jpeg`` turns GPU decoding off with a warning, it never breaks the daemon.

**The security trade-off.** Everywhere else untrusted bytes are decoded only in sandboxed worker
processes (``RLIMIT_AS``, a kill after ``decode_timeout_s``, ``PR_SET_PDEATHSIG``): a decoder
crash costs one file. nvJPEG runs in the daemon (it needs the model's CUDA context), and its
Huffman stage runs on the host, so a crashing bug in it would take the daemon down with every
file in flight (they are recovered from disk at restart, and two crashes fail the file: see
``files/lifecycle.py``). To keep that surface small, only files that ``jpeg_header.inspect``
accepts in pure Python reach it: baseline/extended Huffman, 8-bit, 1 or 3 components,
usual subsampling, defined tables, an EOI after the scan, within ``max_image_pixels`` and a size
bound. Anything else, and any file nvJPEG rejects, goes to the sandboxed CPU path. To keep every
byte in the sandbox, set ``preprocess.gpu_decode: off``.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
from torchvision.transforms.v2 import functional as F

from inboxd import logs
from inboxd.decode.jpeg_header import JpegHeader
from inboxd.decode.spec import PreprocessSpec
from inboxd.item import DecodedImage
from inboxd.os_threads import name_this_thread

MODES = {"bicubic": F.InterpolationMode.BICUBIC, "bilinear": F.InterpolationMode.BILINEAR,
         # PIL's NEAREST samples pixel centres: torch's "nearest-exact", not "nearest".
         "nearest": F.InterpolationMode.NEAREST_EXACT}
# As decode/pillow.py: past this many times the resize target's square the CPU path resizes only
# the crop window (bounded memory); here such a strip simply takes the CPU path.
FULL_RESIZE_MAX_RATIO = 16


# Full-size RGB pixels one decode call may hold on the device (~200 MB: sixteen 12-MP photos);
# the crops that stay are counted by the preprocess cache's MB bound.
MAX_BATCH_PIXELS = 64_000_000


class DecodeFailed(Exception):
    """The device decoder refused this file: it takes the CPU path, which decides its outcome."""


def supported(spec: PreprocessSpec) -> str | None:
    """Why this decoder cannot serve ``spec`` here, or None."""
    if spec.interpolation not in MODES:
        return f"{spec.interpolation} interpolation has no torch equivalent"
    try:
        from torchvision.io import decode_jpeg  # noqa: F401
    except ImportError as exc:
        return f"this torchvision has no decode_jpeg ({exc})"
    return None


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


def orient(image: torch.Tensor, orientation: int) -> torch.Tensor:
    """A C×H×W image as Pillow's ``exif_transpose`` leaves it, for EXIF orientations 1-8."""
    if orientation == 2:
        return image.flip(-1)
    if orientation == 3:
        return image.flip(-1, -2)
    if orientation == 4:
        return image.flip(-2)
    if orientation == 5:  # PIL TRANSPOSE
        return image.transpose(-1, -2)
    if orientation == 6:  # PIL ROTATE_270: a quarter turn clockwise
        return image.rot90(-1, (-2, -1))
    if orientation == 7:  # PIL TRANSVERSE
        return image.transpose(-1, -2).flip(-1, -2)
    if orientation == 8:  # PIL ROTATE_90: a quarter turn anticlockwise
        return image.rot90(1, (-2, -1))
    return image


def resize_and_crop(image: torch.Tensor, spec: PreprocessSpec) -> torch.Tensor:
    """C×H×W uint8 → ``crop``×``crop``×3 uint8 (H×W×C, contiguous), as ``decode/pillow.py``;
    for a ``fit`` spec, the whole image within ``crop``² (``decode/pillow.py``'s resize_to_fit)."""
    height, width = image.shape[-2:]
    if spec.kind != "center_crop":
        return resize_to_fit(image, spec)
    new_w, new_h = resized_size(width, height, spec)
    mode = MODES[spec.interpolation]
    resized: torch.Tensor = F.resize(image, [new_h, new_w], interpolation=mode,
                                     antialias=mode != F.InterpolationMode.NEAREST_EXACT)
    left, top = round((new_w - spec.crop) / 2.0), round((new_h - spec.crop) / 2.0)
    crop = resized[:, top:top + spec.crop, left:left + spec.crop]
    return crop.permute(1, 2, 0).contiguous()


def resize_to_fit(image: torch.Tensor, spec: PreprocessSpec) -> torch.Tensor:
    height, width = image.shape[-2:]
    new_w, new_h = spec.output_size(int(width), int(height))
    if (new_w, new_h) != (width, height):
        mode = MODES[spec.interpolation]
        image = F.resize(image, [new_h, new_w], interpolation=mode,
                         antialias=mode != F.InterpolationMode.NEAREST_EXACT)
    return image.permute(1, 2, 0).contiguous()


def _decode_many(datas: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """The one call into the JPEG decoder (nvJPEG on CUDA, libjpeg-turbo on the CPU)."""
    from torchvision.io import ImageReadMode, decode_jpeg

    with warnings.catch_warnings():
        # torchvision 0.29's deprecation notice, once per call: the module docstring says why.
        warnings.simplefilter("ignore", DeprecationWarning)
        decoded = decode_jpeg(datas, mode=ImageReadMode.RGB, device=device)
    assert isinstance(decoded, list)
    return decoded


def decode_batch(datas: list[bytes], headers: list[JpegHeader], spec: PreprocessSpec,
                 device: torch.device) -> list[torch.Tensor | DecodeFailed]:
    """One crop (or the reason it failed) per file. The batch is decoded in one call; if that
    fails, each file is decoded alone, so one bad file fails only itself."""
    tensors = [torch.frombuffer(bytearray(data), dtype=torch.uint8) for data in datas]
    try:
        images: list[torch.Tensor | DecodeFailed] = list(_decode_many(tensors, device))
    except RuntimeError:
        images = []
        for tensor in tensors:
            try:
                images.extend(_decode_many([tensor], device))
            except RuntimeError as exc:
                images.append(DecodeFailed(str(exc).rsplit(", ", 1)[-1]))
    out: list[torch.Tensor | DecodeFailed] = []
    for image, header in zip(images, headers, strict=True):
        if isinstance(image, DecodeFailed):
            out.append(image)
        elif tuple(image.shape) != (3, header.height, header.width):
            out.append(DecodeFailed(f"decoded as {tuple(image.shape)}, the header said "
                                    f"{header.width}×{header.height}"))
        else:
            out.append(resize_and_crop(orient(image, header.orientation), spec))
    return out


@dataclass(slots=True)
class _Job:
    data: bytes
    header: JpegHeader
    done: Future[torch.Tensor]


def _pixels(job: _Job) -> int:
    return job.header.width * job.header.height


class TensorDecoder:
    """Decodes JPEGs on ``device`` in batches: callers (the preprocess threads) block in
    ``decode`` while one thread gathers what is waiting — up to ``max_batch`` files, or what
    came within ``gather_s`` — and decodes it together."""

    def __init__(self, spec: PreprocessSpec, device: torch.device, max_batch: int = 32,
                 gather_s: float = 0.002, max_batch_pixels: int = MAX_BATCH_PIXELS,
                 decode: Callable[..., list[torch.Tensor | DecodeFailed]] = decode_batch) -> None:
        self.spec, self.device, self.max_batch, self.gather_s = spec, device, max_batch, gather_s
        self._decode = decode
        self.max_batch_pixels = max_batch_pixels
        self._carried: _Job | None = None  # the first of the next batch, past the budget
        # A stream of its own (made by the first batch, on this thread), so decoding overlaps
        # the model's compute on the default stream.
        self._stream: Any = None
        self._lock = threading.Lock()
        self._closed = False
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="inboxd-tensor-decode",
                                        daemon=True)
        self._thread.start()
        self.batches = 0  # decode calls made (a test and the bench read the batching from it)
        self.decoded = 0

    def decode(self, data: bytes, header: JpegHeader, format_: str = "JPEG") -> DecodedImage:
        """The crop of one eligible JPEG, on the device; ``DecodeFailed`` if it cannot be."""
        job = _Job(data, header, Future())
        with self._lock:
            if self._closed:
                raise DecodeFailed("inboxd is shutting down")
            self._jobs.put(job)
        crop = job.done.result()
        width, height = header.oriented_size
        mode = "L" if header.components == 1 else "RGB"
        return DecodedImage.on_device(crop, width, height, format_, mode)

    def _on_stream(self) -> contextlib.AbstractContextManager[Any]:
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        return torch.cuda.stream(self._stream)

    def _gather(self, first: _Job) -> list[_Job]:
        """``first`` and what else is waiting, within ``max_batch`` files and
        ``max_batch_pixels`` decoded pixels (what the GPU holds at full size during the call);
        a file that would pass the budget opens the next batch."""
        jobs, pixels = [first], _pixels(first)
        while len(jobs) < self.max_batch:
            try:
                job = self._jobs.get(timeout=self.gather_s)
            except queue.Empty:
                break
            if job is None:
                self._jobs.put(None)  # close() again, after this batch
                break
            if pixels + _pixels(job) > self.max_batch_pixels:
                self._carried = job
                break
            jobs.append(job)
            pixels += _pixels(job)
        return jobs

    def _next(self) -> _Job | None:
        job, self._carried = self._carried, None
        return job if job is not None else self._jobs.get()

    def _run(self) -> None:
        name_this_thread()
        while (first := self._next()) is not None:
            jobs = self._gather(first)
            try:
                with self._on_stream():
                    results = self._decode([j.data for j in jobs], [j.header for j in jobs],
                                           self.spec, self.device)
                if self._stream is not None:
                    # The crops are used on the model's thread and streams: make them final
                    # here rather than make every consumer wait on this thread's stream (the
                    # consumer records its own stream on them: Model.to_device).
                    self._stream.synchronize()
            except Exception as exc:  # nothing here may kill the thread every caller waits on
                logs.emit(logging.WARNING, "tensor_decode", f"device decode failed for a "
                          f"batch of {len(jobs)}: {exc!r}; they take the CPU path", error=repr(exc))
                results = [DecodeFailed(repr(exc)) for _ in jobs]
            self.batches += 1
            self.decoded += len(jobs)
            for job, result in zip(jobs, results, strict=True):
                if isinstance(result, DecodeFailed):
                    job.done.set_exception(result)
                else:
                    job.done.set_result(result)
        with self._lock:  # closed: whoever still waits gets an answer, not a hang
            self._closed = True
            while True:
                try:
                    left = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if left is not None:
                    left.done.set_exception(DecodeFailed("inboxd is shutting down"))

    def close(self) -> None:
        self._jobs.put(None)
