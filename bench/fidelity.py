"""Fidelity against torchvision's transforms, and JPEG decode speed, per draft margin.

For every JPEG in the bench corpus (real photos at 0.3, 1, 3 and 12 MP): the built-in model's
softmax on inboxd's pixels (``decode_image``) against the same model on torchvision's
``Resize(256, bicubic) + CenterCrop(224)`` of the fully decoded PIL image. Reported per
``DRAFT_MARGIN``: decode ms per megapixel (median of repeats), the largest score difference
over all 1000 classes, and whether every top-5 is identical. Margin 1 is the old behaviour
(draft right down to the resize target).

    python -m bench.fidelity [--margins 1 2 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from inboxd.decode import pillow
from inboxd.decode.spec import PreprocessSpec
from inboxd.models import efficientnet_lite as lite
from PIL import Image
from torchvision import transforms

from bench.photos import build_corpus

SPEC = PreprocessSpec(resize=lite.RESIZE_SHORTER_SIDE, crop=lite.CROP_SIZE,
                      interpolation="bicubic", mean=lite.MEAN, std=lite.STD)
REFERENCE = transforms.Compose([
    transforms.Resize(lite.RESIZE_SHORTER_SIDE, transforms.InterpolationMode.BICUBIC),
    transforms.CenterCrop(lite.CROP_SIZE),
    transforms.ToTensor(),
    transforms.Normalize(lite.MEAN, lite.STD),
])
MAX_PIXELS = 89_478_485


def reference_input(path: Path) -> torch.Tensor:
    """What torchvision gives a model trained with these transforms."""
    with Image.open(path) as image:
        tensor: torch.Tensor = REFERENCE(image.convert("RGB"))
    return tensor


def inboxd_input(data: bytes) -> torch.Tensor:
    pixels = pillow.decode_image(data, SPEC, MAX_PIXELS).pixels
    x = torch.from_numpy(np.ascontiguousarray(pixels)).permute(2, 0, 1).float() / 255.0
    mean = torch.tensor(lite.MEAN).view(3, 1, 1)
    std = torch.tensor(lite.STD).view(3, 1, 1)
    return (x - mean) / std


def scores(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return torch.softmax(model(batch), dim=1)


def decode_ms_per_mp(data: bytes, megapixels: float, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        pillow.decode_image(data, SPEC, MAX_PIXELS)
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times) / megapixels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--margins", type=float, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench/out/photos"))
    args = parser.parse_args()
    photos = build_corpus(args.out, formats=["jpg"])
    model = lite.load_efficientnet_lite0().eval()
    reference = scores(model, torch.stack([reference_input(p.path) for p in photos]))
    ref_top5 = reference.topk(5).indices
    sizes = sorted({p.size for p in photos}, key=lambda s: float(s.rstrip("MP")))
    print(f"{len(photos)} JPEGs; decode ms/MP by size; score diff vs torchvision")
    print("margin | " + " | ".join(sizes) + " | max score diff | top-5 identical")
    for margin in args.margins:
        pillow.DRAFT_MARGIN = margin  # type: ignore[assignment]
        datas = [p.path.read_bytes() for p in photos]
        ours = scores(model, torch.stack([inboxd_input(d) for d in datas]))
        diff = float((ours - reference).abs().max())
        same = int((ours.topk(5).indices == ref_top5).all(dim=1).sum())
        per_size = {size: statistics.median(
            decode_ms_per_mp(d, p.megapixels, args.repeats)
            for p, d in zip(photos, datas, strict=True) if p.size == size) for size in sizes}
        print(f"{margin:g} | " + " | ".join(f"{per_size[s]:.1f}" for s in sizes)
              + f" | {diff:.2e} | {same}/{len(photos)}")


if __name__ == "__main__":
    main()
