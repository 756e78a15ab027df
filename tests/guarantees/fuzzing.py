"""Seeded mutations of real images, in every format the daemon decodes: the decoder fuzzer's
inputs. Case ``n`` of seed ``s`` is always the same bytes, so any finding can be replayed.

Seeds are real photos (support/photos.py), made small so that a case decodes in milliseconds,
saved in each format and its common variants (progressive JPEG, EXIF orientation, palette and
16-bit PNG, lossless WebP, compressed TIFF, ...). Mutations are what breaks parsers: bit flips,
interesting values over bytes and integer fields, truncation, duplicated and deleted chunks,
edits to the header, and a real image's header spliced onto another's body.
"""

from __future__ import annotations

import contextlib
import io
import random
import struct
import warnings
from collections.abc import Callable
from functools import cache

from inboxd.decode import formats  # noqa: F401  (registers the HEIF and JPEG XL plugins)
from PIL import Image

from support.photos import photo_paths

FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")
EXTENSION = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp", "GIF": "gif", "BMP": "bmp",
             "TIFF": "tif"}
# Pillow picks the decoder from the content, not the name: any of these, named .jpg, reaches
# its decoder too. Those Pillow can write are seeds, under the name an adversary would use.
CONTENT_ONLY = ("DDS", "TGA", "PCX", "ICO", "PPM", "SGI", "IM", "JPEG2000", "XBM", "SPIDER")
INTERESTING_BYTES = (0x00, 0x01, 0x7F, 0x80, 0xFF)
INTERESTING_INTS = (0, 1, 0x7F, 0x80, 0xFF, 0x100, 0x7FFF, 0x8000, 0xFFFF, 0x10000,
                    0x7FFFFFFF, 0x80000000, 0xFFFFFFFF)


def _save(image: Image.Image, fmt: str, **options: object) -> bytes:
    data = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # IM: deprecated, still decoded
        image.save(data, fmt, **options)
    return data.getvalue()


@cache
def seeds() -> tuple[tuple[str, bytes], ...]:
    """(label, bytes) of every seed image, each format in several variants."""
    photos = [Image.open(path).convert("RGB") for _, path in sorted(photo_paths().items())[:3]]
    found: list[tuple[str, bytes]] = []
    for n, photo in enumerate(photos):
        small = photo.resize((48 + 8 * n, 36 + 4 * n))
        exif = Image.Exif()
        exif[0x0112] = 6  # rotated: the EXIF path runs too
        found += [
            (f"jpeg{n}", _save(small, "JPEG", quality=80)),
            (f"jpeg-progressive{n}", _save(small, "JPEG", progressive=True)),
            (f"jpeg-exif{n}", _save(small, "JPEG", exif=exif.tobytes())),
            (f"jpeg-gray{n}", _save(small.convert("L"), "JPEG")),
            (f"png{n}", _save(small, "PNG")),
            (f"png-palette{n}", _save(small.convert("P"), "PNG")),
            (f"png-alpha{n}", _save(small.convert("RGBA"), "PNG")),
            (f"png-16bit{n}", _save(small.convert("I").point(lambda v: v * 200)
                                    .convert("I;16"), "PNG")),
            (f"png-exif{n}", _save(small, "PNG", exif=exif.tobytes())),
            (f"webp{n}", _save(small, "WEBP", quality=70)),
            (f"webp-lossless{n}", _save(small.convert("RGBA"), "WEBP", lossless=True)),
            (f"gif{n}", _save(small, "GIF")),
            (f"gif-animated{n}", _save(small, "GIF", save_all=True, duration=50,
                                       append_images=[small.rotate(90), small.rotate(180)])),
            (f"bmp{n}", _save(small, "BMP")),
            (f"bmp-palette{n}", _save(small.convert("P"), "BMP")),
            (f"tiff{n}", _save(small, "TIFF")),
            (f"tiff-lzw{n}", _save(small, "TIFF", compression="tiff_lzw")),
            (f"tiff-jpeg{n}", _save(small, "TIFF", compression="jpeg")),
            (f"tiff-exif{n}", _save(small, "TIFF", exif=exif.tobytes())),
        ]
        # The decoders issue 11 added (through plugins): fuzzed like the rest, where this
        # build can also write them.
        for label, fmt in (("avif", "AVIF"), ("heif", "HEIF"), ("jxl", "JXL")):
            with contextlib.suppress(KeyError, OSError, ValueError):
                found.append((f"{label}{n}", _save(small, fmt)))
        for fmt in CONTENT_ONLY:
            mode = {"XBM": "1", "SPIDER": "F"}.get(fmt, "RGB")
            found.append((f"other-{fmt.lower()}{n}", _save(small.convert(mode), fmt)))
    return tuple(found)


def _bit_flips(data: bytearray, rng: random.Random) -> None:
    for _ in range(rng.randint(1, 8)):
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)


def _interesting_bytes(data: bytearray, rng: random.Random) -> None:
    for _ in range(rng.randint(1, 4)):
        data[rng.randrange(len(data))] = rng.choice(INTERESTING_BYTES)


def _interesting_int(data: bytearray, rng: random.Random) -> None:
    width, fmt = rng.choice(((2, ">H"), (2, "<H"), (4, ">I"), (4, "<I")))
    at = rng.randrange(max(1, len(data) - width))
    value = rng.choice(INTERESTING_INTS) & ((1 << (8 * width)) - 1)
    data[at:at + width] = struct.pack(fmt, value)


def _header_edit(data: bytearray, rng: random.Random) -> None:
    """Sizes, counts and offsets live near the start of every one of these formats."""
    for _ in range(rng.randint(1, 3)):
        at = rng.randrange(min(len(data), 64))
        data[at] = rng.randrange(256)
    if rng.random() < 0.5:
        _interesting_int(data, random.Random(rng.random()))


def _truncate(data: bytearray, rng: random.Random) -> None:
    del data[rng.randrange(1, len(data)):]


def _duplicate_chunk(data: bytearray, rng: random.Random) -> None:
    start = rng.randrange(len(data))
    chunk = data[start:start + rng.randint(1, 512)]
    at = rng.randrange(len(data))
    data[at:at] = chunk * rng.randint(1, 8)


def _delete_chunk(data: bytearray, rng: random.Random) -> None:
    start = rng.randrange(len(data))
    del data[start:start + rng.randint(1, 256)]


def _splice(data: bytearray, rng: random.Random) -> None:
    other = rng.choice(seeds())[1]
    cut = rng.randrange(1, min(len(data), len(other)))
    data[:cut] = other[:cut]


MUTATIONS: tuple[Callable[[bytearray, random.Random], None], ...] = (
    _bit_flips, _interesting_bytes, _interesting_int, _header_edit, _truncate,
    _duplicate_chunk, _delete_chunk, _splice,
)


def case(seed: int, n: int) -> tuple[str, bytes]:
    """Case ``n`` of ``seed``: a file name (label, case, the seed's extension) and its bytes,
    one to three mutations of one seed image."""
    rng = random.Random(seed * 1_000_003 + n)
    label, original = rng.choice(seeds())
    data = bytearray(original)
    names = []
    for _ in range(rng.choice((1, 1, 2, 3))):
        mutation = rng.choice(MUTATIONS)
        names.append(mutation.__name__.strip("_"))
        if len(data) >= 2:  # every mutation needs a byte to keep and one to change
            mutation(data, rng)
    fmt = next((f for f in FORMATS if label.startswith(f.lower())), "JPEG")
    return f"{n:06}-{label}-{'+'.join(names)}.{EXTENSION[fmt]}", bytes(data)
