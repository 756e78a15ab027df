"""The ``fit`` input kind (detectors, OCR): the whole displayed photo scaled to fit a square,
aspect ratio kept, nothing cut, nothing padded, whatever its orientation, shape or size; the
same in a decode worker, on the device path, and counted by size in the preprocess cache."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path

import numpy as np
import pytest
import torch
from inboxd.decode import jpeg_header
from inboxd.decode.pillow import decode_image
from inboxd.decode.pool import DecodePool
from inboxd.decode.spec import PreprocessSpec, fit_size
from inboxd.decode.tensor import decode_batch
from inboxd.item import DecodedImage, WorkItem
from inboxd.pipeline.preprocess_cache import PreprocessCache
from PIL import Image, ImageOps

from tests.decode.test_pool import settings

MAX_PIXELS = 89_478_485
FIT = PreprocessSpec.fit(640, "bilinear", (0.0, 0.0, 0.0), (1.0, 1.0, 1.0))


def quadrants(width: int, height: int) -> Image.Image:
    """Four flat colours, one per quadrant: where each lands after a turn is unambiguous."""
    pixels = np.zeros((height, width, 3), dtype=np.uint8)
    pixels[: height // 2, : width // 2] = (255, 0, 0)
    pixels[: height // 2, width // 2:] = (0, 255, 0)
    pixels[height // 2:, : width // 2] = (0, 0, 255)
    pixels[height // 2:, width // 2:] = (255, 255, 0)
    return Image.fromarray(pixels)


def encoded(image: Image.Image, orientation: int = 1, fmt: str = "JPEG") -> bytes:
    out = io.BytesIO()
    exif = Image.Exif()
    exif[0x0112] = orientation
    image.save(out, format=fmt, exif=exif.tobytes(), **({"quality": 95} if fmt == "JPEG" else {}))
    return out.getvalue()


def corner_colours(pixels: np.ndarray) -> list[tuple[int, ...]]:
    h, w = pixels.shape[:2]
    points = [(h // 4, w // 4), (h // 4, 3 * w // 4), (3 * h // 4, w // 4),
              (3 * h // 4, 3 * w // 4)]
    return [tuple(round(int(v) / 255) for v in pixels[y, x]) for y, x in points]


@pytest.mark.parametrize("orientation", [1, 3, 6, 8])
def test_fit_keeps_the_displayed_photo_whole_for_each_orientation(orientation: int) -> None:
    """Stored 900×600 with an EXIF turn: the output is the displayed photo (turned), scaled to
    640 on its longer side, and the reported size is the displayed one."""
    stored = quadrants(900, 600)
    data = encoded(stored, orientation, "PNG")
    image = decode_image(data, FIT, MAX_PIXELS)
    displayed = ImageOps.exif_transpose(Image.open(io.BytesIO(data)))
    assert (image.width, image.height) == displayed.size
    turned = orientation in (6, 8)
    assert (image.width, image.height) == ((600, 900) if turned else (900, 600))
    assert image.pixels.shape == ((640, 427, 3) if turned else (427, 640, 3))
    assert corner_colours(image.pixels) == corner_colours(np.asarray(displayed))


@pytest.mark.parametrize(("size", "expected"), [
    ((1600, 900), (640, 360)),  # landscape
    ((900, 1600), (360, 640)),  # portrait
    ((17, 9), (640, 339)),  # tiny: scaled up, as Ultralytics' letterbox does
    ((8000, 6000), (640, 480)),  # huge: DCT-scaled, then resized
    ((4000, 10), (640, 2)),  # a strip: bounded by the square, not cropped
])
def test_fit_scales_the_longer_side_to_the_square(size: tuple[int, int],
                                                  expected: tuple[int, int]) -> None:
    data = encoded(quadrants(*size))
    image = decode_image(data, FIT, MAX_PIXELS)
    assert (image.width, image.height) == size
    assert image.pixels.shape == (expected[1], expected[0], 3)
    assert fit_size(*size, 640) == expected
    if min(expected) >= 8:
        assert corner_colours(image.pixels) == corner_colours(np.asarray(quadrants(*size)))


def test_a_large_jpeg_is_dct_scaled_within_the_margin_and_stays_close() -> None:
    """Drafting a 12-MP JPEG to a margin above 640 gives (nearly) the full decode's pixels."""
    rng = np.random.default_rng(3)
    smooth = Image.fromarray(rng.integers(0, 255, (30, 40, 3), dtype=np.uint8)).resize(
        (4000, 3000), Image.Resampling.BICUBIC)
    data = encoded(smooth)
    drafted = decode_image(data, PreprocessSpec.fit(640, "bilinear", (0, 0, 0), (1, 1, 1),
                                                    "fast"), MAX_PIXELS).pixels
    full = np.asarray(Image.open(io.BytesIO(data)).convert("RGB").resize(
        (640, 480), Image.Resampling.BILINEAR))
    assert drafted.shape == full.shape
    assert np.abs(drafted.astype(int) - full.astype(int)).mean() < 1.0


