"""The pixels the model gets are torchvision's: Resize + CenterCrop on the decoded PIL image.

The built-in network (real ImageNet weights, offline) is run twice on real photos saved as
JPEG at 0.3 to 12 MP: once as the daemon feeds it (``decode_image``, then the model's own
normalisation), once as torchvision would (``transforms.Resize(256, bicubic) +
CenterCrop(224) + ToTensor + Normalize`` on ``Image.open(...).convert("RGB")``). Top-5 must be
identical and every one of the 1000 scores within 2e-3. JPEG draft decoding at a scale close
to the target (the old behaviour) fails this: it swaps the antialiased resize for DCT scaling.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from inboxd.config import ModelConfig
from inboxd.decode.pillow import decode_image
from inboxd.models.loading import load_model
from inboxd.models.model import Model
from PIL import Image
from torchvision import transforms

from tests.photos import photo_paths

# (photo, width × height): different photos at different sizes, each in 4:3 or 3:4.
SIZES = {
    "chelsea": (640, 480),
    "coffee": (864, 1152),
    "motorcycle": (1600, 1200),
    "china": (2048, 1536),
    "flower": (3000, 2250),
    "rocket": (3000, 4000),
}
GRAIN_SIGMA = 3.0  # upscaled photos get a camera's noise, so JPEG treats them like photos
MAX_SCORE_DIFF = 2e-3


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


@pytest.fixture(scope="module")
def model() -> Model:
    return load_model(ModelConfig(device="cpu"))


@pytest.mark.slow
def test_top5_and_scores_match_torchvisions_transforms(model: Model) -> None:
    spec = model.spec
    reference = transforms.Compose([
        transforms.Resize(spec.resize, transforms.InterpolationMode(spec.interpolation)),
        transforms.CenterCrop(spec.crop),
        transforms.ToTensor(),
        transforms.Normalize(spec.mean, spec.std),
    ])
    datas = {name: photo_jpeg(name, size, seed) for seed, (name, size) in enumerate(SIZES.items())}
    refs = []
    for data in datas.values():
        with Image.open(io.BytesIO(data)) as image:
            refs.append(reference(image.convert("RGB")))
    with torch.inference_mode():
        expected = torch.softmax(model.network(torch.stack(refs)), dim=1)
    ours = torch.softmax(model.outputs(
        [decode_image(data, spec, 89_478_485).pixels for data in datas.values()]), dim=1)
    for n, name in enumerate(datas):
        diff = float((ours[n] - expected[n]).abs().max())
        assert diff <= MAX_SCORE_DIFF, f"{name} {SIZES[name]}: scores differ by {diff:.2e}"
        assert ours[n].topk(5).indices.tolist() == expected[n].topk(5).indices.tolist(), name
