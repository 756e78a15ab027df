"""What this build decodes, said by `inboxd check-config`."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from inboxd.decode import formats
from inboxd.decode.pillow import decode_image
from inboxd.decode.spec import PreprocessSpec
from inboxd.item import PermanentError
from PIL import Image

from tests.conftest import write_config

ORIENTATION = 0x0112
SPEC = PreprocessSpec(resize=16, crop=16, interpolation="bilinear", mean=(0.5,) * 3,
                      std=(0.5,) * 3)


@pytest.mark.daemon
def test_check_config_lists_what_this_build_decodes(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "inboxd", "check-config", "-c",
                          str(write_config(tmp_path))], capture_output=True, text=True,
                         check=True).stdout
    assert "formats this build decodes" in out
    for fmt in formats.decodable():
        assert f"{fmt.name}: {' '.join(fmt.extensions)}" in out
    assert "*.heic" in out and "*.jfif" in out


@pytest.mark.parametrize("fmt", ["JPEG", "HEIF", "AVIF", "JXL", "WEBP", "PNG", "TIFF"])
def test_a_phone_photo_taken_sideways_is_upright_once_in_every_format(fmt: str) -> None:
    """EXIF orientation 6 (rotate 90°): pillow-heif applies it itself and resets the tag,
    Pillow's other plugins leave it to exif_transpose; either way it is applied exactly once."""
    image = Image.new("RGB", (64, 32), (200, 30, 30))
    exif = Image.Exif()
    exif[ORIENTATION] = 6
    data = io.BytesIO()
    image.save(data, format=fmt, exif=exif.tobytes())
    decoded = decode_image(data.getvalue(), SPEC, 1_000_000)
    assert (decoded.width, decoded.height) == (32, 64), fmt


@pytest.mark.parametrize("fmt", ["PCX", "SGI", "IM", "TGA", "PPM"])
def test_a_format_inboxd_does_not_take_is_refused_whatever_its_name(fmt: str) -> None:
    """Pillow alone would open any of its dozens of formats, whatever the name says (and
    hand an EPS to Ghostscript): only the listed ones are parsed."""
    data = io.BytesIO()
    Image.new("RGB", (8, 8), (1, 2, 3)).save(data, fmt)
    with pytest.raises(PermanentError, match="in a format inboxd takes"):
        decode_image(data.getvalue(), SPEC, 10**6)


def test_a_listed_format_under_another_listed_name_still_decodes() -> None:
    data = io.BytesIO()
    Image.new("RGB", (8, 8), (1, 2, 3)).save(data, "PNG")  # as if named photo.jpg
    assert decode_image(data.getvalue(), SPEC, 10**6).format == "PNG"


def test_a_broken_jpeg_xl_is_refused_in_words_for_its_user() -> None:
    """pillow-jxl-plugin raises RuntimeError("Generic Error. Please build `libjxl` from source
    ...") for any JPEG XL it cannot decode; the file's reason says what is wrong with it."""
    noise = np.random.default_rng(3).integers(0, 256, (150, 200, 3), dtype=np.uint8)
    data = io.BytesIO()
    Image.fromarray(noise).save(data, "JXL")
    whole = data.getvalue()
    assert decode_image(whole, SPEC, 10**6).format == "JXL"
    for cut in (len(whole) // 2, 40):
        with pytest.raises(PermanentError, match="corrupt or truncated") as refused:
            decode_image(whole[:cut], SPEC, 10**6)
        assert "JPEG XL" in str(refused.value) and "libjxl" not in str(refused.value)


def test_a_jpeg_xl_is_decoded_on_one_core() -> None:
    """A decode worker takes one file at a time and there are as many workers as cores; the
    JPEG XL plugin would otherwise start a thread per core for each file."""
    noise = np.random.default_rng(5).integers(0, 256, (2000, 2000, 3), dtype=np.uint8)
    data = io.BytesIO()
    Image.fromarray(noise).save(data, "JXL", effort=1)
    threads_seen: list[int] = []
    decoding = threading.Event()

    def count_threads() -> None:
        while not decoding.is_set():
            time.sleep(0.0005)
        while decoding.is_set():
            threads_seen.append(len(os.listdir("/proc/self/task")))
            time.sleep(0.0005)

    sampler = threading.Thread(target=count_threads)
    sampler.start()
    before = len(os.listdir("/proc/self/task"))
    decoding.set()
    try:
        decode_image(data.getvalue(), SPEC, 10**7)
    finally:
        decoding.clear()
        sampler.join()
    assert threads_seen and max(threads_seen) <= before + 1, (before, max(threads_seen))


def test_a_refused_giant_image_names_the_key_that_raises_the_limit() -> None:
    """The first hour: a photo refused for its size says which key lets it through."""
    from inboxd.item import TooLargeError

    data = io.BytesIO()
    Image.new("RGB", (400, 300)).save(data, format="PNG")
    spec = PreprocessSpec(resize=32, crop=32, interpolation="bilinear", mean=(0.5,) * 3,
                          std=(0.5,) * 3)
    with pytest.raises(TooLargeError) as refused:
        decode_image(data.getvalue(), spec, max_pixels=10_000)
    assert "preprocess.max_image_pixels = 10000" in str(refused.value)
    assert "raise that key in the config" in str(refused.value)
