"""``bench/gpu_check.sh``'s OCR stage: ``model: {name: ocr}`` loaded as the daemon loads it on
the device (ONNX Runtime's CUDA provider where the installed onnxruntime has it, else the CPU
with the note the ``started`` record carries), reading rendered text through inboxd's decoder:
"Total 348.20 EUR" exactly, upright and stored turned (EXIF 6), and the rest of a small
generated set for the time per image.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

EXPECTED = "Total 348.20 EUR"


def ocr(dry_run: bool, out: Path) -> dict[str, Any]:
    import torch

    try:
        import cv2  # noqa: F401
        import pyclipper  # noqa: F401
        from inboxd.models.ocr.assets import find_assets

        find_assets()
    except Exception as exc:  # a missing package or wheel: the stage cannot run here
        return {"status": "skipped", "reason": f"the OCR stack is not installed here ({exc})"}
    from inboxd.config import ModelConfig
    from inboxd.decode.pillow import decode_image
    from inboxd.models.ocr_model import load_ocr

    from support.text_images import TextImage, generated, receipt_total

    device = torch.device("cuda" if torch.cuda.is_available() and not dry_run else "cpu")
    started = time.perf_counter()
    model = load_ocr(ModelConfig(name="ocr"), device)
    load_s = time.perf_counter() - started
    total = receipt_total()
    texts = [total, TextImage("turned", total.image, total.lines, total.boxes, 6),
             *([] if dry_run else list(generated(12)))]
    read: list[str] = []
    started = time.perf_counter()
    for text in texts:
        decoded = decode_image(text.encoded(), model.spec, 10**8)
        read.append(model.predict([model.input_of(decoded)])[0].full_text)
    per_image_ms = (time.perf_counter() - started) * 1000 / len(texts)
    exact = read[0] == EXPECTED and read[1] == EXPECTED
    provider = model.providers[0]
    note = model.fields.get("MODEL_NOTE")
    return {"status": "passed" if exact else "failed", "providers": model.providers,
            "note": note, "load_s": round(load_s, 2), "images": len(texts),
            "ms_per_image": round(per_image_ms, 1), "read": read[:2],
            "summary": f"{'read' if exact else 'MISREAD'} '{EXPECTED}' upright and turned on "
                       f"{provider}, {per_image_ms:.0f} ms/image"
                       + (f" ({note})" if note else "")}
