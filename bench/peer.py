"""The peer: the script a competent user would write in an afternoon instead of running inboxd.

It is the way Immich's machine-learning service runs a classifier on a CPU: libvips
``thumbnail`` (shrink-on-load: a JPEG is decoded at 1/2, 1/4 or 1/8 scale straight from the DCT)
to the model's input, then ONNX Runtime's CPU execution provider in fp32 with 2 intra-op
threads, batches of 8, and one JSON per file written plainly (no temp file, no fsync: it has no
durability, no claims, no hashes, no bounds, no isolation; that is the point). It moves nothing.

The model is inboxd's built-in EfficientNet-Lite0 exactly as inboxd loads it (BatchNorm
folded), exported once with ``torch.onnx.export(dynamo=True)`` and a dynamic batch dimension;
the export is cached under ``bench/out/peer/`` keyed by the weights file's hash and the torch
and onnx versions. The input matches what that model expects: shorter side resized to 256,
centre crop 224, RGB, (x - 0.5) / 0.5. libvips does the first two in one call:
``thumbnail(256 × 256, crop="centre")`` scales the shorter side to 256 and keeps its centre
256 × 256, whose centre 224 × 224 is the same crop. libvips' resampling kernel (lanczos3 for
reductions) is not torchvision's bicubic; top-1 agreement with inboxd is tested
(``bench/test_peer.py``).

HEIC: the ``pyvips-binary`` wheel's libheif has no HEVC decoder (patents), so libvips cannot read
a HEIC from pip. The afternoon fix is ``pillow_heif`` (libheif + libde265, which decodes on its
own threads) to an array, then the same libvips ``thumbnail_image``; there is no shrink-on-load
for HEVC in either library.

Concurrency, chosen and why: a pool of 2 decode threads (one per core, the
``ThreadPoolExecutor`` idiom) kept at most three batches ahead of the model, which runs in the
main thread. The plain loop (decode 8, run 8) is the first thing anyone writes, but ``top``
shows it at one core of two while it decodes: libvips' JPEG shrink-on-load is libjpeg's
sequential decode (its CPU time equals its wall time with ``VIPS_CONCURRENCY`` 1 or 2), and a
12-MP JPEG costs about 3× the model's CPU per image, so a competent user overlaps decoding with
ONNX Runtime (Immich's service gets the same from handling requests on a thread pool) and sizes
the pool to the cores; pyvips releases the GIL in libvips. The look-ahead is bounded so a big
folder is not decoded into memory at once. ``--decoders 0`` runs the plain loop and
``--decoders 1`` a single prefetch thread, for anyone who wants those figures too.

    python -m bench.peer export                        # once: writes and prints the .onnx path
    python -m bench.peer run INBOX RESULTS [--batch 8] [--threads 2] [--decoders 2]

``run`` prints one JSON line at the end: files, failures, and its own first→last result span.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

BENCH_DIR = Path(__file__).resolve().parent
MODEL_DIR = BENCH_DIR / "out" / "peer"
RESIZE, CROP = 256, 224
OFFSET = (RESIZE - CROP) // 2
TOP_K = 5
DECODERS = 2
HEIF_SUFFIXES = (".heic", ".heif")
SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".tif", ".tiff", ".gif", ".avif", *HEIF_SUFFIXES)


# -- the one-time export ---------------------------------------------------------------------


def model_key() -> str:
    """What the exported file depends on: the weights' bytes and the exporter's versions."""
    import onnx
    import torch
    from inboxd.models.efficientnet_lite import builtin_weights_path

    digest = hashlib.sha256(builtin_weights_path().read_bytes()).hexdigest()[:16]
    return f"{digest}-torch{torch.__version__}-onnx{onnx.__version__}".replace("+", "_")


def ensure_model(folder: Path = MODEL_DIR) -> Path:
    """The built-in model as ONNX (plus ``labels.json`` beside it), exported when missing."""
    target = folder / model_key() / "efficientnet_lite0.onnx"
    if target.is_file() and (target.parent / "labels.json").is_file():
        return target
    import torch
    from inboxd.models.model import imagenet_labels
    from inboxd.models.sources import builtin

    network = builtin().network.eval()  # BatchNorm folded: the network inboxd runs
    target.parent.mkdir(parents=True, exist_ok=True)
    example = torch.zeros(2, 3, CROP, CROP)
    # A name of this process's own: two exports at once (test runs, a bench) must not share it.
    partial = target.with_suffix(f".{os.getpid()}.partial")
    program = torch.onnx.export(network, (example,), dynamo=True, input_names=["pixels"],
                                output_names=["logits"],
                                dynamic_shapes=({0: torch.export.Dim("batch", max=1024)},))
    assert program is not None
    program.save(str(partial))
    labels = target.parent / f"labels.json.{os.getpid()}.partial"
    labels.write_text(json.dumps(imagenet_labels()))
    labels.rename(target.parent / "labels.json")
    partial.rename(target)
    return target


# -- the script ------------------------------------------------------------------------------


def load_pixels(path: str) -> npt.NDArray[np.uint8]:
    """224 × 224 × 3 uint8 RGB: shorter side to 256 and centre 224, shrinking on load."""
    import pyvips

    if path.lower().endswith(HEIF_SUFFIXES):
        import pillow_heif

        heif = pillow_heif.open_heif(path, convert_hdr_to_8bit=True)
        decoded = np.asarray(heif)
        image = pyvips.Image.new_from_array(decoded, interpretation="srgb")
        image = image.thumbnail_image(RESIZE, height=RESIZE, crop="centre")
    else:
        image = pyvips.Image.thumbnail(path, RESIZE, height=RESIZE, crop="centre")
    if image.hasalpha():
        image = image.flatten()
    if image.bands == 1:
        image = image.colourspace("srgb")
    pixels: npt.NDArray[np.uint8] = image.crop(OFFSET, OFFSET, CROP, CROP).numpy()
    return pixels


class Peer:
    def __init__(self, model: Path, threads: int) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        self.session = ort.InferenceSession(str(model), options,
                                            providers=["CPUExecutionProvider"])
        self.labels: list[str] = json.loads((model.parent / "labels.json").read_text())

    def classify(self, crops: list[npt.NDArray[np.uint8]]) -> list[list[dict[str, Any]]]:
        batch = np.stack(crops).transpose(0, 3, 1, 2).astype(np.float32) / 127.5 - 1.0
        (logits,) = self.session.run(None, {"pixels": batch})
        exp = np.exp(logits - logits.max(axis=1, keepdims=True))
        scores = exp / exp.sum(axis=1, keepdims=True)
        top = np.argsort(-scores, axis=1)[:, :TOP_K]
        return [[{"label": self.labels[i], "index": int(i), "score": round(float(row[i]), 6)}
                 for i in indices] for row, indices in zip(scores, top, strict=True)]


Decoded = tuple[str, "npt.NDArray[np.uint8] | Exception"]


def decode(inbox: Path, name: str) -> Decoded:
    try:
        return name, load_pixels(os.path.join(inbox, name))
    except Exception as exc:  # one bad file is that file's failure, as in inboxd
        return name, exc


def batches(names: list[str], inbox: Path, size: int, decoders: int) -> Iterator[list[Decoded]]:
    """Decoded batches in order: in this thread (``decoders`` 0), or on a pool of ``decoders``
    threads kept two batches ahead of the model (bounded, so a big folder is not decoded into
    memory all at once)."""
    if decoders == 0:
        for start in range(0, len(names), size):
            yield [decode(inbox, name) for name in names[start:start + size]]
        return
    with ThreadPoolExecutor(decoders, thread_name_prefix="peer-decode") as pool:
        ahead: collections.deque[Future[Decoded]] = collections.deque()
        queued = 0
        while ahead or queued < len(names):
            while queued < len(names) and len(ahead) < 3 * size:
                ahead.append(pool.submit(decode, inbox, names[queued]))
                queued += 1
            yield [ahead.popleft().result() for _ in range(min(size, len(ahead)))]


def run(inbox: Path, results: Path, model: Path, batch: int, threads: int,
        decoders: int) -> dict[str, Any]:
    peer = Peer(model, threads)
    results.mkdir(parents=True, exist_ok=True)
    names = sorted(n for n in os.listdir(inbox) if n.lower().endswith(SUFFIXES))
    written = failed = 0
    first_s = last_s = None
    loop_cpu_s = time.process_time()  # this process's CPU, every thread, from here on
    for decoded in batches(names, inbox, batch, decoders):
        good = [(name, pixels) for name, pixels in decoded if isinstance(pixels, np.ndarray)]
        failed += len(decoded) - len(good)
        top_ks = peer.classify([pixels for _, pixels in good]) if good else []
        for (name, pixels), top_k in zip(good, top_ks, strict=True):
            document = {"source": name, "model": "efficientnet_lite0", "runtime": "onnxruntime",
                        "top_k": top_k, "image": {"crop": list(pixels.shape[:2])}}
            with open(results / f"{name}.json", "w") as out:
                json.dump(document, out)
            written += 1
        if good:
            last_s = time.monotonic()
            first_s = first_s or last_s
    span_s = (last_s - first_s) if first_s is not None and last_s is not None else 0.0
    return {"files": written, "failed": failed, "first_to_last_s": round(span_s, 3),
            "cpu_s": round(time.process_time() - loop_cpu_s, 3),  # every file, model loaded
            "batch": batch, "threads": threads, "decoders": decoders}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    export = sub.add_parser("export", help="export the built-in model to ONNX (cached)")
    export.add_argument("--folder", type=Path, default=MODEL_DIR)
    go = sub.add_parser("run", help="classify every image in INBOX into RESULTS/<name>.json")
    go.add_argument("inbox", type=Path)
    go.add_argument("results", type=Path)
    go.add_argument("--model", type=Path, default=None, help="the .onnx (default: export)")
    go.add_argument("--batch", type=int, default=8)
    go.add_argument("--threads", type=int, default=2, help="ONNX Runtime intra-op threads")
    go.add_argument("--decoders", type=int, default=DECODERS,
                    help="decode threads ahead of the model (0: decode in the model's thread)")
    args = parser.parse_args()
    if args.command == "export":
        print(ensure_model(args.folder))
        return 0
    model = args.model or ensure_model()
    summary = run(args.inbox, args.results, model, args.batch, args.threads, args.decoders)
    sys.stdout.write(json.dumps(summary) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
