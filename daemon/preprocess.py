"""Stage 3: queue → decode, rotate, resize, crop (in a thread pool) → preprocess cache.

Decoding is CPU work that releases the GIL inside Pillow, so ``preprocess.workers`` threads run
it in parallel while the event loop stays free. Each worker holds at most one file, so the memory
in this stage is bounded by ``workers`` × the largest image allowed (``max_image_pixels``).
Images stay uint8 H×W×3 here (a quarter of float32); normalisation happens on the model's
device, in one batched operation.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import io
import logging
import os
import stat
import time
import warnings
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from daemon import logs
from daemon.item import DecodedImage, PermanentError, TransientError, WorkItem
from daemon.pipeline_queue import PipelineQueue
from daemon.preprocess_cache import PreprocessCache

# Errors reading a file that a later attempt may not see (it is being replaced, the disk
# hiccuped, permissions are being fixed); anything else about the bytes is permanent.
TRANSIENT_READ_ERRNOS = {errno.EACCES, errno.EPERM, errno.EIO, errno.EAGAIN, errno.EBUSY,
                         errno.ENOENT, errno.ESTALE, errno.ETIMEDOUT}
INTERPOLATIONS = {
    "bicubic": Image.Resampling.BICUBIC,
    "bilinear": Image.Resampling.BILINEAR,
    "nearest": Image.Resampling.NEAREST,
    "lanczos": Image.Resampling.LANCZOS,
}


@dataclass(frozen=True, slots=True)
class PreprocessSpec:
    """How a model wants its input: resize the shorter side, then center-crop a square."""

    resize: int
    crop: int
    interpolation: str
    mean: tuple[float, float, float]
    std: tuple[float, float, float]


def read_and_hash(path: os.PathLike[str] | str) -> tuple[bytes, str]:
    """The file's bytes and their sha256. Links are not followed and only regular files are
    read (a FIFO opened for reading would block a worker for ever)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise PermanentError("refused: a symbolic link; links are never followed") from exc
        if exc.errno in TRANSIENT_READ_ERRNOS:
            raise TransientError(f"cannot open the file: {exc.strerror}") from exc
        raise PermanentError(f"cannot open the file: {exc.strerror}") from exc
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise PermanentError("not a regular file: only regular files are read")
        try:
            data = handle.read()
        except OSError as exc:
            raise TransientError(f"cannot read the file: {exc.strerror}") from exc
    return data, hashlib.sha256(data).hexdigest()


def decode_image(data: bytes, spec: PreprocessSpec, max_pixels: int) -> DecodedImage:
    """Bytes → RGB uint8 crop of ``spec.crop``², the way the model was trained to see it."""
    if not data:
        raise PermanentError("empty file: 0 bytes")
    try:
        with warnings.catch_warnings():
            # Pillow only warns between MAX_IMAGE_PIXELS and twice that: make both an error.
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            opened = Image.open(io.BytesIO(data))
            width, height = opened.size
            if width * height > max_pixels:
                raise PermanentError(
                    f"image is {width}×{height} = {width * height} pixels, more than "
                    f"preprocess.max_image_pixels = {max_pixels} (a decompression bomb?)"
                )
            source_format, source_mode = opened.format, opened.mode
            if opened.format == "JPEG":
                # Let libjpeg decode at 1/2, 1/4 or 1/8 scale when that still covers the
                # resize target: a 12-MP photo decodes ~10× faster.
                scale = spec.resize / min(width, height)
                opened.draft("RGB", (max(1, round(width * scale)), max(1, round(height * scale))))
            opened.load()
            image = to_rgb(ImageOps.exif_transpose(opened))
            oriented_w, oriented_h = _oriented_size(width, height, image)
            pixels = resize_and_crop(image, spec)
    except PermanentError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise PermanentError(f"decompression bomb refused: {exc}") from exc
    except UnidentifiedImageError as exc:
        raise PermanentError("not an image Pillow can read (unknown or corrupt format)") from exc
    except (OSError, ValueError, SyntaxError, EOFError) as exc:
        # Pillow reports truncated and corrupt data as OSError/ValueError/SyntaxError.
        raise PermanentError(f"corrupt or truncated image: {exc}") from exc
    return DecodedImage(pixels, oriented_w, oriented_h, source_format, source_mode)


