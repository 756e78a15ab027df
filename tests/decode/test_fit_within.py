"""The ``fit_within`` input kind (OCR): as ``fit``, but a photo already inside the square keeps
its pixels (never enlarged), since OCR's detector sizes its own input from the photo's."""

from __future__ import annotations

import io

import numpy as np
from inboxd.decode.pillow import decode_image
from inboxd.decode.spec import PreprocessSpec
from PIL import Image

SPEC = PreprocessSpec(1000, 1000, "bilinear", (0.5,) * 3, (0.5,) * 3, kind="fit_within")


def png(width: int, height: int) -> bytes:
    rng = np.random.default_rng(width * height)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(out, "PNG")
    return out.getvalue()


def test_a_photo_inside_the_square_keeps_every_pixel() -> None:
    data = png(640, 200)
    decoded = decode_image(data, SPEC, 10**8)
    assert decoded.pixels.shape == (200, 640, 3)
    assert np.array_equal(decoded.pixels, np.asarray(Image.open(io.BytesIO(data))))
    assert SPEC.accepts_shape((200, 640, 3))


def test_a_larger_photo_is_fitted_and_its_displayed_size_kept() -> None:
    decoded = decode_image(png(3000, 600), SPEC, 10**8)
    assert decoded.pixels.shape == (200, 1000, 3)
    assert (decoded.width, decoded.height) == (3000, 600)
    assert not SPEC.accepts_shape((200, 1001, 3))
