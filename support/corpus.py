"""The fidelity corpus: a few hundred real-photo variants, made deterministically from the photos
that ship inside installed wheels (``support/photos.py``: scikit-image, matplotlib, scikit-learn;
nothing is downloaded).

Each photo gets ``VARIANTS_PER_PHOTO`` variants: cropped to a random window and aspect ratio,
rotated by a few degrees (then cropped inside the rotated frame), mirrored, or turned a quarter
or half turn with the EXIF Orientation tag that turns it back; scaled (up, mostly: the sources
are under 1 MP) to 0.3-12 MP with a seeded camera grain, so upscaled photos compress like camera
output; encoded as JPEG at several qualities and chroma subsamplings (some progressive), and a
share as HEIC, WebP and PNG. One seed per (photo, variant): the same packages give the same
bytes.

Built once into ``var/corpus/<key>/`` (``INBOXD_CORPUS_DIR`` moves it), where the key hashes the
recipe and the versions of the encoders, so a changed recipe builds a new folder rather than
mixing with an old one. Builders race safely: each writes a folder of its own and renames it
into place; the first rename wins.

    python -m support.corpus        # build (or find) it and print a summary
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import shutil
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from support.photos import photo_paths

CORPUS_DIR_ENV = "INBOXD_CORPUS_DIR"
DEFAULT_DIR = Path(__file__).resolve().parents[1] / "var" / "corpus"
RECIPE_VERSION = 1
VARIANTS_PER_PHOTO = 36
MEGAPIXELS = (0.3, 0.5, 0.8, 1.2, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0)
# HEIC encoding (x265) is slow: its variants stay at or below this size.
HEIC_MAX_MEGAPIXELS = 4.0
PNG_MAX_MEGAPIXELS = 2.0
JPEG_QUALITIES = (55, 70, 80, 90, 95)
JPEG_SUBSAMPLINGS = ("4:4:4", "4:2:2", "4:2:0")
HEIC_QUALITIES = (50, 70, 90)
WEBP_QUALITIES = (70, 85, 95)
GRAIN_SIGMAS = (1.5, 3.0, 5.0)
GEOMETRIES = ("crop", "rotate", "mirror", "exif")
NOISE_TILE = 509  # a prime: the tiled grain has no period that lines up with 8×8 DCT blocks
ORIENTATION_TAG = 0x0112


@dataclass(frozen=True, slots=True)
class Variant:
    file: str  # inside the corpus folder
    source: str  # support.photos short name
    geometry: str  # one of GEOMETRIES
    fmt: str  # JPEG, HEIC, WEBP, PNG
    quality: int | None
    subsampling: str | None
    width: int  # the stored pixels (before EXIF orientation)
    height: int
    nbytes: int
    # upscaled: a wheel photo under 1 MP scaled up (no detail above the source's resolution);
    # real: a camera photo at its native pixels (support/real_photos.py).
    origin: str = "upscaled"

    @property
    def megapixels(self) -> float:
        return self.width * self.height / 1e6


def _format_for(variant: int, megapixels: float) -> str:
    """Fixed slots per photo, so every photo has its share of each format."""
    if variant % 6 == 4 and megapixels <= HEIC_MAX_MEGAPIXELS:
        return "HEIC"
    if variant % 18 == 7:
        return "WEBP"
    if variant % 18 == 11 and megapixels <= PNG_MAX_MEGAPIXELS:
        return "PNG"
    return "JPEG"


def _random_crop(image: Image.Image, rng: np.random.Generator) -> Image.Image:
    width, height = image.size
    area = rng.uniform(0.45, 1.0) * width * height
    aspect = math.exp(rng.uniform(math.log(0.56), math.log(1.8)))  # 9:16 .. 16:9
    new_w = min(width, max(32, round(math.sqrt(area * aspect))))
    new_h = min(height, max(32, round(math.sqrt(area / aspect))))
    left = int(rng.integers(0, width - new_w + 1))
    top = int(rng.integers(0, height - new_h + 1))
    return image.crop((left, top, left + new_w, top + new_h))


def _rotate(image: Image.Image, rng: np.random.Generator) -> Image.Image:
    """A few degrees either way, cropped to the largest centred window without the corners."""
    angle = float(rng.uniform(2, 12)) * (1 if rng.random() < 0.5 else -1)
    width, height = image.size
    rotated = image.rotate(angle, Image.Resampling.BICUBIC, expand=False)
    theta = math.radians(abs(angle))
    # The axis-aligned box of the same aspect that fits inside the rotated frame.
    scale = 1 / (math.cos(theta) + math.sin(theta) * max(width / height, height / width))
    new_w, new_h = int(width * scale), int(height * scale)
    left, top = (width - new_w) // 2, (height - new_h) // 2
    return rotated.crop((left, top, left + new_w, top + new_h))


# EXIF orientation -> the transpose that, stored, the decoder's exif_transpose undoes.
_STORED_FOR_ORIENTATION = {
    3: Image.Transpose.ROTATE_180,
    6: Image.Transpose.ROTATE_90,  # stored a quarter turn anticlockwise; 6 turns it clockwise
    8: Image.Transpose.ROTATE_270,
}


def _scale(image: Image.Image, megapixels: float) -> Image.Image:
    width, height = image.size
    factor = math.sqrt(megapixels * 1e6 / (width * height))
    size = (max(16, round(width * factor)), max(16, round(height * factor)))
    filt = Image.Resampling.BICUBIC if factor >= 1 else Image.Resampling.LANCZOS
    return image.resize(size, filt)


def _grain(image: Image.Image, sigma: float, rng: np.random.Generator) -> Image.Image:
    """A seeded grain tile, repeated from a random offset: a camera's noise for JPEG to keep,
    at a fraction of the cost of drawing 36 M normal samples for a 12-MP photo."""
    pixels = np.asarray(image, dtype=np.int16)
    channels = 1 if pixels.ndim == 2 else pixels.shape[2]
    tile = np.rint(rng.normal(0.0, sigma, (NOISE_TILE, NOISE_TILE, channels))).astype(np.int16)
    height, width = pixels.shape[:2]
    dy, dx = (int(v) for v in rng.integers(0, NOISE_TILE, 2))
    reps = (math.ceil((height + dy) / NOISE_TILE), math.ceil((width + dx) / NOISE_TILE), 1)
    noise = np.tile(tile, reps)[dy:dy + height, dx:dx + width]
    if pixels.ndim == 2:
        noise = noise[..., 0]
    pixels += noise
    np.clip(pixels, 0, 255, out=pixels)
    return Image.fromarray(pixels.astype(np.uint8), mode=image.mode)


def _encode(image: Image.Image, fmt: str, rng: np.random.Generator,
            orientation: int | None) -> tuple[bytes, int | None, str | None]:
    out = io.BytesIO()
    quality: int | None = None
    subsampling: str | None = None
    exif = Image.Exif()
    if orientation is not None:
        exif[ORIENTATION_TAG] = orientation
    if fmt == "JPEG":
        quality = int(rng.choice(JPEG_QUALITIES))
        subsampling = str(rng.choice(JPEG_SUBSAMPLINGS)) if image.mode != "L" else None
        options: dict[str, object] = {"quality": quality, "progressive": bool(rng.random() < 0.3)}
        if subsampling is not None:
            options["subsampling"] = subsampling
        image.save(out, "JPEG", exif=exif, **options)
    elif fmt == "HEIC":
        import pillow_heif

        quality = int(rng.choice(HEIC_QUALITIES))
        pillow_heif.from_pillow(image.convert("RGB")).save(out, quality=quality,
                                                           exif=exif.tobytes())
    elif fmt == "WEBP":
        quality = int(rng.choice(WEBP_QUALITIES))
        image.save(out, "WEBP", quality=quality, exif=exif)
    else:
        image.save(out, "PNG", compress_level=3, exif=exif)
    return out.getvalue(), quality, subsampling


def _make(name: str, source: Path, index: int, variant: int) -> tuple[bytes, Variant]:
    rng = np.random.default_rng([RECIPE_VERSION, index, variant])
    with Image.open(source) as opened:
        image = opened.convert("L" if opened.mode in ("L", "I;16") else "RGB")
    geometry = GEOMETRIES[variant % len(GEOMETRIES)]
    orientation: int | None = None
    if geometry == "rotate":
        image = _rotate(image, rng)
    image = _random_crop(image, rng) if geometry != "rotate" or rng.random() < 0.5 else image
    if geometry == "mirror":
        image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    megapixels = MEGAPIXELS[(variant * 7 + index * 3) % len(MEGAPIXELS)]
    image = _scale(image, megapixels)
    image = _grain(image, float(rng.choice(GRAIN_SIGMAS)), rng)
    if geometry == "exif":
        orientation = int(rng.choice(sorted(_STORED_FOR_ORIENTATION)))
        image = image.transpose(_STORED_FOR_ORIENTATION[orientation])
    fmt = _format_for(variant, megapixels)
    data, quality, subsampling = _encode(image, fmt, rng, orientation)
    suffix = {"JPEG": "jpg", "HEIC": "heic", "WEBP": "webp", "PNG": "png"}[fmt]
    file = f"{name}-{variant:02d}.{suffix}"
    return data, Variant(file, name, geometry, fmt, quality, subsampling, image.width,
                         image.height, len(data))


def corpus_key() -> str:
    import PIL
    import pillow_heif

    recipe = [RECIPE_VERSION, VARIANTS_PER_PHOTO, MEGAPIXELS, HEIC_MAX_MEGAPIXELS,
              PNG_MAX_MEGAPIXELS, JPEG_QUALITIES, JPEG_SUBSAMPLINGS, HEIC_QUALITIES,
              WEBP_QUALITIES, GRAIN_SIGMAS, GEOMETRIES, NOISE_TILE, sorted(photo_paths()),
              PIL.__version__, pillow_heif.__version__, np.__version__]
    return hashlib.sha256(json.dumps(recipe, default=str).encode()).hexdigest()[:16]


def corpus_dir() -> Path:
    return Path(os.environ.get(CORPUS_DIR_ENV) or DEFAULT_DIR) / corpus_key()


MakeVariant = Callable[[str, Path, int, int], tuple[bytes, Variant]]


def build_into(folder: Path, sources: dict[str, Path], variants_per_photo: int,
               make: MakeVariant) -> tuple[Path, list[Variant]]:
    """``folder`` with the ``variants_per_photo`` variants ``make`` gives of each of ``sources``
    (name → photo) and
    their manifest, built first when it is not there yet (into a partial folder renamed into
    place, so a half-built corpus is never read)."""
    manifest = folder / "manifest.json"
    if not manifest.is_file():
        partial = folder.with_name(f"{folder.name}.partial-{os.getpid()}")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        variants = []
        for index, (name, source) in enumerate(sorted(sources.items())):
            for variant in range(variants_per_photo):
                data, made = make(name, source, index, variant)
                (partial / made.file).write_bytes(data)
                variants.append(made)
        (partial / "manifest.json").write_text(json.dumps([asdict(v) for v in variants],
                                                          indent=0))
        try:
            partial.rename(folder)
        except OSError:  # another builder got there first: its bytes are the same
            shutil.rmtree(partial, ignore_errors=True)
    stored = json.loads(manifest.read_text())
    return folder, [Variant(**entry) for entry in stored]


def build() -> tuple[Path, list[Variant]]:
    """The corpus folder and its variants, building it first when it is not there yet."""
    return build_into(corpus_dir(), photo_paths(), VARIANTS_PER_PHOTO, _make)


def main() -> None:
    started = time.monotonic()
    folder, variants = build()
    elapsed_s = time.monotonic() - started
    print(f"{len(variants)} variants in {folder} ({elapsed_s:.1f} s to build or find)")
    print("formats:", dict(Counter(v.fmt for v in variants)))
    print("geometries:", dict(Counter(v.geometry for v in variants)))
    print("megapixels:", dict(sorted(Counter(round(v.megapixels, 1) for v in variants).items())))
    print(f"bytes: {sum(v.nbytes for v in variants) / 1e6:.0f} MB")


if __name__ == "__main__":
    main()
