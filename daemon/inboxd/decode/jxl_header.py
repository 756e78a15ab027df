"""The size a JPEG XL file declares, read from its header before anything is decoded.

pillow-jxl-plugin decodes the whole image inside ``Image.open`` (its ``_open``), before Pillow or
``decode_image`` can look at the size: a file of a few KB that declares 12,000 × 12,000 pixels
was decoded into 450 MB before ``max_image_pixels`` refused it, and a larger one stopped only at
the decode worker's ``RLIMIT_AS``, where libjxl says no more than "Generic Error". So the size
is read here first: the codestream's SizeHeader (ISO/IEC 18181-1), found at the start of a bare
codestream (``FF 0A``) or, in the container (ISO/IEC 18181-2), at the start of the ``jxlc`` box
or of the first ``jxlp`` boxes. This is the image's size; a frame inside may declare more, and
that is left to ``RLIMIT_AS``.

Written for hostile input, as ``jpeg_header.py`` is: every length is checked against the bytes
there are, the walk over boxes only moves forward and is bounded, and garbage ends as
``UnreadableHeader``.
"""

from __future__ import annotations

import os
import struct
from typing import BinaryIO

CODESTREAM_SIGNATURE = b"\xff\x0a"
CONTAINER_SIGNATURE = b"\x00\x00\x00\x0cJXL \r\n\x87\n"
# The SizeHeader after the codestream's signature takes at most 1 + 32 + 3 + 32 bits.
SIZE_HEADER_BYTES = 9
HEAD_BYTES = len(CODESTREAM_SIGNATURE) + SIZE_HEADER_BYTES  # what is read of a codestream
# Boxes before the codestream (ftyp, jxll, Exif, xml, ...): a real file has a handful.
MAX_BOXES = 64
# A box's 64-bit size may say anything; past this (256 TiB) it is no file's, and skipping it
# would overflow the seek.
MAX_BOX_BYTES = 1 << 48
# ratio (1-7) → width = height × numerator // denominator
RATIOS = {1: (1, 1), 2: (12, 10), 3: (4, 3), 4: (3, 2), 5: (16, 9), 6: (5, 4), 7: (2, 1)}
U32_BITS = (9, 13, 18, 30)  # a side that is not a multiple of 8 (below 257): 1 + u(bits)


class UnreadableHeader(Exception):
    """No size could be read: the file is not a JPEG XL or is corrupt or truncated."""


def is_jxl(prefix: bytes) -> bool:
    """Whether a file starting with ``prefix`` (12 bytes) is a JPEG XL codestream or container.
    The plugin's own test is looser (``JXL`` at offset 4), but libjxl decodes nothing that does
    not start with one of these two signatures (measured: it refuses the rest with "does not
    contain a valid codestream or container")."""
    return prefix.startswith(CODESTREAM_SIGNATURE) or prefix.startswith(CONTAINER_SIGNATURE)


def declared_size(source: BinaryIO) -> tuple[int, int]:
    """(width, height) of the JPEG XL image ``source`` holds from its current position."""
    bits = _Bits(_size_header_bytes(source))
    small = bits.read(1)
    height = _side(bits, small)
    ratio = bits.read(3)
    if ratio:
        numerator, denominator = RATIOS[ratio]
        return height * numerator // denominator, height
    return _side(bits, small), height


def _side(bits: _Bits, small: int) -> int:
    if small:
        return (bits.read(5) + 1) * 8
    return bits.read(U32_BITS[bits.read(2)]) + 1


def _size_header_bytes(source: BinaryIO) -> bytes:
    start = source.read(len(CONTAINER_SIGNATURE))
    if start.startswith(CODESTREAM_SIGNATURE):
        return (start + source.read(SIZE_HEADER_BYTES))[len(CODESTREAM_SIGNATURE):HEAD_BYTES]
    if start != CONTAINER_SIGNATURE:
        raise UnreadableHeader("no JPEG XL signature")
    found = b""  # the codestream's first bytes, from one jxlc box or consecutive jxlp boxes
    for _ in range(MAX_BOXES):
        kind, content_bytes = _box_header(source)
        if kind == b"jxlc":  # never past the box: what follows is another box's
            found = source.read(HEAD_BYTES if content_bytes is None
                                else min(HEAD_BYTES, content_bytes))
        elif kind == b"jxlp":  # a 4-byte part number, then a piece of the codestream
            if content_bytes is not None and content_bytes < 4:
                raise UnreadableHeader("a jxlp box too short for its part number")
            source.read(4)
            wanted = HEAD_BYTES - len(found)
            piece = source.read(wanted if content_bytes is None
                                else min(wanted, content_bytes - 4))
            found += piece
            if len(found) < HEAD_BYTES and content_bytes is not None and (
                    len(piece) == content_bytes - 4):
                continue  # the codestream goes on in the next jxlp box (after other boxes)
        elif content_bytes is not None:
            source.seek(content_bytes, os.SEEK_CUR)
            continue
        else:
            raise UnreadableHeader("no codestream box")
        if not found.startswith(CODESTREAM_SIGNATURE):
            raise UnreadableHeader("the codestream box holds no codestream")
        return found[len(CODESTREAM_SIGNATURE):]
    raise UnreadableHeader(f"more than {MAX_BOXES} boxes before the codestream")


def _box_header(source: BinaryIO) -> tuple[bytes, int | None]:
    """The next box's type and content length (None: it runs to the end of the file)."""
    header = source.read(8)
    if len(header) < 8:
        raise UnreadableHeader("no codestream box")
    size, kind = struct.unpack(">I4s", header)
    header_bytes = 8
    if size == 1:  # a 64-bit size follows
        extended = source.read(8)
        if len(extended) < 8:
            raise UnreadableHeader("a box header cut short")
        size, header_bytes = struct.unpack(">Q", extended)[0], 16
    if size == 0:
        return kind, None
    if size < header_bytes:
        raise UnreadableHeader("a box smaller than its own header")
    if size > MAX_BOX_BYTES:
        raise UnreadableHeader("a box larger than any file")
    return kind, size - header_bytes


class _Bits:
    """JPEG XL's bit order: each byte's least significant bit first."""

    def __init__(self, data: bytes) -> None:
        self.value = int.from_bytes(data, "little")
        self.available = 8 * len(data)
        self.position = 0

    def read(self, count: int) -> int:
        if self.position + count > self.available:
            raise UnreadableHeader("the size header is cut short")
        value = (self.value >> self.position) & ((1 << count) - 1)
        self.position += count
        return value
