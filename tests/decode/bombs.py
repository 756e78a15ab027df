"""Hostile inputs that cost memory or time, not correctness: the bombs of issue 10."""

from __future__ import annotations

import io
import struct
import zlib
from pathlib import Path

from PIL import Image


def png_strip(width: int, height: int) -> bytes:
    """A real, valid greyscale PNG of ``width``×``height`` (a 1×8000 one is ~100 bytes)."""
    raw = b"".join(b"\x00" + b"\x80" * width for _ in range(height))  # filter byte + pixels
    def chunk(kind: bytes, body: bytes) -> bytes:
        return (struct.pack(">I", len(body)) + kind + body
                + struct.pack(">I", zlib.crc32(kind + body)))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr)
            + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def jpeg_bytes(size: tuple[int, int] = (64, 48), **options: object) -> bytes:
    data = io.BytesIO()
    Image.effect_noise(size, 40).convert("RGB").save(data, "JPEG", **options)
    return data.getvalue()


def sparse_file(path: Path, head: bytes, size_bytes: int) -> Path:
    """``head`` followed by a hole up to ``size_bytes``: gigabytes that cost no disk."""
    with open(path, "wb") as out:
        out.write(head)
        out.truncate(size_bytes)
    return path


def progressive_scan_bomb(repeats: int = 10_000) -> bytes:
    """A flat 4000×3000 progressive JPEG whose last scan (26 bytes: all end-of-band runs) is
    repeated ``repeats`` times: one more pass over 12 MP per repeat, even with draft().
    Measured for 1,000 repeats (~100 KB): 31 s on this project's machine on 12-01, 5.7 s on
    12-02's; 10,000 (~330 KB) outlast any decode timeout a test sets by far on either."""
    data = io.BytesIO()
    Image.new("RGB", (4000, 3000), (128, 128, 128)).save(data, "JPEG", progressive=True,
                                                          quality=90)
    jpeg = data.getvalue()
    last_scan = jpeg[jpeg.rindex(b"\xff\xda"):-2]  # its SOS marker up to the EOI marker
    return jpeg[:-2] + last_scan * repeats + b"\xff\xd9"


def write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


# A real TIFF (fuzzed) on which Pillow raises TypeError: one of the types the worker must catch.
TYPE_ERROR_TIFF = Path(__file__).parents[1] / "guarantees" / "crashers" / (
    "TypeError-seed3-004757-tiff-exif1-bit_flips.tif")


def dds_unknown_fourcc() -> bytes:
    """A DDS header with a pixel format Pillow does not implement: Pillow's DDS plugin raised
    ``NotImplementedError`` from ``Image.open`` whatever the file was named, until only the
    formats inboxd takes were opened; now it is refused unparsed."""
    header = struct.pack("<7I", 124, 0x1007, 8, 8, 0, 0, 0) + b"\0" * 44
    pixel_format = struct.pack("<2I4s5I", 32, 0x4, b"ABCD", 0, 0, 0, 0, 0)
    return b"DDS " + header + pixel_format + b"\0" * 276


