"""Bytes → an RGB uint8 crop with Pillow: orientation, mode, resize and crop as torchvision does.

Images stay uint8 H×W×3 (a quarter of float32); normalisation happens on the model's device, in
one batched operation.
"""

from __future__ import annotations

import io
import warnings

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from inboxd.decode import formats  # noqa: F401  (registers the HEIF and JPEG XL openers)
from inboxd.decode.spec import PreprocessSpec
from inboxd.item import DecodedImage, PermanentError

# JPEG draft decoding stops at this many times the resize target (see decode_image): with
# 256, only photos whose shorter side is 4096 px or more decode at 1/2 scale.
DRAFT_MARGIN = 8
INTERPOLATIONS = {
    "bicubic": Image.Resampling.BICUBIC,
    "bilinear": Image.Resampling.BILINEAR,
    "nearest": Image.Resampling.NEAREST,
    "lanczos": Image.Resampling.LANCZOS,
}


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
                # Let libjpeg decode at 1/2, 1/4 or 1/8 scale, but only down to DRAFT_MARGIN ×
                # the resize target, so that the antialiased resize after it gives what
                # torchvision's Resize gives. Measured (bench/fidelity.py): drafting right
                # down to the target changed 13 of 36 top-5s (score diff 7e-2); 1/2 scale at
                # 12 MP, 5.9× the target, still moved scores by up to 8e-3.
                scale = min(1.0, DRAFT_MARGIN * spec.resize / min(width, height))
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
