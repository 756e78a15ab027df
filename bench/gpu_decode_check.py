"""``bench/gpu_check.sh``'s ``gpu_decode`` stage: JPEG decode on the device against the Pillow
path, and the local engine's copy/compute overlap.

1. Parity: real photos saved as JPEG at 0.3 to 12 MP, decoded by ``decode/tensor.py`` on the
   device (nvJPEG on a GPU) and by the Pillow path; the built-in model on both must give the
   same top-5 with every score within 2e-3 (the inputs issue's tolerance). Also the device
   decode's time per image in one batch next to Pillow's, and the CPU-path refusals
   (progressive, CMYK, truncated) — those never reach the device.
2. Overlap: ``LocalEngine`` with the launch/collect split, the same batches one call at a time
   and two in flight: identical predictions, both times, and the staging buffers made (2).

A dry run does the same on the CPU (libjpeg-turbo in place of nvJPEG, no streams) with tiny
sizes: it proves the code, its figures are not GPU figures.
"""

from __future__ import annotations

import asyncio
import io
import time
from pathlib import Path
from typing import Any

Result = dict[str, Any]
MAX_SCORE_DIFF = 2e-3
MAX_PIXELS = 89_478_485


def gpu_decode(dry_run: bool, out: Path) -> Result:
    import torch
    from inboxd.config import ModelConfig
    from inboxd.models.loading import load_model

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_model(ModelConfig(device=device))
    result: Result = {"device": device, "parity": parity(model, dry_run)}
    result["overlap"] = overlap(model, dry_run)
    ok = result["parity"]["ok"] and result["overlap"]["ok"]
    result["summary"] = (f"parity {result['parity']['top5_identical']} top-5, max diff "
                         f"{result['parity']['max_score_diff']:.1e}; overlap "
                         f"{result['overlap']['speedup']}x, same results: "
                         f"{result['overlap']['same_results']}")
    result["status"] = "passed" if ok else "failed"
    return result


def parity(model: Any, dry_run: bool) -> Result:
    import torch
    from inboxd.decode import jpeg_header
    from inboxd.decode.pillow import decode_image
    from inboxd.decode.tensor import decode_batch
    from PIL import Image

    from support.photos import DECODE_SIZES as SIZES
    from support.photos import photo_jpeg, photo_paths

    photos = photo_paths()
    sizes = {n: s for n, s in SIZES.items() if n in photos}
    if dry_run:
        sizes = {n: (s[0] // 4, s[1] // 4) for n, s in list(sizes.items())[:2]}
    datas = {n: photo_jpeg(n, size, seed) for seed, (n, size) in enumerate(sizes.items())}
    headers = [jpeg_header.inspect(d, MAX_PIXELS) for d in datas.values()]
    decode_batch(list(datas.values())[:1], headers[:1], model.spec, model.device)  # warm
    _sync(model)
    started = time.perf_counter()
    crops = decode_batch(list(datas.values()), headers, model.spec, model.device)
    _sync(model)
    device_ms = (time.perf_counter() - started) * 1000 / len(datas)
    started = time.perf_counter()
    pillow = [decode_image(d, model.spec, MAX_PIXELS).pixels for d in datas.values()]
    pillow_ms = (time.perf_counter() - started) * 1000 / len(datas)
    failed = [n for n, c in zip(datas, crops, strict=True) if not isinstance(c, torch.Tensor)]
    if failed:
        return {"ok": False, "error": f"the device decoder refused {failed}",
                "top5_identical": "0", "max_score_diff": 1.0}
    ours = torch.softmax(model.outputs(crops), dim=1).cpu()
    theirs = torch.softmax(model.outputs(pillow), dim=1).cpu()
    diffs = {n: float((ours[i] - theirs[i]).abs().max()) for i, n in enumerate(datas)}
    same = sum(ours[i].topk(5).indices.tolist() == theirs[i].topk(5).indices.tolist()
               for i in range(len(datas)))
    photo = photo_jpeg("chelsea", (320, 240), 9)
    refused = {}
    for why, data in {"progressive": _resave(photo, progressive=True),
                      "cmyk": _cmyk(Image), "truncated": photo[: len(photo) // 2]}.items():
        try:
            jpeg_header.inspect(data, MAX_PIXELS)
            refused[why] = "ACCEPTED (wrong)"
        except jpeg_header.NotEligible as exc:
            refused[why] = str(exc)
    return {"ok": same == len(datas) and max(diffs.values()) <= MAX_SCORE_DIFF
            and all("wrong" not in r for r in refused.values()),
            "photos": {n: f"{w}x{h}" for n, (w, h) in sizes.items()},
            "top5_identical": f"{same}/{len(datas)}", "max_score_diff": max(diffs.values()),
            "score_diff_per_photo": {n: round(d, 6) for n, d in diffs.items()},
            "decode_ms_per_image": {"device_batch": round(device_ms, 2),
                                    "pillow_in_process": round(pillow_ms, 2)},
            "cpu_path_for": refused}


def overlap(model: Any, dry_run: bool) -> Result:
    import numpy as np
    from inboxd.item import DecodedImage, WorkItem
    from inboxd.models.engines.local import LocalEngine
    from inboxd.models.model import Classification

    batch, batches = (4, 3) if dry_run else (64, 40)
    crop = model.spec.crop
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (crop, crop, 3), dtype=np.uint8) for _ in range(batch)]

    def items(n: int) -> list[WorkItem]:
        made = []
        for k in range(batch):
            item = WorkItem(Path("/in"), f"{n}-{k}.jpg", f"{n}-{k}.jpg", "/claimed")
            item.image = DecodedImage(images[(n + k) % batch], crop, crop, "JPEG", "RGB")
            made.append(item)
        return made

    engine = LocalEngine(model, overlap=True)

    async def run(in_flight: int) -> tuple[float, list[Any]]:
        await engine.warm_up(batch)
        slots = asyncio.Semaphore(in_flight)

        async def one(n: int) -> list[Any]:
            async with slots:
                return [r.top_k[0]["label"] if isinstance(r, Classification) else repr(r)
                        for _, r in await engine.infer(items(n))]

        started = time.perf_counter()
        labels = await asyncio.gather(*(one(n) for n in range(batches)))
        return time.perf_counter() - started, labels

    try:
        sequential_s, sequential = asyncio.run(run(1))
        overlapped_s, overlapped = asyncio.run(run(2))
    finally:
        engine.close()
    assert engine.overlap is not None
    speedup = sequential_s / overlapped_s
    same = sequential == overlapped
    return {"ok": same and (dry_run or speedup >= 0.95), "same_results": same,
            "batch": batch, "batches": batches,
            "images_per_s": {"one_in_flight": round(batch * batches / sequential_s, 1),
                             "two_in_flight": round(batch * batches / overlapped_s, 1)},
            "speedup": round(speedup, 3),
            "staging_buffers": engine.overlap.staging.allocations,
            "pinned": engine.overlap.staging.pin}


def _sync(model: Any) -> None:
    import torch

    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)


def _resave(data: bytes, **save: Any) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.open(io.BytesIO(data)).save(out, "JPEG", **save)
    return out.getvalue()


def _cmyk(image_module: Any) -> bytes:
    out = io.BytesIO()
    image_module.new("CMYK", (64, 48), (10, 200, 30, 5)).save(out, "JPEG")
    return out.getvalue()
