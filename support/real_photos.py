"""Real camera photos at their native resolution for the fidelity corpus: the photographs among
Debian's desktop wallpapers, cropped and re-encoded, never upscaled.

The wheel photos of ``support/corpus.py`` are under 1 MP, so its large variants are upscaled and
carry no detail above the source's resolution; a decode that throws detail away (DCT scaling,
shrink-on-load) looks harmless on them. These 20 photographs (1920×1200 to 2560×1600, shot by
cameras: landscapes, macro, water, texture) keep theirs. The packages come through apt
(``apt-get download``, no root needed to unpack: ``dpkg -x``) into ``var/real-photos/``; the
drawings and renders in the same packages are left out by name.

Each photo gets ``VARIANTS_PER_PHOTO`` variants: a seeded crop window of 25-100% of the frame at
native pixels, an EXIF-orientation share, JPEG at several qualities and chroma subsamplings
(some progressive). Built once into ``var/corpus/real-<key>/`` (the key hashes the recipe, the
package versions and Pillow's), like the upscaled corpus, and raced the same way.

    python -m support.real_photos   # fetch, build (or find) and summarise
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import numpy as np
from PIL import Image

from support.corpus import ORIENTATION_TAG, Variant, build_into, corpus_dir

ROOT = Path(__file__).resolve().parents[1] / "var" / "real-photos"
PACKAGES = ("plasma-workspace-wallpapers", "mate-backgrounds")
RECIPE_VERSION = 1
VARIANTS_PER_PHOTO = 8
MIN_AREA, MAX_AREA = 0.25, 1.0
JPEG_QUALITIES = (70, 80, 90, 95)
JPEG_SUBSAMPLINGS = ("4:4:4", "4:2:2", "4:2:0")
PROGRESSIVE_SHARE = 0.25
EXIF_SHARE = 0.25
_PLASMA = "usr/share/wallpapers/{}/contents/images/2560x1600.jpg"
_MATE = "usr/share/backgrounds/mate/nature/{}.jpg"
# The photographs, by look: the packages' paintings, renders and logos are not listed.
PHOTOS = {
    **{name.lower(): _PLASMA.format(name) for name in (
        "BytheWater", "ColdRipple", "ColorfulCups", "DarkestHour", "EveningGlow", "FallenLeaf",
        "Grey", "Kite", "OneStandsOut", "Path", "summer_1am")},
    **{name.lower(): _MATE.format(name) for name in (
        "Aqua", "Blinds", "Garden", "LadyBird", "RainDrops", "Storm", "TwoWings", "Wood",
        "YellowFlower")},
}
# EXIF orientation -> the transpose that, stored, the decoder's exif_transpose undoes.
_STORED_FOR_ORIENTATION = {3: Image.Transpose.ROTATE_180, 6: Image.Transpose.ROTATE_90,
                           8: Image.Transpose.ROTATE_270}


def unavailable() -> str | None:
    """Why the photos cannot be had here, or None."""
    if (ROOT / "x").is_dir() or (shutil.which("apt-get") and shutil.which("dpkg")):
        return None
    return "apt-get and dpkg are not available (a Debian/Ubuntu host fetches the photos)"


def fetch() -> Path:
    """The unpacked packages (downloaded and unpacked once)."""
    unpacked = ROOT / "x"
    if (unpacked / ".complete").is_file():
        return unpacked
    debs = ROOT / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    if len(list(debs.glob("*.deb"))) < len(PACKAGES):
        download = ["apt-get", "download", *PACKAGES]
        if subprocess.run(download, cwd=debs, capture_output=True, check=False).returncode:
            # A fresh container has no package lists yet: root can fetch them.
            if os.geteuid() != 0:
                raise RuntimeError(f"`{' '.join(download)}` failed: run `sudo apt-get update` "
                                   "and try again")
            subprocess.run(["apt-get", "update", "-qq"], check=True, capture_output=True)
            subprocess.run(download, cwd=debs, check=True, capture_output=True)
    partial = ROOT / f"x.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    for deb in sorted(debs.glob("*.deb")):
        subprocess.run(["dpkg", "-x", str(deb), str(partial)], check=True)
    (partial / ".complete").write_text(json.dumps(versions(debs)))
    try:
        partial.rename(unpacked)
    except OSError:  # another builder got there first
        shutil.rmtree(partial, ignore_errors=True)
    return unpacked


def versions(debs: Path) -> list[str]:
    return sorted(deb.name for deb in debs.glob("*.deb"))


def corpus_key(unpacked: Path) -> str:
    import PIL

    recipe = [RECIPE_VERSION, VARIANTS_PER_PHOTO, MIN_AREA, MAX_AREA, JPEG_QUALITIES,
              JPEG_SUBSAMPLINGS, PROGRESSIVE_SHARE, EXIF_SHARE, sorted(PHOTOS.items()),
              (unpacked / ".complete").read_text(), PIL.__version__, np.__version__]
    return hashlib.sha256(json.dumps(recipe).encode()).hexdigest()[:16]


def _make(name: str, source: Path, index: int, variant: int) -> tuple[bytes, Variant]:
    rng = np.random.default_rng([RECIPE_VERSION, index, variant])
    with Image.open(source) as opened:
        image = opened.convert("RGB")
    width, height = image.size
    area = rng.uniform(MIN_AREA, MAX_AREA) * width * height if variant else width * height
    aspect = math.exp(rng.uniform(math.log(0.56), math.log(1.8)))
    new_w = min(width, max(256, round(math.sqrt(area * aspect))))
    new_h = min(height, max(256, round(math.sqrt(area / aspect))))
    left = int(rng.integers(0, width - new_w + 1))
    top = int(rng.integers(0, height - new_h + 1))
    image = image.crop((left, top, left + new_w, top + new_h))
    exif = Image.Exif()
    geometry = "crop"
    if rng.random() < EXIF_SHARE:
        orientation = int(rng.choice(sorted(_STORED_FOR_ORIENTATION)))
        image = image.transpose(_STORED_FOR_ORIENTATION[orientation])
        exif[ORIENTATION_TAG] = orientation
        geometry = "exif"
    quality = int(rng.choice(JPEG_QUALITIES))
    subsampling = str(rng.choice(JPEG_SUBSAMPLINGS))
    out = io.BytesIO()
    image.save(out, "JPEG", quality=quality, subsampling=subsampling, exif=exif,
               progressive=bool(rng.random() < PROGRESSIVE_SHARE))
    data = out.getvalue()
    return data, Variant(f"{name}-{variant:02d}.jpg", name, geometry, "JPEG", quality,
                         subsampling, image.width, image.height, len(data), origin="real")


def build() -> tuple[Path, list[Variant]]:
    """The real-photo corpus folder and its variants, fetching and building them first when
    they are not there yet."""
    unpacked = fetch()
    folder = corpus_dir().with_name(f"real-{corpus_key(unpacked)}")
    return build_into(folder, {name: unpacked / relative for name, relative in PHOTOS.items()},
                      VARIANTS_PER_PHOTO, _make)


def main() -> None:
    folder, variants = build()
    print(f"{len(variants)} real-photo variants in {folder}")
    print("megapixels:", dict(sorted(Counter(round(v.megapixels, 1) for v in variants).items())))
    print("subsamplings:", dict(Counter(v.subsampling for v in variants)))
    print(f"bytes: {sum(v.nbytes for v in variants) / 1e6:.0f} MB")


if __name__ == "__main__":
    main()
