"""The device check's detection stage: a torchvision detector through inboxd on the device,
against its own direct call in CPU fp32 on the same pixels, and its images/s.

The detector is ``ssdlite320_mobilenet_v3_large`` with random weights whose BatchNorm
statistics are measured on random images (left at their init, the network's output would not
depend on the photo, and the comparison could not see a wrong input). Boxes are compared best
first, each reference box matched to the nearest of inboxd's of the same class: the stage
passes when every reference box above the threshold has one within ``MAX_BOX_PX`` px.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

ARCHITECTURE = "ssdlite320_mobilenet_v3_large"
THRESHOLD = 0.03
MAX_DETECTIONS = 50
MAX_BOX_PX = 1.0
MAX_PIXELS = 89_478_485


def calibrated_weights(path: Path, images: int = 8) -> Path:
    import torch
    import torchvision

    torch.manual_seed(0)
    network = torchvision.models.get_model(ARCHITECTURE, weights=None, weights_backbone=None,
                                           num_classes=91)
    for module in network.modules():
        if isinstance(module, torch.nn.BatchNorm2d):
            module.momentum = None
            module.reset_running_stats()
    network.train()
    with torch.no_grad():
        batch = network.transform([torch.rand(3, 320, 320) for _ in range(images)])[0].tensors
        network.head(list(network.backbone(batch).values()))
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(network.state_dict(), path)
    return path


def matched(reference: Any, ours: Any) -> tuple[int, float]:
    """(reference boxes with a same-class box of ours within MAX_BOX_PX, the largest gap)."""
    hits, worst = 0, 0.0
    for box, label in zip(reference["boxes"].tolist(), reference["labels"].tolist(),
                          strict=True):
        gaps = [max(abs(a - b) for a, b in zip(box, other, strict=True))
                for other, index in zip(ours.boxes, ours.indices, strict=True)
                if index == label]
        gap = min(gaps, default=float("inf"))
        worst = max(worst, gap)
        hits += gap <= MAX_BOX_PX
    return hits, worst


def detection(dry_run: bool, out: Path) -> dict[str, Any]:
    import torch
    import torchvision
    from inboxd.config import DetectConfig, ModelConfig
    from inboxd.decode.pillow import decode_image
    from inboxd.models.detect.geometry import Detections
    from inboxd.models.loading import load_model

    from bench.photos import jpegs

    if not dry_run and not torch.cuda.is_available():
        return {"status": "failed", "error": "no CUDA GPU"}
    device = "cpu" if dry_run else "cuda"
    weights = calibrated_weights(out / "work" / "detection" / "ssdlite.pth",
                                 2 if dry_run else 8)
    model = load_model(ModelConfig(torchvision=ARCHITECTURE, weights=weights, output="detect",
                                   device=device,
                                   detect=DetectConfig(score_threshold=THRESHOLD,
                                                       max_detections=MAX_DETECTIONS)))
    photos = jpegs(out)[: 1 if dry_run else 8]
    images = [decode_image(p.read_bytes(), model.spec, MAX_PIXELS) for p in photos]
    started = time.perf_counter()
    found = model.predict([image.pixels for image in images])
    first_s = time.perf_counter() - started
    reference_net = torchvision.models.get_model(ARCHITECTURE, weights=None,
                                                 weights_backbone=None, num_classes=91)
    reference_net.load_state_dict(torch.load(weights, weights_only=True))
    reference_net.eval()
    with torch.inference_mode():
        direct = reference_net([torch.from_numpy(i.pixels.copy()).permute(2, 0, 1).float() / 255
                                for i in images])
    boxes = hits = 0
    worst = 0.0
    for call, ours in zip(direct, found, strict=True):
        assert isinstance(ours, Detections)
        keep = call["scores"] > THRESHOLD
        order = call["scores"][keep].argsort(descending=True)[:MAX_DETECTIONS]
        best = {k: v[keep][order] for k, v in call.items()}
        got, gap = matched(best, ours)
        boxes, hits, worst = boxes + len(best["boxes"]), hits + got, max(worst, gap)
    batch = [image.pixels for image in images] * (1 if dry_run else 4)
    if dry_run:  # proves the code, not a rate: the one call above, timed
        per_s = len(images) / first_s
    else:
        rounds = 5
        started = time.perf_counter()
        for _ in range(rounds):
            model.predict(batch)
        torch.cuda.synchronize()
        per_s = rounds * len(batch) / (time.perf_counter() - started)
    result = {"device": device, "photos": len(images), "reference_boxes": boxes,
              "matched_within_1px": hits, "worst_gap_px": round(worst, 4),
              "images_per_s": round(per_s, 1), "batch": len(batch),
              "summary": f"{hits}/{boxes} boxes within {MAX_BOX_PX} px of CPU fp32, "
                         f"{per_s:.1f} images/s at batch {len(batch)} on {device}"}
    ok = boxes > 0 and hits == boxes
    return {**result, "status": "passed" if ok else "failed",
            **({} if ok else {"error": f"{boxes - hits} reference boxes without a match"})}
