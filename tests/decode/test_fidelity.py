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

import pytest
import torch
from inboxd.config import ModelConfig
from inboxd.decode.pillow import decode_image
from inboxd.models.loading import load_model
from inboxd.models.model import Model
from PIL import Image
from torchvision import transforms

from support.photos import FIDELITY_SIZES as SIZES
from support.photos import photo_jpeg

MAX_SCORE_DIFF = 2e-3


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
