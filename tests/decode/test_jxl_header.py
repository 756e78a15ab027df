"""The size a JPEG XL file declares, read before its plugin decodes anything: real files from
the encoder inboxd ships with, hand-made headers for what the encoder does not write, and
hostile bytes."""

from __future__ import annotations

import io
import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from inboxd.decode import jxl_header
from inboxd.decode.jxl_header import UnreadableHeader, declared_size
from inboxd.decode.pillow import decode_image
from inboxd.decode.pool import DecodePool
from inboxd.item import PermanentError
from PIL import Image

from tests.decode.test_formats import SPEC
from tests.decode.test_pool import settings

EXIF_ORIENTATION_1 = Image.Exif()
EXIF_ORIENTATION_1[0x0112] = 1


def jxl(width: int, height: int, container: bool = False) -> bytes:
    """A real JPEG XL from pillow-jxl-plugin: a bare codestream, or (with EXIF) a container."""
    data = io.BytesIO()
    extra = {"exif": EXIF_ORIENTATION_1.tobytes()} if container else {}
    Image.new("RGB", (width, height), (90, 40, 200)).save(data, "JXL", effort=1, **extra)
    return data.getvalue()


def size_header(width: int, height: int) -> bytes:
    """A codestream's signature and SizeHeader, written the long way (no ratio, no div8)."""
    bits = [0]  # not "small"
    for side in (height, width):
        selector = next(i for i, n in enumerate(jxl_header.U32_BITS) if side - 1 < 1 << n)
        bits += _bits(selector, 2) + _bits(side - 1, jxl_header.U32_BITS[selector])
        if side == height:
            bits += _bits(0, 3)  # ratio 0: the width follows
    value = sum(bit << i for i, bit in enumerate(bits))
    return jxl_header.CODESTREAM_SIGNATURE + value.to_bytes((len(bits) + 7) // 8, "little")


def _bits(value: int, count: int) -> list[int]:
    return [(value >> i) & 1 for i in range(count)]


def box(kind: bytes, content: bytes) -> bytes:
    return struct.pack(">I4s", 8 + len(content), kind) + content


def container(*boxes: bytes) -> bytes:
    file_type = box(b"ftyp", b"jxl \x00\x00\x00\x00jxl ")
    return jxl_header.CONTAINER_SIGNATURE + file_type + b"".join(boxes)


@pytest.mark.parametrize("size", [(1, 1), (64, 64), (7, 300), (257, 1000), (1000, 1200),
                                  (8, 4096), (1200, 1000), (400, 300), (600, 400), (1600, 900),
                                  (500, 400), (640, 320)])
@pytest.mark.parametrize("as_container", [False, True])
def test_the_size_of_a_real_file_is_read_from_its_header(size: tuple[int, int],
                                                         as_container: bool) -> None:
    """Sizes that take each way of writing a side the encoder uses (a multiple of 8 up to 256,
    9 and 13 bits) and every ratio (1:1, 12:10, 4:3, 3:2, 16:9, 5:4, 2:1), bare and in a
    container."""
    data = jxl(*size, container=as_container)
    assert data.startswith(jxl_header.CONTAINER_SIGNATURE if as_container
                           else jxl_header.CODESTREAM_SIGNATURE)
    assert declared_size(io.BytesIO(data)) == size
    assert Image.open(io.BytesIO(data)).size == size, "what the plugin says too"


@pytest.mark.parametrize("size", [(300_000, 2), (2, 1 << 30), (262_145, 262_144)])
def test_a_side_past_18_bits_is_read(size: tuple[int, int]) -> None:
    assert declared_size(io.BytesIO(size_header(*size))) == size


def test_a_codestream_split_over_jxlp_boxes_with_a_box_between_them_is_read() -> None:
    codestream = size_header(70_000, 50_000) + b"\x00" * 20
    data = container(box(b"Exif", b"\x00" * 4000),
                     box(b"jxlp", b"\x00\x00\x00\x00" + codestream[:3]),
                     box(b"xml ", b"<x/>"),
                     box(b"jxlp", b"\x80\x00\x00\x01" + codestream[3:]))
    assert declared_size(io.BytesIO(data)) == (70_000, 50_000)


def test_a_codestream_box_with_a_64_bit_size_or_running_to_the_end_is_read() -> None:
    codestream = size_header(5000, 4000)
    large = struct.pack(">I4sQ", 1, b"jxlc", 16 + len(codestream)) + codestream
    assert declared_size(io.BytesIO(container(large))) == (5000, 4000)
    to_the_end = struct.pack(">I4s", 0, b"jxlc") + codestream
    assert declared_size(io.BytesIO(container(to_the_end))) == (5000, 4000)


def test_a_size_header_is_never_read_past_its_codestream_box() -> None:
    """A jxlc box of 4 bytes holds a SizeHeader only in part; the box after it, whose bytes
    would complete the header, is not the codestream's."""
    header = size_header(5000, 4000)
    data = container(box(b"jxlc", header[:4]), box(b"Exif", header[4:]))
    with pytest.raises(UnreadableHeader, match="cut short"):
        declared_size(io.BytesIO(data))


def hostile() -> Iterator[bytes]:
    real = jxl(200, 100, container=True)
    for cut in range(len(real) if len(real) < 400 else 400):
        yield real[:cut]
    yield container(box(b"Exif", b"x"))  # no codestream box
    yield container(struct.pack(">I4s", 0, b"Exif") + b"x" * 50)  # runs to the end
    yield container(struct.pack(">I4s", 4, b"jxlc"))  # smaller than its header
    yield container(struct.pack(">I4s", 0xFFFFFFFF, b"Exif"))  # past the end
    yield container(struct.pack(">I4sQ", 1, b"Exif", (1 << 64) - 1))  # past any seek
    yield container(box(b"jxlp", b"\x00\x00"))  # no room for its part number
    yield container(box(b"jxlc", b"\x00\x01\x02\x03"))  # not a codestream
    too_many = [box(b"free", b"")] * (jxl_header.MAX_BOXES + 1)
    yield container(*too_many, box(b"jxlc", size_header(8, 8)))
    yield jxl_header.CODESTREAM_SIGNATURE  # nothing after the signature
    rng = np.random.default_rng(11)
    for _ in range(500):
        yield jxl_header.CONTAINER_SIGNATURE + rng.bytes(int(rng.integers(0, 64)))
        yield jxl_header.CODESTREAM_SIGNATURE + rng.bytes(int(rng.integers(0, 12)))


def test_hostile_bytes_end_as_a_size_or_unreadable_never_anything_else() -> None:
    unreadable = 0
    for data in hostile():
        try:
            width, height = declared_size(io.BytesIO(data))
        except UnreadableHeader:
            unreadable += 1
        else:
            assert width >= 1 and height >= 1
    assert unreadable > 400


def test_a_declared_bomb_is_refused_before_the_plugin_decodes_a_byte() -> None:
    """A header that declares 30,000 × 30,000 and garbage after it: were the plugin handed it,
    it would fail on the garbage (a RuntimeError) after allocating for the size."""
    bomb = size_header(30_000, 30_000) + b"\x5a" * 200
    with pytest.raises(PermanentError, match=r"30000×30000 = 900000000 pixels, more than "
                                             r"preprocess.max_image_pixels"):
        decode_image(bomb, SPEC, 89_478_485)
    with pytest.raises(PermanentError, match="corrupt or truncated JPEG XL image"):
        decode_image(jxl_header.CONTAINER_SIGNATURE + box(b"Exif", b"x"), SPEC, 10**6)


def test_a_real_jpeg_xl_past_the_pixel_limit_fails_alone_in_a_worker(tmp_path: Path) -> None:
    """Through a real decode worker (limit lowered to 1 MP): refused by the size in its header,
    where before its plugin decoded it whole and Pillow refused it afterwards."""
    pool = DecodePool(1, settings(max_image_pixels=1_000_000))
    try:
        (tmp_path / "big.jxl").write_bytes(jxl(1200, 1000))
        refused = pool.decode(tmp_path / "big.jxl")
        assert isinstance(refused.error, PermanentError)
        assert "1200×1000 = 1200000 pixels, more than" in str(refused.error)
        (tmp_path / "fits.jxl").write_bytes(jxl(1000, 1000))
        assert pool.decode(tmp_path / "fits.jxl").error is None
    finally:
        pool.close()
