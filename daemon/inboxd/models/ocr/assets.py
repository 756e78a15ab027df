"""The PP-OCRv4 networks that ship inside the ``rapidocr-onnxruntime`` wheel.

Only the wheel's files are used, never its code: the package requires ``opencv-python``, which
needs the X11/OpenGL libraries and clashes with ``opencv-python-headless`` in one environment,
so it is installed with ``--no-deps`` (``make setup`` does it) and found through its
distribution metadata without being imported.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from pathlib import Path

DISTRIBUTION = "rapidocr-onnxruntime"
VERSION = "1.4.4"
DETECTOR = "rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx"
RECOGNISER = "rapidocr_onnxruntime/models/ch_PP-OCRv4_rec_infer.onnx"
ANGLE_CLASSIFIER = "rapidocr_onnxruntime/models/ch_ppocr_mobile_v2.0_cls_infer.onnx"
INSTALL_HINT = (f"install the OCR models with `pip install --no-deps {DISTRIBUTION}=={VERSION}` "
                "(`make setup` does it; --no-deps keeps its opencv-python out)")


class OcrAssetsMissing(Exception):
    """The wheel, or one of its model files, is not installed: the message says how to fix it."""


@dataclass(frozen=True)
class OcrAssets:
    detector: Path
    recogniser: Path
    angle_classifier: Path
    version: str

    @property
    def description(self) -> str:
        return (f"PP-OCRv4 detection + recognition and the mobile v2.0 angle classifier from "
                f"{DISTRIBUTION} {self.version} ({self.detector.parent})")


def find_assets() -> OcrAssets:
    try:
        distribution = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as exc:
        raise OcrAssetsMissing(f"model: ocr needs the {DISTRIBUTION} wheel: {INSTALL_HINT}"
                               ) from exc
    if distribution.version != VERSION:
        raise OcrAssetsMissing(f"model: ocr is built for {DISTRIBUTION} {VERSION} and "
                               f"{distribution.version} is installed: {INSTALL_HINT}")
    paths = [Path(str(distribution.locate_file(name)))
             for name in (DETECTOR, RECOGNISER, ANGLE_CLASSIFIER)]
    missing = [str(path) for path in paths if not path.is_file()]
    if missing:
        raise OcrAssetsMissing(f"model: ocr cannot find {', '.join(missing)}: reinstall, "
                               f"{INSTALL_HINT}")
    return OcrAssets(paths[0], paths[1], paths[2], distribution.version)