def test_the_device_path_fits_as_pillow_does() -> None:
    for orientation in (1, 6):
        data = encoded(quadrants(1200, 800), orientation)
        header = jpeg_header.inspect(data, MAX_PIXELS)
        [tensor] = decode_batch([data], [header], FIT, torch.device("cpu"))
        assert isinstance(tensor, torch.Tensor)
        expected = decode_image(data, FIT, MAX_PIXELS).pixels
        assert tuple(tensor.shape) == expected.shape
        diff = np.abs(tensor.numpy().astype(np.int16) - expected.astype(np.int16))
        assert diff.mean() < 1.5, f"orientation {orientation}: mean diff {diff.mean():.2f}"


def test_decode_workers_reply_with_fitted_images_of_any_shape(tmp_path: Path) -> None:
    pool = DecodePool(1, settings(FIT))
    try:
        for name, size in (("wide.jpg", (1000, 250)), ("tall.png", (300, 1200))):
            path = tmp_path / name
            path.write_bytes(encoded(quadrants(*size), fmt="PNG" if name.endswith("png")
                                     else "JPEG"))
            result = pool.decode(path)
            assert result.error is None and result.image is not None, result
            assert (result.image.width, result.image.height) == size
            w, h = fit_size(*size, 640)
            assert result.image.pixels.shape == (h, w, 3)
    finally:
        pool.close()


def test_a_reply_of_a_shape_the_spec_cannot_give_is_refused() -> None:
    assert FIT.accepts_shape((640, 2, 3)) and FIT.accepts_shape((427, 640, 3))
    assert not FIT.accepts_shape((641, 10, 3))  # larger than the square
    assert not FIT.accepts_shape((300, 300, 3))  # touches no side: not what fit makes
    crop = PreprocessSpec(256, 224, "bicubic", (0.5,) * 3, (0.5,) * 3)
    assert crop.accepts_shape((224, 224, 3)) and not crop.accepts_shape((224, 100, 3))


def test_the_preprocess_cache_counts_fitted_images_by_their_bytes() -> None:
    """Images of different sizes are bounded by their bytes, not their count."""
    async def scenario() -> tuple[int, bool]:
        cache = PreprocessCache(capacity=100, capacity_mb=1)
        for w, h in ((640, 100), (640, 300)):  # 192,000 + 576,000 bytes
            item = WorkItem(Path("/x"), f"{w}x{h}", f"{w}x{h}", f"/x/{w}x{h}")
            item.image = DecodedImage(np.zeros((h, w, 3), np.uint8), w, h, "PNG", "RGB")
            await cache.put(item)
        third = WorkItem(Path("/x"), "third", "third", "/x/third")
        third.image = DecodedImage(np.zeros((640, 640, 3), np.uint8), 640, 640, "PNG", "RGB")
        blocked = not cache._has_room(third.image.nbytes)
        return cache.size_bytes, blocked

    size_bytes, blocked = asyncio.run(scenario())
    assert size_bytes == 640 * 100 * 3 + 640 * 300 * 3
    assert blocked  # 1,228,800 more bytes would pass 1 MB
