"""Bytes → an RGB uint8 image with Pillow: orientation, mode, then resize and crop as torchvision
does (``center_crop``), or a resize that fits the whole photo in a square (``fit``).

``spec.resize_mode`` (``preprocess.resize``) picks one of ``RESIZINGS``: ``exact`` gives
torchvision's pixels; ``fast`` lets libjpeg decode a large JPEG at 1/2-1/8 scale and resizes
every format in two steps, within the fidelity contract ``bench/fidelity.py`` measures. Either
way the pixel bound is checked on the declared size before anything is decoded.

Images stay uint8 H×W×3 (a quarter of float32); normalisation happens on the model's device, in
one batched operation. Memory per file is bounded by the decoded size (``max_image_pixels``)
whatever the aspect ratio: beyond ``FULL_RESIZE_MAX_RATIO`` only the crop is resized, so a 1×40000
strip no longer becomes a 256×10,240,000 intermediate image.

In the daemon this runs in a decode worker process (``decode/worker_child.py``); the exceptions it
does not map to ``PermanentError`` are mapped there.
"""

from __future__ import annotations

import functools
import io
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from inboxd.decode import formats, jxl_header  # (formats registers the HEIF and JXL openers)
from inboxd.decode.spec import PreprocessSpec
from inboxd.item import DecodedImage, PermanentError, TooLargeError


@dataclass(frozen=True, slots=True)
class Resizing:
    """How a decoded image gets to the resize target: JPEG DCT scaling down to no less than
    ``draft_margin`` × the target's shorter side, then Pillow's resize, which with
    ``reducing_gap`` first box-reduces by an integer factor down to that many times the
    output size (Pillow's ``Image.resize(reducing_gap=)``), None: one full-support resample.
    ``crop_window``: resize only the pixels the center crop keeps (``resize(box=)``), not the
    whole frame: the same samples to rounding, for the crop's share of the work."""

    draft_margin: float
    reducing_gap: float | None
    crop_window: bool = False


# exact: the old behaviour, torchvision's pixels (with 256, only photos whose shorter side is
# 4096 px or more decode at 1/2 scale, which tests/decode/test_fidelity.py holds to 2e-3).
# fast: the margin and gap bench/fidelity.py measured to keep the contract on the corpus, real
# photos included (tests/decode/test_fast_fidelity.py). A gap of 2 box-reduces a 12-MP photo's
# half-scale crop window by 2 before the bicubic pass (a gap of 3 did not reduce it at all);
# drafting to 2× the target keeps the contract too, but by one real photo: not a default.
RESIZINGS: dict[str, Resizing] = {
    "exact": Resizing(draft_margin=8, reducing_gap=None),
    "fast": Resizing(draft_margin=4, reducing_gap=2.0, crop_window=True),
    # Opt-in (preprocess.resize: fastest): DCT scaling right down to the target.
    "fastest": Resizing(draft_margin=1, reducing_gap=3.0, crop_window=True),
}
INTERPOLATIONS = {
    "bicubic": Image.Resampling.BICUBIC,
    "bilinear": Image.Resampling.BILINEAR,
    "nearest": Image.Resampling.NEAREST,
    "lanczos": Image.Resampling.LANCZOS,
}
# Up to this many times the resize target's square, the whole image is resized, then cropped
# (bit-for-bit what torchvision does); beyond it (an aspect ratio past 16:1, no photo) only the
# crop window is resized, which is the same to rounding and bounded in memory.
FULL_RESIZE_MAX_RATIO = 16


@functools.cache
def open_formats() -> tuple[str, ...]:
    """The Pillow plugins a file may be opened with: only the formats inboxd takes, JPEG first.
    Left to itself ``Image.open`` tries every plugin it has, in its own order, on bytes that
    came from anyone: IM and IPTC parsed each JPEG before the JPEG plugin did (a third of the
    decode worker's time on small photos), and EPS would hand a file to Ghostscript."""
    return tuple(fmt.pillow for fmt in formats.decodable())


@functools.cache
def _taken_names() -> str:
    return ", ".join(fmt.name for fmt in formats.decodable())


