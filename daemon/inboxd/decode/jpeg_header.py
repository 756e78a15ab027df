"""Is this JPEG one the GPU may decode? A pure-Python reading of its markers, nothing decoded.

nvJPEG runs in the daemon's own process (``decode/tensor.py`` says why that is a trade-off), so
only the plainest files get there: what this module accepts is a baseline or extended-sequential
Huffman JPEG (SOF0/SOF1) with 8-bit samples, 1 (grey) or 3 (YCbCr) components, ordinary chroma
subsampling, every quantisation table its frame names defined, an end-of-image marker after the
scan (a truncated file goes to the CPU path, which reports it), and at most ``max_pixels``.
Everything else — progressive (SOF2), arithmetic, lossless, 12-bit, CMYK/YCCK (4 components),
Adobe RGB (transform 0), a file too large — is refused with a reason and takes the CPU path.

Written to be hostile-input safe: every length is checked against the bytes there are, the walk
only moves forward, and the only outcome of garbage is a ``NotEligible`` reason.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

SOI, EOI, SOS = 0xD8, 0xD9, 0xDA
BASELINE_SOFS = {0xC0, 0xC1}  # baseline, extended sequential (both Huffman, both nvJPEG's)
OTHER_SOFS = {0xC2: "progressive", 0xC3: "lossless", 0xC5: "hierarchical",
              0xC6: "hierarchical progressive", 0xC7: "hierarchical lossless",
              0xC9: "arithmetic", 0xCA: "arithmetic progressive", 0xCB: "arithmetic lossless",
              0xCD: "arithmetic hierarchical", 0xCE: "arithmetic hierarchical progressive",
              0xCF: "arithmetic hierarchical lossless"}
DQT, APP1, APP14 = 0xDB, 0xE1, 0xEE
STANDALONE = {0x01, *range(0xD0, 0xD8)}  # TEM, RST0-7: markers without a length
# Luma sampling factors nvJPEG and libjpeg-turbo both take (4:4:4, 4:2:2, 4:4:0, 4:2:0, 4:1:1)
# with chroma at 1×1; anything else is legal JPEG but rare enough to leave to the CPU.
LUMA_SAMPLING = {(1, 1), (2, 1), (1, 2), (2, 2), (4, 1)}
ORIENTATION_TAG = 0x0112


class NotEligible(Exception):
    """Why a file takes the CPU path instead (not an error of the file: the CPU path decides)."""


@dataclass(frozen=True, slots=True)
class JpegHeader:
    width: int  # as stored, before EXIF orientation
    height: int
    components: int  # 1 (grey) or 3 (YCbCr)
    orientation: int  # EXIF orientation 1-8 (1 when absent or unreadable, as Pillow does)

    @property
    def oriented_size(self) -> tuple[int, int]:
        """Width and height after the EXIF orientation is applied (5-8 swap them)."""
        return (self.height, self.width) if self.orientation >= 5 else (self.width, self.height)


def inspect(data: bytes, max_pixels: int) -> JpegHeader:
    """The header of a JPEG the GPU may decode; ``NotEligible`` says why not."""
    if data[:3] != b"\xff\xd8\xff":
        raise NotEligible("not a JPEG (no SOI marker)")
    pos, frame, exif, quant_tables, adobe = 2, None, None, set(), None
    while True:
        marker, pos = _next_marker(data, pos)
        if marker in STANDALONE:
            continue
        if marker == EOI:
            raise NotEligible("no scan before the end-of-image marker")
        if pos + 2 > len(data):
            raise NotEligible("truncated in the header")
        (length,) = struct.unpack_from(">H", data, pos)
        segment = data[pos + 2:pos + length]
        if length < 2 or len(segment) != length - 2:
            raise NotEligible("a header segment runs past the end of the file")
        if marker in OTHER_SOFS:
            raise NotEligible(f"{OTHER_SOFS[marker]} JPEG (SOF{marker - 0xC0})")
        if marker in BASELINE_SOFS:
            frame = _frame(segment)
        elif marker == DQT:
            quant_tables |= _quant_table_ids(segment)
        elif marker == APP1 and segment.startswith(b"Exif\0\0") and exif is None:
            exif = segment[6:]  # the first one, as Pillow takes it
        elif marker == APP14 and segment.startswith(b"Adobe") and len(segment) >= 12:
            adobe = segment[11]
        elif marker == SOS:
            pos += length
            break
        pos += length
    if frame is None:
        raise NotEligible("no baseline frame header (SOF0/SOF1) before the scan")
    width, height, components, table_ids = frame
    if not table_ids <= quant_tables:
        raise NotEligible("a component names a quantisation table that is not defined")
    if components == 3 and adobe == 0:
        raise NotEligible("Adobe RGB-coded JPEG (APP14 transform 0)")
    if width * height > max_pixels:
        raise NotEligible(f"{width}×{height} is more than preprocess.max_image_pixels")
    if data.find(b"\xff\xd9", pos) < 0:
        raise NotEligible("no end-of-image marker after the scan (truncated?)")
    orientation = exif_orientation(exif) if exif is not None else 1
    return JpegHeader(width, height, components, orientation)


def _next_marker(data: bytes, pos: int) -> tuple[int, int]:
    """The marker at ``pos`` (fill bytes 0xFF skipped) and the position after it."""
    if pos >= len(data) or data[pos] != 0xFF:
        raise NotEligible("garbage where a header marker should be")
    while pos < len(data) and data[pos] == 0xFF:
        pos += 1
    if pos >= len(data):
        raise NotEligible("truncated in the header")
    return data[pos], pos + 1


def _frame(segment: bytes) -> tuple[int, int, int, set[int]]:
    if len(segment) < 6:
        raise NotEligible("short frame header")
    precision, height, width, components = struct.unpack_from(">BHHB", segment)
    if precision != 8:
        raise NotEligible(f"{precision}-bit samples")
    if width == 0 or height == 0:
        raise NotEligible("zero width or height in the frame header (DNL)")
    if components not in (1, 3):
        raise NotEligible(f"{components} components (CMYK/YCCK or other): not grey or YCbCr")
    if len(segment) < 6 + 3 * components:
        raise NotEligible("short frame header")
    factors, tables = [], set()
    for n in range(components):
        _ident, sampling, table = segment[6 + 3 * n:9 + 3 * n]
        factors.append((sampling >> 4, sampling & 15))
        tables.add(table)
    if components == 3 and (factors[0] not in LUMA_SAMPLING or factors[1:] != [(1, 1)] * 2):
        raise NotEligible(f"unusual chroma subsampling {factors}")
    return width, height, components, tables


def _quant_table_ids(segment: bytes) -> set[int]:
    ids, pos = set(), 0
    while pos < len(segment):
        precision, ident = segment[pos] >> 4, segment[pos] & 15
        pos += 1 + (128 if precision else 64)
        if pos > len(segment):
            raise NotEligible("short quantisation table")
        ids.add(ident)
    return ids


def exif_orientation(tiff: bytes) -> int:
    """The Orientation tag of IFD0 of an EXIF TIFF block; 1 when absent, unreadable or out of
    range (Pillow's ``exif_transpose`` leaves such images as they are too)."""
    try:
        order = {b"II": "<", b"MM": ">"}[tiff[:2]]
        (ifd,) = struct.unpack_from(order + "I", tiff, 4)
        (count,) = struct.unpack_from(order + "H", tiff, ifd)
        for n in range(min(count, 1024)):
            tag, kind, _count, value = struct.unpack_from(order + "HHI4s", tiff, ifd + 2 + 12 * n)
            if tag == ORIENTATION_TAG:
                # SHORT (3) sits in the first two bytes of the value field; LONG (4) in all four.
                found = struct.unpack_from(order + ("H" if kind == 3 else "I"), value)[0]
                return found if kind in (3, 4) and 1 <= found <= 8 else 1
    except (KeyError, struct.error):
        pass
    return 1
