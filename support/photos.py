"""Real photographs that ship inside PyPI packages, for testing the model offline.

scikit-image, matplotlib and scikit-learn each carry a few photos in their wheels. Only files
already on disk are used: scikit-image fetches some of its data sets (eagle, lily, skin, ...)
with pooch on first use, so this module never calls ``skimage.data.<name>()`` and never
downloads anything; it only looks in the installed package directories.

``EXPECTED_TOP1`` lists, per photo, the ImageNet classes (torchvision's category names) that are
a correct top-1 answer. The sets were chosen from what the photo shows, then checked against the
model's output; where ImageNet has no exact class the nearest real one is accepted (the dahlia
in ``flower`` -> "daisy", the motorcycle -> "moped"/"motor scooter"). Photos without any fitting
ImageNet class (``astronaut``: a person in a space suit) are in ``photo_paths()`` but not here.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
from PIL import Image

# A folder with copies of the files below, for a machine without those packages (the GPU
# machine: bench/fetch_gpu_wheels.sh copies them to .wheels/photos).
PHOTOS_DIR_ENV = "INBOXD_PHOTOS_DIR"

# short name -> file name, per package.
_SKIMAGE = {
    "chelsea": "chelsea.png",  # a tabby cat
    "coffee": "coffee.png",  # an espresso in a cup on a saucer
    "rocket": "rocket.jpg",  # a rocket on its launch pad
    "astronaut": "astronaut.png",  # Eileen Collins in an orange suit, a shuttle model behind
    "camera": "camera.png",  # "cameraman": a man behind a camera on a tripod (grayscale)
    "motorcycle": "motorcycle_left.png",  # a red motorcycle in a garage
}
_MATPLOTLIB = {
    "grace_hopper": "grace_hopper.jpg",  # portrait in US Navy uniform, flag behind
}
_SKLEARN = {
    "china": "china.jpg",  # Summer Palace tower, Beijing
    "flower": "flower.jpg",  # an orange dahlia
}

EXPECTED_TOP1: dict[str, set[str]] = {
    "chelsea": {"tabby", "tiger cat", "Persian cat", "Siamese cat", "Egyptian cat"},
    "coffee": {"espresso", "cup", "coffee mug"},
    "rocket": {"missile", "projectile", "space shuttle"},
    "camera": {"tripod", "reflex camera"},
    "motorcycle": {"moped", "motor scooter"},
    "grace_hopper": {"military uniform", "suit", "Windsor tie", "bow tie"},
    "china": {"palace", "monastery", "stupa"},
    "flower": {"daisy"},
}


def photo_paths() -> dict[str, Path]:
    """Short name -> path of every known photo that is present on disk.

    A file a package version does not ship is left out rather than fetched; callers that need
    a minimum number of photos assert on the size of the result.
    """
    found: dict[str, Path] = {}
    copies = os.environ.get(PHOTOS_DIR_ENV)
    if copies:
        for name, file in {**_SKIMAGE, **_MATPLOTLIB, **_SKLEARN}.items():
            found[name] = Path(copies) / file
        return {name: path for name, path in found.items() if path.is_file()}
    import matplotlib.cbook
    import skimage
    import sklearn.datasets

    for name, file in _SKIMAGE.items():
        found[name] = Path(skimage.__file__).parent / "data" / file
    for name, file in _MATPLOTLIB.items():
        # asfileobj=False returns the path inside matplotlib's mpl-data; it never downloads.
        found[name] = Path(matplotlib.cbook.get_sample_data(file, asfileobj=False))
    for name, file in _SKLEARN.items():
        found[name] = Path(sklearn.datasets.__file__).parent / "images" / file
    return {name: path for name, path in found.items() if path.is_file()}


# (photo, width × height): different photos at different sizes, each in 4:3 or 3:4.
FIDELITY_SIZES = {
    "chelsea": (640, 480),
    "coffee": (864, 1152),
    "motorcycle": (1600, 1200),
    "china": (2048, 1536),
    "flower": (3000, 2250),
    "rocket": (3000, 4000),
}
# The fidelity photos, a portrait of another shape and a square (the tensor decode, the GPU check).
DECODE_SIZES = {**FIDELITY_SIZES, "grace_hopper": (512, 600), "astronaut": (1024, 1024)}
GRAIN_SIGMA = 3.0  # upscaled photos get a camera's noise, so JPEG treats them like photos


def photo_jpeg(name: str, size: tuple[int, int], seed: int) -> bytes:
    with Image.open(photo_paths()[name]) as source:
        rgb = source.convert("RGB").resize(size, Image.Resampling.BICUBIC)
    noise = np.random.default_rng(seed).standard_normal((size[1], size[0], 3), np.float32)
    noise *= GRAIN_SIGMA
    noise += np.asarray(rgb, dtype=np.float32)
    pixels = np.clip(noise, 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=90)
    return out.getvalue()


def png_bytes(size: tuple[int, int], value: int | None = None) -> bytes:
    """A PNG of ``size``: every pixel ``value`` (a flat grey), or noise seeded by the width."""
    rng = np.random.default_rng(size[0])
    pixels = (np.full((size[1], size[0], 3), value, np.uint8) if value is not None
              else rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8))
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()
