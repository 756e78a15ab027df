"""What a model gives back, and the face every served model shows the pipeline, without torch.

The pipeline (model stage, result writer, wiring, the service) talks to a ``TaskModel``: the
torch ``Model`` (``models/model.py``) or the ONNX Runtime model loaded from a cached artifact
(``models/onnx_model.py``). Keeping this module free of torch is what lets a daemon that serves
ONNX Runtime start, and run, without loading torch at all.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeAlias

import numpy as np
import numpy.typing as npt

from inboxd.decode.spec import PreprocessSpec
from inboxd.item import DecodedImage

if TYPE_CHECKING:  # torch's and OpenCV's: loaded only where a detector or OCR runs
    from inboxd.models.detect.geometry import Detections
    from inboxd.models.ocr.reader import OcrReading

# Pillow's convert("L") in fixed point (ITU-R 601-2 luma: 0.299 R + 0.587 G + 0.114 B, scaled
# by 2**16 and rounded), so a ``color: gray`` model sees exactly the pixels Pillow would give.
LUMA_WEIGHTS = (19595, 38470, 7471)

Output = Literal["classify", "embed", "detect", "ocr"]
Color = Literal["rgb", "bgr", "gray"]


# Each kind of answer says, by two methods (mypy checks each against the ``TaskAnswer`` union):
#   not_finite() -> str | None: what in it is NaN or infinite (fp16 overflow, a network that
#     diverges on one input), or None. JSON has no such numbers: ``json.dumps`` would write a
#     ``NaN`` that strict readers reject, in a result that claims to be an answer.
#   result_fields(width, height, vector_file) -> dict: its part of the result JSON, given the
#     displayed photo's size (geometry is in its pixels) and the name of the vector file
#     written beside the result.


@dataclass
class Classification:
    top_k: list[dict[str, Any]]

    def not_finite(self) -> str | None:
        bad = sum(not math.isfinite(float(entry.get("score", 0.0))) for entry in self.top_k)
        return f"{bad} of the top-{len(self.top_k)} scores" if bad else None

    def result_fields(self, width: int, height: int, vector_file: str) -> dict[str, Any]:
        return {"top_k": self.top_k}


@dataclass
class Embedding:
    vector: npt.NDArray[np.float32]  # 1-D, as the network produced it (not normalised)

    @property
    def dim(self) -> int:
        return int(self.vector.shape[0])

    @property
    def norm(self) -> float:
        return float(np.linalg.norm(self.vector.astype(np.float64)))

    def not_finite(self) -> str | None:
        bad = int(np.count_nonzero(~np.isfinite(self.vector)))
        return f"{bad} of the {self.dim} embedding values" if bad else None

    def result_fields(self, width: int, height: int, vector_file: str) -> dict[str, Any]:
        # The vector itself is written beside the result, in the group commit.
        return {"embedding": {"file": vector_file, "dim": self.dim,
                              "norm": round(self.norm, 6), "dtype": str(self.vector.dtype)}}


# What one task says about one photo.
TaskAnswer: TypeAlias = "Classification | Embedding | Detections | OcrReading"


@dataclass
class TaskResults:
    """One photo's answer from every task of a ``models:`` config, by task name: a prediction,
    or the reason that task's model failed on this photo (an exception of its own)."""

    sections: dict[str, TaskAnswer | Exception]
    # How each task ran, for its section: task → (runtime, precision).
    ran: dict[str, tuple[str, str]]


Prediction: TypeAlias = "TaskAnswer | TaskResults"


def loaded_class(module: str, name: str) -> Any:
    """A class of a module only if that module is loaded: importing it to ask would load
    torch (or OpenCV) into a daemon that serves none of its models."""
    return getattr(sys.modules.get(module), name, None)


def not_finite(prediction: Prediction) -> str | None:
    """What in ``prediction`` is NaN or infinite, or None; a ``TaskResults``'s sections are
    each checked on their own (a task's section says it)."""
    return None if isinstance(prediction, TaskResults) else prediction.not_finite()


class UnfitAnswer(ValueError):
    """The network's answer does not fit the batch it was given: a row count other than the
    batch's, another shape, NaN or infinite values. That batch's model error (split, then the
    input that still fails alone fails), never a crash of the stage."""


@dataclass(frozen=True)
class ModelInfo:
    """What was loaded, for ``inboxd models`` and the start-up log."""

    kind: str  # builtin | torchvision | export
    source: str  # where the network and its weights came from, in words
    parameters: int
    outputs: int  # classes (classify) or the embedding dimension (embed)
    max_batch: int | None = None  # a .pt2 program's bound on its dynamic batch dimension


class Device(Protocol):
    """Where a model runs: a ``torch.device``, or ``HOST_CPU`` where torch is not loaded."""

    @property
    def type(self) -> str: ...


@dataclass(frozen=True)
class HostCpu:
    """The CPU, said without torch (a ``torch.device("cpu")`` would need it imported)."""

    type: str = "cpu"

    def __str__(self) -> str:
        return "cpu"


HOST_CPU = HostCpu()


class TaskModel(Protocol):
    """What the model stage, its engines and the result writer ask of a model: ``Model`` (one
    torch or ONNX network), ``OnnxModel`` (the built-in model from its artifact, without torch)
    and ``OcrModel`` (models/ocr: three networks and the steps between)."""

    before_forward: Callable[[int], None] | None

    @property
    def name(self) -> str: ...

    @property
    def output(self) -> Output: ...

    @property
    def spec(self) -> PreprocessSpec: ...

    @property
    def device(self) -> Device: ...

    @property
    def info(self) -> ModelInfo | None: ...

    @property
    def max_batch(self) -> int | None: ...

    @property
    def choice(self) -> Any: ...

    @property
    def on_gpu(self) -> bool: ...

    @property
    def batches_overlap(self) -> bool: ...

    @property
    def concurrent_calls(self) -> int:
        """Batches it runs at once, each single-threaded on a model thread of its own; 1: one
        at a time, parallel inside (torch's or ONNX Runtime's intra-op threads)."""
        ...

    @property
    def runtime(self) -> str: ...

    @property
    def precision(self) -> str: ...

    def input_of(self, image: DecodedImage) -> Any: ...

    def predict(self, images: Sequence[Any]) -> Sequence[Prediction]: ...

    def check_batch_size(self, max_size: int) -> None: ...

    def warm_up_sizes(self, max_size: int) -> list[int]: ...

    def warm_up(self, sizes: Sequence[int]) -> float: ...

    def health_problem(self) -> str | None: ...

    def memory_fields(self) -> dict[str, int]: ...