def decode_image(data: bytes | BinaryIO, spec: PreprocessSpec, max_pixels: int,
                 others: Sequence[PreprocessSpec] = ()) -> DecodedImage:
    """Bytes (or a file open at its start) → RGB uint8 image, the way the model was trained to
    see it: a crop of ``spec.crop``², or (``fit``) the whole photo within ``spec.crop``²
    (``spec.resize_mode`` says how exactly). The image's width and height are the displayed
    photo's (EXIF applied), so that geometry found in the pixels can be mapped back to it."""
    return decode_resized(data, spec, max_pixels, RESIZINGS[spec.resize_mode], others)


def decode_resized(data: bytes | BinaryIO, spec: PreprocessSpec, max_pixels: int,
                   resizing: Resizing, others: Sequence[PreprocessSpec] = ()) -> DecodedImage:
    """``decode_image`` with the resizing given (the benchmark and the fidelity test compare
    others). ``others``: further specs (other tasks') made from the same decode, which is
    drafted for the one that needs the most pixels."""
    source = io.BytesIO(data) if isinstance(data, bytes) else data
    prefix = source.read(len(jxl_header.CONTAINER_SIGNATURE))
    if prefix == b"":
        raise PermanentError("empty file: 0 bytes")
    source.seek(0)
    is_jxl = jxl_header.is_jxl(prefix)
    if is_jxl:  # its plugin decodes it all in Image.open: check the size first
        try:
            _check_pixels(*jxl_header.declared_size(source), max_pixels)
        except jxl_header.UnreadableHeader as exc:
            raise PermanentError(f"corrupt or truncated JPEG XL image: {exc}") from exc
        source.seek(0)
    try:
        with warnings.catch_warnings():
            # Pillow only warns between MAX_IMAGE_PIXELS and twice that: make both an error.
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            opened = Image.open(source, formats=open_formats())
            width, height = opened.size
            _check_pixels(width, height, max_pixels)
            source_format, source_mode = opened.format, opened.mode
            if opened.format == "JPEG":
                # Let libjpeg decode at 1/2, 1/4 or 1/8 scale, but only down to a margin above
                # the resize target, so that the antialiased resize after it still sees enough
                # pixels: drafting right down to the target (DCT scaling in place of the
                # antialiased resize) moves scores past the contract (docs/decisions.md).
                scale = max(s.draft_scale(width, height, resizing.draft_margin)
                            for s in (spec, *others))
                opened.draft("RGB", (max(1, round(width * scale)), max(1, round(height * scale))))
            opened.load()
            # In place: a copy of every unrotated image would double the peak for nothing.
            ImageOps.exif_transpose(opened, in_place=True)
            image = to_rgb(opened)
            oriented_w, oriented_h = _oriented_size(width, height, image)
            pixels = resized(image, spec, resizing.reducing_gap, resizing.crop_window)
            more = tuple(resized(image, other, resizing.reducing_gap, resizing.crop_window)
                         for other in others)
    except PermanentError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise TooLargeError(f"decompression bomb refused: {exc}; the limit is "
                            f"preprocess.max_image_pixels = {max_pixels} (raise it in the "
                            "config if such images are real photos)") from exc
    except UnidentifiedImageError as exc:
        raise PermanentError(f"not an image Pillow can read in a format inboxd takes "
                             f"({_taken_names()}), or corrupt") from exc
    except OSError as exc:
        if exc.errno is not None:
            raise  # the disk, not the bytes (EIO while reading): the caller classifies it
        raise PermanentError(f"corrupt or truncated image: {exc}") from exc
    except (ValueError, SyntaxError, EOFError) as exc:
        # Pillow reports truncated and corrupt data as OSError/ValueError/SyntaxError.
        raise PermanentError(f"corrupt or truncated image: {exc}") from exc
    except RuntimeError as exc:
        # pillow-jxl-plugin says the same of every JPEG XL file it cannot decode: "Generic
        # Error. Please build `libjxl` from source ... in debug mode": advice for its
        # developers, not for whoever reads the file's .error.json. (Any other decoder's
        # RuntimeError is reported with its own words by the decode worker.)
        if not is_jxl:
            raise
        raise PermanentError("the JPEG XL decoder could not decode this image: corrupt or "
                             "truncated, or it needs more memory than "
                             "preprocess.decode_memory_mb allows") from exc
    return DecodedImage(pixels, oriented_w, oriented_h, source_format, source_mode,
                        others=more)


