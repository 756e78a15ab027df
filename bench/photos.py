"""The benchmark corpus: real photos of several sizes, generated reproducibly.

The sources are photographs that ship inside installed wheels (scikit-image, matplotlib,
scikit-learn), read straight from disk: nothing is downloaded. Each is center-cropped to 4:3
(3:4 for portrait sources), resized with Pillow's bicubic filter to each target size and given a
fixed, seeded film grain, so that upscaled photos compress like camera output rather than like
smooth gradients (a 12-MP JPEG of a few MB, not a few hundred KB). Same package versions, same
bytes: the corpus is cached under ``bench/out/photos`` and keyed by a manifest of its recipe.
On a machine without those packages (the GPU machine), ``INBOXD_PHOTOS_DIR`` names a folder
holding the same files (``bench/fetch_gpu_wheels.sh`` copies them to ``.wheels/photos``).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from PIL import Image

PHOTOS_DIR_ENV = "INBOXD_PHOTOS_DIR"
# (name, package, file inside that package's data folder)
SOURCES: tuple[tuple[str, str, str], ...] = (
    ("chelsea", "skimage", "chelsea.png"),
    ("coffee", "skimage", "coffee.png"),
    ("astronaut", "skimage", "astronaut.png"),
    ("rocket", "skimage", "rocket.jpg"),
    ("camera", "skimage", "camera.png"),  # greyscale: exercises the mode conversion
    ("motorcycle", "skimage", "motorcycle_left.png"),
    ("grace_hopper", "matplotlib", "grace_hopper.jpg"),
    ("china", "sklearn", "china.jpg"),
    ("flower", "sklearn", "flower.jpg"),
)
# Landscape sizes; portrait sources get them transposed.
SIZES: dict[str, tuple[int, int]] = {
    "0.3MP": (640, 480),
    "1MP": (1152, 864),
    "3MP": (2048, 1536),
    "12MP": (4000, 3000),
}
FORMATS = {"jpg": ("JPEG", {"quality": 90}), "png": ("PNG", {"compress_level": 6})}
GRAIN_SIGMA = 3.0
RECIPE_VERSION = 1


@dataclass(frozen=True, slots=True)
class Photo:
    path: Path
    source: str
    size: str  # a key of SIZES
    fmt: str  # a key of FORMATS
    megapixels: float
    nbytes: int

    @property
    def label(self) -> str:
        return f"{self.size} {self.fmt}"


def source_path(package: str, file: str) -> Path | None:
    """Where an installed package keeps ``file``; None when this version does not ship it."""
    copies = os.environ.get(PHOTOS_DIR_ENV)
    if copies:
        path = Path(copies) / file
        return path if path.is_file() else None
    if package == "skimage":
        import skimage

        path = Path(skimage.__file__).parent / "data" / file
    elif package == "matplotlib":
        import matplotlib.cbook

        path = Path(matplotlib.cbook.get_sample_data(file, asfileobj=False))
    else:
        import sklearn.datasets

        path = Path(sklearn.datasets.__file__).parent / "images" / file
    return path if path.is_file() else None


def _crop_4_3(image: Image.Image, portrait: bool) -> Image.Image:
    width, height = image.size
    ratio = 3 / 4 if portrait else 4 / 3
    if width / height > ratio:
        new_w, new_h = round(height * ratio), height
    else:
        new_w, new_h = width, round(width / ratio)
    left, top = (width - new_w) // 2, (height - new_h) // 2
    return image.crop((left, top, left + new_w, top + new_h))


def _render(source: Path, size: tuple[int, int], seed: int) -> Image.Image:
    image: Image.Image = Image.open(source)
    image = image.convert("L" if image.mode in ("L", "I;16") else "RGB")
    portrait = image.height > image.width
    target = (size[1], size[0]) if portrait else size
    image = _crop_4_3(image, portrait).resize(target, Image.Resampling.BICUBIC)
    pixels = np.asarray(image, dtype=np.float32)
    grain = np.random.default_rng(seed).normal(0.0, GRAIN_SIGMA, pixels.shape)
    return Image.fromarray(np.clip(pixels + grain, 0, 255).astype(np.uint8), mode=image.mode)


def _recipe_key() -> str:
    import PIL

    recipe = [RECIPE_VERSION, SOURCES, SIZES, FORMATS, GRAIN_SIGMA, PIL.__version__,
              np.__version__]
    return hashlib.sha256(json.dumps(recipe, default=str).encode()).hexdigest()[:16]


def build_corpus(folder: Path, sizes: list[str] | None = None,
                 formats: list[str] | None = None) -> list[Photo]:
    """Every (photo, size, format) present on disk under ``folder``, generated when missing or
    when the recipe changed. Ordered by size, then format, then source."""
    folder.mkdir(parents=True, exist_ok=True)
    manifest = folder / "manifest.json"
    key = _recipe_key()
    known: dict[str, str] = {}
    if manifest.is_file():
        stored = json.loads(manifest.read_text())
        if stored.get("recipe") == key:
            known = stored["files"]
    photos: list[Photo] = []
    wanted_sizes = sizes or list(SIZES)
    wanted_formats = formats or list(FORMATS)
    for size in wanted_sizes:
        for fmt in wanted_formats:
            for index, (name, package, file) in enumerate(SOURCES):
                src = source_path(package, file)
                if src is None:
                    continue
                path = folder / f"{name}-{size}.{fmt}"
                if path.name not in known or not path.is_file():
                    image = _render(src, SIZES[size], seed=index)
                    pil_format, options = FORMATS[fmt]
                    tmp = path.with_suffix(".partial")
                    image.save(tmp, format=pil_format, **options)
                    tmp.rename(path)
                    known[path.name] = size
                width, height = SIZES[size]
                photos.append(Photo(path, name, size, fmt, round(width * height / 1e6, 2),
                                    path.stat().st_size))
    manifest.write_text(json.dumps({"recipe": key, "files": known}, indent=1))
    return photos


def describe(photos: list[Photo]) -> list[dict[str, object]]:
    return [{**asdict(p), "path": p.path.name} for p in photos]


def jpegs(out: Path) -> list[Path]:
    """The 0.3-MP JPEGs of the bench corpus (made from the real photos)."""
    return [p.path for p in build_corpus(out / "photos", sizes=["0.3MP"], formats=["jpg"])]
