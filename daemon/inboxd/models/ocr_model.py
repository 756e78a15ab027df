"""``model: {name: ocr}`` behind the interface the model stage and the engines use: a batch of
decoded photos in, one ``OcrReading`` per photo out.

The three networks run in ONNX Runtime: on ONNX Runtime's CUDA provider when the configured
device is a GPU and the installed onnxruntime has it, else on the CPU (``note`` says why, for
the ``started`` record). The decoder gives the photo fitted within RapidOCR's working size,
never enlarged (``fit_within``): the detector sizes its own input from it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from inboxd.config import ModelConfig
from inboxd.decode.spec import PreprocessSpec
from inboxd.item import DecodedImage
from inboxd.models.model import ModelInfo, Output
from inboxd.models.ocr.assets import OcrAssets, OcrAssetsMissing, find_assets
from inboxd.models.ocr.reader import CropLayer, OcrReader, OcrReading, OcrSettings
from inboxd.models.preflight import problem
from inboxd.models.runtimes.onnx_artifact import CPU_PROVIDERS, providers_for_gpu
from inboxd.models.runtimes.onnx_artifact import session as onnx_session

NAME = "ocr"

# A photo's input: its fitted pixels and its displayed (width, height).
OcrInput = tuple[npt.NDArray[np.uint8], tuple[int, int]]
_BLANK_SIDE = 64


class OcrModel:
    """The OCR task's model. Runs on one thread at a time (the local engine's model thread)."""

    output: Output = "ocr"
    labels: list[str] | None = None
    top_k = 0
    color = "rgb"
    max_batch: int | None = None
    choice: Any = None
    runtime = "onnxruntime"
    precision = "fp32"
    batches_overlap = False  # ONNX Runtime's own sessions: nothing of torch's split applies
    concurrent_calls = 1  # its sessions parallelise inside a call

    def __init__(self, reader: OcrReader, device: torch.device, providers: tuple[str, ...],
                 note: str | None, assets: OcrAssets) -> None:
        self.name = NAME
        self.reader = reader
        self.crops: CropLayer = reader.crops
        self.device = device
        self.providers = providers
        # For the started record: where the networks run, and why when not where asked.
        self.fields: dict[str, Any] = {
            "RUNTIME_REASON": f"the OCR networks run on ONNX Runtime's {providers[0]}"}
        if note is not None:
            self.fields["MODEL_NOTE"] = note
        self.spec = PreprocessSpec(reader.settings.max_side_px, reader.settings.max_side_px,
                                   "bilinear", (0.5, 0.5, 0.5), (0.5, 0.5, 0.5),
                                   kind="fit_within")
        self.info: ModelInfo | None = ModelInfo("ocr", assets.description, 0, 0)
        self.before_forward: Callable[[int], None] | None = None  # the fault tests' seam

    @property
    def on_gpu(self) -> bool:
        """False: nothing of it is torch on a device (the engine's CUDA overlap is torch's)."""
        return False

    def input_of(self, image: DecodedImage) -> OcrInput:
        pixels = image.model_input
        if isinstance(pixels, torch.Tensor):  # decoded on the GPU (nvJPEG)
            pixels = pixels.cpu().numpy()
        return pixels, (image.width, image.height)

    def predict(self, images: Sequence[Any]) -> list[OcrReading]:
        if self.before_forward is not None:
            self.before_forward(len(images))
        return [self.reader.read(pixels, displayed) for pixels, displayed in images]

    def check_batch_size(self, max_size: int) -> None:
        """Any batch size: photos are read one after another, their crops batched."""

    def warm_up_sizes(self, max_size: int) -> list[int]:
        return [1]

    def warm_up(self, sizes: Sequence[int]) -> float:
        started = time.perf_counter()
        self.predict([self._blank()])
        return time.perf_counter() - started

    def _blank(self) -> OcrInput:
        return np.full((_BLANK_SIDE, _BLANK_SIDE, 3), 255, np.uint8), (_BLANK_SIDE, _BLANK_SIDE)

    def health_problem(self) -> str | None:
        try:
            self.predict([self._blank()])
        except Exception as exc:  # any failure here means the input was not the cause
            return f"{type(exc).__name__}: {exc}"
        return None

    def memory_fields(self) -> dict[str, int]:
        return {}


def load_ocr(config: ModelConfig, device: torch.device) -> OcrModel:
    try:
        assets = find_assets()
    except OcrAssetsMissing as exc:
        raise problem(str(exc)) from exc
    providers: tuple[str, ...] = CPU_PROVIDERS
    note: str | None = None
    if device.type == "cuda":
        providers, note = providers_for_gpu("OCR")
        if note is not None:
            device = torch.device("cpu")
    threads = torch.get_num_threads()

    def session(path: Any) -> Any:
        return onnx_session(str(path), threads, providers)

    settings = OcrSettings(max_regions=config.max_regions)
    reader = OcrReader(session(assets.detector), session(assets.angle_classifier),
                       session(assets.recogniser), settings, CropLayer(CropLayer.DEFAULT))
    return OcrModel(reader, device, providers, note, assets)
