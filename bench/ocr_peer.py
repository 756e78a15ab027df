"""The OCR peer: RapidOCR's own API called in a loop, what a user would write instead of
``model: {name: ocr}``. Same networks (the rapidocr-onnxruntime 1.4.4 wheel's), ONNX Runtime
with 2 intra-op threads, and all the durable work inboxd does: each file read and hashed, its
EXIF orientation applied (RapidOCR's own loader ignores it), its result written to a temp file,
fsynced, renamed into place and the folder fsynced, then the file moved to ``done/``.

    python -m bench.ocr_peer --inbox DIR --results DIR --done DIR

Prints one JSON line: files, seconds from the first file taken to the last result, and the
per-file lines read.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import time
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps


def write_durably(path: Path, document: dict[str, object]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as out:
        json.dump(document, out)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)
    folder = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--inbox", type=Path, required=True)
    parser.add_argument("--results", type=Path, required=True)
    parser.add_argument("--done", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    from rapidocr_onnxruntime import RapidOCR

    engine = RapidOCR(intra_op_num_threads=args.threads, inter_op_num_threads=1)
    engine(np.full((64, 64, 3), 255, np.uint8))  # sessions warmed, as inboxd's are at READY
    args.results.mkdir(parents=True, exist_ok=True)
    args.done.mkdir(parents=True, exist_ok=True)
    names = sorted(p.name for p in args.inbox.iterdir() if not p.name.startswith("."))
    lines: dict[str, list[str]] = {}
    started = time.monotonic()
    for name in names:
        data = (args.inbox / name).read_bytes()
        with Image.open(io.BytesIO(data)) as opened:
            rgb = np.asarray(ImageOps.exif_transpose(opened).convert("RGB"))
        found, _ = engine(np.ascontiguousarray(rgb[:, :, ::-1]))
        texts = [str(line[1]) for line in found or []]
        write_durably(args.results / f"{name}.json", {
            "source": name, "sha256": hashlib.sha256(data).hexdigest(),
            "lines": [{"text": str(line[1]), "score": float(line[2]), "polygon": line[0]}
                      for line in found or []]})
        os.rename(args.inbox / name, args.done / name)
        lines[name] = texts
    seconds = time.monotonic() - started
    print(json.dumps({"files": len(names), "seconds": round(seconds, 3), "lines": lines}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