def resized(image: Image.Image, spec: PreprocessSpec, reducing_gap: float | None,
            crop_window: bool = False) -> np.ndarray:
    if spec.kind == "center_crop":
        return resize_and_crop(image, spec, reducing_gap, crop_window)
    return resize_to_fit(image, spec, reducing_gap)


def _check_pixels(width: int, height: int, max_pixels: int) -> None:
    if width * height > max_pixels:
        raise TooLargeError(
            f"image is {width}×{height} = {width * height} pixels, more than "
            f"preprocess.max_image_pixels = {max_pixels} (a decompression bomb? raise that key "
            "in the config if such images are real photos)"
        )


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
        rgba = image if image.mode == "RGBA" else image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def resize_and_crop(image: Image.Image, spec: PreprocessSpec,
                    reducing_gap: float | None = None, crop_window: bool = False) -> np.ndarray:
    """torchvision's Resize(int) then CenterCrop (with ``reducing_gap``: Pillow's two-step
    resize, a box reduce by an integer factor first, then the filter over fewer pixels).

    For extreme aspect ratios only the pixels the crop keeps are computed: Pillow's
    ``resize(box=...)`` samples the source with the same scale and filter support as a full
    resize (it reads the pixels around the box too), so the crop is the same to float rounding
    (measured: ≤ 1 in 10⁴ pixels off by one on photos) — without allocating the resized image,
    which for a strip is unbounded (1×8000 → 256×2,048,000, 1.5 GB). ``crop_window`` takes
    that path for every image (the fast resize: a 4:3 photo's crop is 4/7 of its resized frame).
    """
    width, height = image.size
    # torchvision's Resize(int) arithmetic, so results match models trained with it.
    if width <= height:
        new_w, new_h = spec.resize, int(spec.resize * height / width)
    else:
        new_w, new_h = int(spec.resize * width / height), spec.resize
    left = round((new_w - spec.crop) / 2.0)
    top = round((new_h - spec.crop) / 2.0)
    interpolation = INTERPOLATIONS[spec.interpolation]
    if not crop_window and new_w * new_h <= FULL_RESIZE_MAX_RATIO * spec.resize**2:
        resized = image.resize((new_w, new_h), interpolation, reducing_gap=reducing_gap)
        cropped = resized.crop((left, top, left + spec.crop, top + spec.crop))
        return np.asarray(cropped, dtype=np.uint8)
    # The crop window in resized coordinates, clipped to the resized image: a crop larger than
    # the resized image is padded with black, as PIL's crop() and torchvision's CenterCrop do.
    x0, y0 = max(left, 0), max(top, 0)
    x1, y1 = min(left + spec.crop, new_w), min(top + spec.crop, new_h)
    scale_x, scale_y = width / new_w, height / new_h
    box = (x0 * scale_x, y0 * scale_y, x1 * scale_x, y1 * scale_y)
    window = image.resize((x1 - x0, y1 - y0), interpolation, box=box,
                          reducing_gap=reducing_gap)
    if (x0, y0, x1, y1) == (left, top, left + spec.crop, top + spec.crop):
        return np.asarray(window, dtype=np.uint8)
    canvas = Image.new("RGB", (spec.crop, spec.crop))
    canvas.paste(window, (x0 - left, y0 - top))
    return np.asarray(canvas, dtype=np.uint8)


def resize_to_fit(image: Image.Image, spec: PreprocessSpec,
                  reducing_gap: float | None = None) -> np.ndarray:
    """The whole image scaled to fit ``spec.crop``² (``decode.spec.fit_size``): no crop, no padding,
    so its memory is bounded by the square whatever the aspect ratio."""
    size = spec.output_size(*image.size)
    if size == image.size:
        return np.asarray(image, dtype=np.uint8)
    resized = image.resize(size, INTERPOLATIONS[spec.interpolation], reducing_gap=reducing_gap)
    return np.asarray(resized, dtype=np.uint8)