def _oriented_size(width: int, height: int, image: Image.Image) -> tuple[int, int]:
    """The source size after EXIF rotation (draft() may have shrunk the decoded image)."""
    if (image.width > image.height) != (width > height) and width != height:
        return height, width
    return width, height


def to_rgb(image: Image.Image) -> Image.Image:
    if image.mode == "RGB":
        return image
    if image.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I", "F"):
        # 16/32-bit greyscale: Pillow's convert() clips instead of scaling; scale to 8 bits.
        values = np.asarray(image, dtype=np.float64)
        low, high = float(values.min()), float(values.max())
        scaled = (values - low) * (255.0 / (high - low)) if high > low else values * 0
        image = Image.fromarray(scaled.astype(np.uint8), mode="L")
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        # Transparent pixels over white, not whatever colour happens to sit under alpha 0.
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def resize_and_crop(image: Image.Image, spec: PreprocessSpec) -> np.ndarray:
    width, height = image.size
    # torchvision's Resize(int) arithmetic, so results match models trained with it.
    if width <= height:
        new_w, new_h = spec.resize, int(spec.resize * height / width)
    else:
        new_w, new_h = int(spec.resize * width / height), spec.resize
    resized = image.resize((new_w, new_h), INTERPOLATIONS[spec.interpolation])
    left = round((new_w - spec.crop) / 2.0)
    top = round((new_h - spec.crop) / 2.0)
    cropped = resized.crop((left, top, left + spec.crop, top + spec.crop))
    return np.asarray(cropped, dtype=np.uint8)


Outcome = Callable[[WorkItem, BaseException], Awaitable[None]]


class Preprocessor:
    name = "preprocess"

    def __init__(
        self,
        queue: PipelineQueue,
        cache: PreprocessCache,
        spec: PreprocessSpec,
        max_pixels: int,
        workers: int,
        on_error: Outcome,
        existing_sha256: Callable[[str], str | None],
        on_duplicate: Callable[[WorkItem], Awaitable[None]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.queue = queue
        self.cache = cache
        self.spec = spec
        self.max_pixels = max_pixels
        self.workers = workers
        self.on_error = on_error
        self.existing_sha256 = existing_sha256
        self.on_duplicate = on_duplicate
        self.clock = clock
        self.executor = ThreadPoolExecutor(workers, thread_name_prefix="inboxd-preprocess")
        self.in_progress = 0
        Image.MAX_IMAGE_PIXELS = max_pixels

    async def run_worker(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            item = await self.queue.get()
            self.in_progress += 1
            try:
                item.dequeued_s = self.clock()
                try:
                    duplicate = await loop.run_in_executor(self.executor, self._prepare, item)
                except (PermanentError, TransientError) as exc:
                    await self.on_error(item, exc)
                    continue
                if duplicate:
                    await self.on_duplicate(item)
                    continue
                item.preprocessed_s = self.clock()
                await self.cache.put(item)
            finally:
                self.in_progress -= 1
                self.queue.task_done()

    def _prepare(self, item: WorkItem) -> bool:
        """Read, hash and decode one file; True when its result already exists (a rerun after
        a crash between the result and the move, or the same file dropped twice)."""
        data, item.sha256 = read_and_hash(item.claimed_path)
        item.size_bytes = len(data)
        if self.existing_sha256(item.key) == item.sha256:
            return True
        image = item.image = decode_image(data, self.spec, self.max_pixels)
        item.image_info = {"width": image.width, "height": image.height,
                           "format": image.format, "mode": image.mode}
        logs.emit(logging.DEBUG, "preprocessed", f"preprocessed {item.key}", path=item.key,
                  bytes=item.size_bytes)
        return False

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
