"""Detection and several tasks per photo, measured in one run (``python -m bench.detect_tasks``).

1. **Detection against a plain script.** A YOLO-layout ONNX detector (a small convolutional
   network with random weights, exported by ``torch.onnx.export`` with a dynamic batch: its boxes
   depend on every pixel, so a different input shows) runs through ``inboxd once`` and through
   what a user would write instead: Pillow (EXIF applied), Ultralytics' letterbox, ONNX Runtime,
   ``torchvision.ops.batched_nms``. Each of the script's boxes is compared with the nearest of
   inboxd's in the letterboxed frame (inboxd's mapped back into it), with
   ``preprocess.resize: exact`` (the script's pixels) and the default ``fast`` (DCT scaling and
   a two-step resize: other pixels, so a random network's boxes move). Files/s: steady rates,
   the script's loop against inboxd's first result to its last.
2. **Two tasks in one daemon against two daemons one after the other**: ``labels`` (the built-in
   classifier) + ``things`` (the detector) as ``models:``, against ``inboxd once`` with each
   alone, in turns, on the same photos.

Photos: the bench corpus's 0.3-MP JPEGs, each also stored turned (EXIF 6) and as a portrait
crop, so every orientation and both aspects are in. Writes ``detect_tasks.json`` under --out.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from PIL import Image, ImageOps

SIDE = 320
CLASSES = 4
SCORE = 0.95  # a few boxes per photo: near-ties at a low threshold swap on any pixel change
IOU = 0.45
MAX_DET = 100
PAD = 114


def export_detector(path: Path) -> Path:
    import torch
    from torch import nn

    class Head(nn.Module):
        """conv features → per-cell cx, cy, w, h (in pixels of the SIDE² input) and scores."""

        def __init__(self) -> None:
            super().__init__()
            self.features = nn.Sequential(
                nn.Conv2d(3, 16, 3, 2, 1), nn.ReLU(), nn.Conv2d(16, 32, 3, 2, 1), nn.ReLU(),
                nn.Conv2d(32, 32, 3, 2, 1), nn.ReLU(), nn.Conv2d(32, 4 + CLASSES, 3, 2, 1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = self.features(x).flatten(2)  # N×(4+C)×A
            cells = out.shape[-1]
            grid = int(cells ** 0.5)
            index = torch.arange(cells, device=x.device, dtype=x.dtype)
            cx = ((index % grid) + torch.sigmoid(out[:, 0])) * (SIDE / grid)
            cy = ((index // grid) + torch.sigmoid(out[:, 1])) * (SIDE / grid)
            wh = torch.sigmoid(out[:, 2:4]) * (SIDE / 3)
            logits = out[:, 4:]  # standardised per image: random weights give a narrow spread
            flat = logits.flatten(1)
            z = (logits - flat.mean(1)[:, None, None]) / flat.std(1)[:, None, None]
            return torch.cat([cx[:, None], cy[:, None], wh, torch.sigmoid(z * 2)], 1)

    torch.manual_seed(0)
    network = Head().eval()
    torch.onnx.export(network, (torch.rand(2, 3, SIDE, SIDE),), str(path), dynamo=False,
                      input_names=["images"], output_names=["output0"],
                      dynamic_axes={"images": {0: "batch"}, "output0": {0: "batch"}})
    return path


def photos(folder: Path, count: int) -> list[Path]:
    from bench.photos import build_corpus

    sources = [p.path for p in build_corpus(folder / "corpus", sizes=["0.3MP"], formats=["jpg"])]
    made = folder / "photos"
    shutil.rmtree(made, ignore_errors=True)
    made.mkdir(parents=True)
    out = []
    for n in range(count):
        source = Image.open(sources[n % len(sources)]).convert("RGB")
        kind = n % 3
        if kind == 2:  # a portrait
            source = source.crop((0, 0, source.width // 2, source.height))
        exif = Image.Exif()
        exif[0x0112] = 6 if kind == 1 else 1
        stored = source.transpose(Image.Transpose.ROTATE_90) if kind == 1 else source
        path = made / f"p{n:04d}.jpg"
        stored.save(path, quality=90, exif=exif.tobytes())
        out.append(path)
    return out


def script_boxes(paths: list[Path], onnx: Path) -> tuple[dict[str, list[list[float]]], float]:
    """The plain script: letterbox + ONNX Runtime + NMS, boxes in the letterboxed frame."""
    import onnxruntime as ort
    import torch
    from torchvision.ops import batched_nms, box_convert

    session = ort.InferenceSession(str(onnx), providers=["CPUExecutionProvider"])
    started = time.perf_counter()  # the loop only: the steady rate, as inboxd's below
    found = {}
    for path in paths:
        image = ImageOps.exif_transpose(Image.open(path)).convert("RGB")
        gain = min(SIDE / image.width, SIDE / image.height)
        w, h = round(image.width * gain), round(image.height * gain)
        canvas = Image.new("RGB", (SIDE, SIDE), (PAD, PAD, PAD))
        canvas.paste(image.resize((w, h), Image.Resampling.BILINEAR),
                     (round((SIDE - w) / 2 - 0.1), round((SIDE - h) / 2 - 0.1)))
        batch = np.asarray(canvas, np.float32).transpose(2, 0, 1)[None] / 255
        out = torch.from_numpy(session.run(None, {"images": batch})[0])[0].T
        scores, classes = out[:, 4:].max(1)
        keep = scores > SCORE
        boxes = box_convert(out[keep, :4], "cxcywh", "xyxy")
        kept = batched_nms(boxes, scores[keep], classes[keep], IOU)[:MAX_DET]
        found[path.name] = boxes[kept].tolist()
    return found, time.perf_counter() - started


def once(root: Path, paths: list[Path], models: dict[str, Any],
         **sections: Any) -> tuple[float, Path]:
    """``inboxd once`` over ``paths`` with a models: block; seconds from start to exit."""
    shutil.rmtree(root, ignore_errors=True)
    (root / "inbox").mkdir(parents=True)
    for path in paths:
        shutil.copyfile(path, root / "inbox" / path.name)
    config = {"inbox": {"paths": [str(root / "inbox")], "settle_ms": 0},
              "results_dir": str(root / "results"), "done_dir": str(root / "done"),
              "failed_dir": str(root / "failed"), "models": models, **sections}
    (root / "inboxd.yaml").write_text(yaml.safe_dump(config))
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "inboxd", "once", "-c",
                           str(root / "inboxd.yaml")], cwd=root, capture_output=True, text=True,
                          check=False)
    elapsed = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    return elapsed, root / "results"


def steady_files_per_s(results: Path) -> float:
    """From the first result to the last (start-up left out, as for the script's loop)."""
    stamps = sorted(p.stat().st_mtime for p in results.glob("*.json"))
    return (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else 0.0


def in_letterbox(box: list[float], width: int, height: int) -> list[float]:
    from inboxd.decode.spec import fit_size
    from inboxd.models.detect.geometry import placement

    w, h = fit_size(width, height, SIDE)
    where = placement(w, h, SIDE)
    x0, y0, x1, y1 = box
    return [x0 * w / width + where.left, y0 * h / height + where.top,
            x1 * w / width + where.left, y1 * h / height + where.top]


def compare(results: Path, reference: dict[str, list[list[float]]]) -> dict[str, Any]:
    gaps, boxes, unmatched = [], 0, 0
    for name, theirs in reference.items():
        result = json.loads((results / f"{name}.json").read_text())
        width, height = result["image"]["width"], result["image"]["height"]
        ours = [in_letterbox(d["box"], width, height) for d in result["things"]["detections"]]
        boxes += len(theirs)
        x0, y0, x1, y1 = in_letterbox([0, 0, width, height], width, height)
        for raw in theirs:  # each of the script's boxes, clipped to the photo as inboxd's are
            box = [min(max(raw[0], x0), x1), min(max(raw[1], y0), y1),
                   min(max(raw[2], x0), x1), min(max(raw[3], y0), y1)]
            gap = min((max(abs(a - b) for a, b in zip(box, other, strict=True))
                       for other in ours), default=float("inf"))
            gaps.append(gap)
            unmatched += gap > 1.0
    return {"script_boxes": boxes, "within_1px": boxes - unmatched,
            "max_gap_px": round(max(gaps, default=0.0), 3),
            "median_gap_px": round(float(np.median(gaps)) if gaps else 0.0, 4)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/out"))
    parser.add_argument("--files", type=int, default=60)
    parser.add_argument("--turns", type=int, default=2)
    args = parser.parse_args()
    work = args.out / "detect_tasks"
    work.mkdir(parents=True, exist_ok=True)
    onnx = export_detector(work / "detector.onnx")
    paths = photos(work, args.files)
    things = {"onnx": str(onnx.resolve()), "output": "detect",
              "detect": {"score_threshold": SCORE, "iou_threshold": IOU,
                         "max_detections": MAX_DET}, "labels": str(work / "labels.txt")}
    (work / "labels.txt").write_text("\n".join(f"c{n}" for n in range(CLASSES)) + "\n")
    labels = {"name": "efficientnet_lite0", "runtime": "torch", "precision": "fp32"}
    rows: list[dict[str, Any]] = []
    for turn in range(args.turns):
        reference, script_s = script_boxes(paths, onnx)
        detect_s, results = once(work / "run-things", paths, {"things": things})
        default = compare(results, reference)  # preprocess.resize: fast (the default)
        steady = steady_files_per_s(results)
        _, exact = once(work / "run-exact", paths, {"things": things},
                        preprocess={"resize": "exact"})
        agreement = compare(exact, reference)  # the same pixels as the script's
        labels_s, _ = once(work / "run-labels", paths, {"labels": labels})
        both_s, both = once(work / "run-both", paths, {"labels": labels, "things": things})
        rows.append({"turn": turn, "script_files_per_s": round(len(paths) / script_s, 2),
                     "inboxd_files_per_s": round(steady, 2),
                     "ratio": round(steady / (len(paths) / script_s), 2),
                     "exact": agreement, "fast": default, "labels_alone_s": round(labels_s, 2),
                     "things_alone_s": round(detect_s, 2), "both_in_one_s": round(both_s, 2),
                     "two_daemons_s": round(labels_s + detect_s, 2),
                     "saving": round(1 - both_s / (labels_s + detect_s), 3),
                     "both_agree_fast": compare(both, reference)["within_1px"]})
        print(json.dumps(rows[-1]))
    (args.out / "detect_tasks.json").write_text(json.dumps(
        {"files": len(paths), "side": SIDE, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
