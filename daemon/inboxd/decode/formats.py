"""Which image formats this build decodes, and the file names that go with them.

Pillow decodes JPEG, PNG, WebP, GIF, BMP, TIFF, AVIF and JPEG 2000 itself (when its wheel was
built with the codec); HEIC/HEIF comes from ``pillow-heif`` and JPEG XL from
``pillow-jxl-plugin``. Importing this module registers those plugins, so every process that
decodes (the daemon and any decode worker) imports it before ``Image.open``.

The default ``inbox.include`` is made from :func:`decodable`: a user never has to know which
extensions a format uses, and a format this build cannot decode is never taken only to fail.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from PIL import Image, features

HEIC_DECODE_THREADS = 4
with contextlib.suppress(ImportError):  # a runtime dependency; without it HEIC is not offered
    import pillow_heif

    pillow_heif.register_heif_opener()
    # libheif decodes with threads of its own (the tiles of a phone's grid HEIC, an HEVC
    # stream's wavefronts), as Pillow's AVIF plugin does with one per usable core; a worker
    # decodes on one thread otherwise, and HEIC is the slowest format it takes. Measured with
    # two workers decoding at once on two cores, 4 threads were not slower than 2 or 1
    # (docs/decisions.md): pillow-heif's default, set here so that a new default is a choice.
    pillow_heif.options.DECODE_THREADS = HEIC_DECODE_THREADS
with contextlib.suppress(ImportError):  # registers the JXL opener on import
    from pillow_jxl import JpegXLImagePlugin

    # One file per decode worker, and as many workers as the cores allow: the plugin's default
    # (-1) decodes each JPEG XL on every core, which would oversubscribe the cores per worker.
    JpegXLImagePlugin.DECODE_THREADS = 0  # the plugin's "no parallelism"


@dataclass(frozen=True)
class ImageFormat:
    name: str  # what users call it
    pillow: str  # Pillow's format id (Image.OPEN key)
    extensions: tuple[str, ...]
    feature: str | None  # the Pillow codec feature it needs, when it needs one
    install: str  # what to do when this build cannot decode it
    note: str = ""  # what of a multi-image file is read


# Every format users drop that a maintained Pillow plugin can decode, in the order listed.
FORMATS = (
    ImageFormat("JPEG", "JPEG", (".jpg", ".jpeg", ".jpe", ".jfif"), "jpg",
                "a Pillow built with libjpeg"),
    ImageFormat("PNG", "PNG", (".png",), "zlib", "a Pillow built with zlib", "first frame"),
    ImageFormat("WebP", "WEBP", (".webp",), "webp", "a Pillow built with libwebp",
                "first frame"),
    ImageFormat("GIF", "GIF", (".gif",), None, "Pillow", "first frame"),
    ImageFormat("BMP", "BMP", (".bmp",), None, "Pillow"),
    ImageFormat("TIFF", "TIFF", (".tif", ".tiff"), None, "Pillow", "first page"),
    ImageFormat("AVIF", "AVIF", (".avif",), "avif", "Pillow >= 11.3 (built with libavif) or "
                "pip install pillow-avif-plugin", "first frame"),
    ImageFormat("HEIC/HEIF", "HEIF", (".heic", ".heif", ".hif"), None,
                "pip install pillow-heif", "primary image"),
    ImageFormat("JPEG 2000", "JPEG2000", (".jp2", ".j2k", ".jpf", ".jpx"), "jpg_2000",
                "a Pillow built with OpenJPEG"),
    ImageFormat("JPEG XL", "JXL", (".jxl",), None, "pip install pillow-jxl-plugin"),
)


def can_decode(fmt: ImageFormat) -> bool:
    Image.init()
    if fmt.pillow not in Image.OPEN:
        return False
    return fmt.feature is None or bool(features.check(fmt.feature))


def decodable() -> list[ImageFormat]:
    """The formats this build decodes."""
    return [fmt for fmt in FORMATS if can_decode(fmt)]


def default_include() -> list[str]:
    """``inbox.include`` when the config leaves it unset: every extension this build decodes
    (names are matched without regard to case)."""
    return [f"*{ext}" for fmt in decodable() for ext in fmt.extensions]


def format_for_name(name: str) -> ImageFormat | None:
    """The known format a file name's extension says, decodable here or not."""
    lowered = name.lower()
    for fmt in FORMATS:
        if lowered.endswith(fmt.extensions):
            return fmt
    return None


def describe() -> list[str]:
    """One line per known format, for ``inboxd check-config``."""
    lines = []
    for fmt in FORMATS:
        names = " ".join(fmt.extensions)
        note = f" ({fmt.note})" if fmt.note else ""
        if can_decode(fmt):
            lines.append(f"{fmt.name}: {names}{note}")
        else:
            lines.append(f"{fmt.name}: not in this build ({names}); needs {fmt.install}")
    return lines
