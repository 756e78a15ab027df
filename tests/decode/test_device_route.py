"""Which file takes which decode path: eligible JPEGs the device path (here on the CPU), every
other file — progressive, CMYK, not a JPEG, truncated, refused by the device decoder — the
sandboxed workers, per file, with the outcome the CPU path has always given it."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from inboxd.decode import device_route
from inboxd.decode.device_route import DeviceRoute
from inboxd.decode.pool import DecodePool
from inboxd.decode.replies import DecodeResult
from inboxd.decode.spec import PreprocessSpec
from inboxd.decode.tensor import TensorDecoder
from inboxd.item import PermanentError
from PIL import Image

from support.photos import photo_jpeg
from tests.decode.test_pool import SPEC, settings
from tests.decode.test_tensor import bogus_huffman, cmyk_jpeg, jpeg_of

MAX_PIXELS = 89_478_485


@pytest.fixture(scope="module")
def pool() -> Iterator[DecodePool]:
    decode_pool = DecodePool(1, settings())
    decode_pool.start()
    yield decode_pool
    decode_pool.close()


@pytest.fixture
def route() -> Iterator[DeviceRoute]:
    decoder = TensorDecoder(SPEC, torch.device("cpu"), max_batch=4)
    yield DeviceRoute(decoder, SPEC, MAX_PIXELS, 256 << 20)
    decoder.close()


def decode(route: DeviceRoute, pool: DecodePool, path: Path,
           expected: str | None = None) -> DecodeResult:
    """What pipeline/preprocess.py does per file."""
    return route.decode(path, expected) or pool.decode(path, expected)


def test_each_file_takes_its_own_path(route: DeviceRoute, pool: DecodePool,
                                      tmp_path: Path) -> None:
    photo = photo_jpeg("chelsea", (320, 240), 3)
    png = io.BytesIO()
    Image.open(io.BytesIO(photo)).save(png, "PNG")
    files = {
        "good.jpg": (photo, "device"),
        "progressive.jpeg": (jpeg_of(Image.open(io.BytesIO(photo)), progressive=True), "cpu"),
        "cmyk.jpg": (cmyk_jpeg(), "cpu"),
        "png-named.jpg": (png.getvalue(), "cpu"),
        "real.png": (png.getvalue(), "cpu"),
        "truncated.jpg": (photo[: len(photo) // 2], "failed"),
        "bad-huffman.jfif": (bogus_huffman(photo), "failed"),
        "also-good.JPG": (photo_jpeg("coffee", (300, 400), 4), "device"),
    }
    for name, (data, expected_path) in files.items():
        (tmp_path / name).write_bytes(data)
        result = decode(route, pool, tmp_path / name)
        assert result.sha256 is not None and result.size_bytes == len(data), name
        if expected_path == "failed":
            assert isinstance(result.error, PermanentError), (name, result)
            continue
        assert result.error is None and result.image is not None, (name, result.error)
        on_device = result.image.device_pixels is not None
        assert on_device == (expected_path == "device"), name
        assert tuple(result.image.model_input.shape) == (224, 224, 3)
    assert route.device_decoded == 2
    assert route.cpu_fallbacks == 5  # every JPEG name that went to the workers after all


def test_a_duplicate_is_recognised_without_decoding(route: DeviceRoute, tmp_path: Path) -> None:
    path = tmp_path / "again.jpg"
    path.write_bytes(photo_jpeg("chelsea", (320, 240), 5))
    first = route.decode(path, None)
    assert first is not None and first.image is not None
    again = route.decode(path, first.sha256)
    assert again is not None and again.duplicate and again.image is None
    assert route.decoder.decoded == 1


def test_a_link_or_a_missing_file_gets_the_cpu_paths_words(route: DeviceRoute, pool: DecodePool,
                                                          tmp_path: Path) -> None:
    (tmp_path / "target.jpg").write_bytes(photo_jpeg("chelsea", (64, 48), 6))
    (tmp_path / "link.jpg").symlink_to(tmp_path / "target.jpg")
    result = decode(route, pool, tmp_path / "link.jpg")
    assert isinstance(result.error, PermanentError) and "link" in str(result.error)


def test_the_route_exists_only_for_a_gpu_with_gpu_decode_auto() -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    lanczos = PreprocessSpec(256, 224, "lanczos", (0.5,) * 3, (0.5,) * 3)
    assert device_route.build("auto", cpu, SPEC, MAX_PIXELS, 1 << 20, 4) is None
    assert device_route.build("off", cuda, SPEC, MAX_PIXELS, 1 << 20, 4) is None
    assert device_route.build("auto", cuda, lanczos, MAX_PIXELS, 1 << 20, 4) is None
    route = device_route.build("auto", cuda, SPEC, MAX_PIXELS, 1 << 20, 14)
    assert route is not None and route.decoder.max_batch == 14
    route.close()  # nothing was decoded: no CUDA call was made
