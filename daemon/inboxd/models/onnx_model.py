"""The built-in model served by ONNX Runtime straight from its cached artifact, without torch.

Where ``runtime: auto`` (or ``onnxruntime``) runs the built-in model on a CPU-only host and a
valid artifact is in the cache, start-up loads the artifact and serves: torch, several hundred
MB of resident libraries, is never imported. Valid means its torch-free key
(``runtimes/serving_key.py``) is the one expected now, and the exporter process found it in
agreement with the torch network on the probe batch when it wrote it. Anything else (no
artifact yet, another key, a bring-your-own model, a GPU, an explicit torch setting) returns
None with the reason, and the torch model serves while the artifact is built, as before.

The batch path is the torch model's in numpy: the same float32 operations in the same order for
the normalisation, so the network sees the same input bits, then softmax and top-k.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from inboxd.config import ModelConfig
from inboxd.decode.spec import PreprocessSpec
from inboxd.item import DecodedImage
from inboxd.models.builtin_weights import BUILTIN_NAME, builtin_description, builtin_weights_path
from inboxd.models.device import cpu_only_host, usable_cores
from inboxd.models.predictions import (
    HOST_CPU,
    LUMA_WEIGHTS,
    Classification,
    Color,
    Device,
    Embedding,
    ModelInfo,
    Output,
    Prediction,
)
from inboxd.models.runtimes import onnx_artifact
from inboxd.models.runtimes.choice import Choice, choose, cpu_capability, cpu_flags
from inboxd.models.runtimes.serving_key import serving_key


class OnnxModel:
    """A ``TaskModel`` whose network is an ONNX Runtime session on the CPU."""

    def __init__(self, name: str, session: Any, spec: PreprocessSpec, labels: list[str] | None,
                 top_k: int, *, output: Output, color: Color, info: ModelInfo,
                 choice: Choice | None = None, fields: dict[str, Any] | None = None,
                 concurrent_calls: int = 1) -> None:
        if output == "classify" and not labels:
            raise ValueError("a classifying model needs its labels")
        self.name = name
        self.session = session
        self.spec = spec
        self.labels = labels
        self.output: Output = output
        self.color: Color = color
        self.top_k = min(top_k, len(labels)) if labels else 0
        self.info: ModelInfo | None = info
        self.max_batch: int | None = info.max_batch
        self.choice: Any = choice
        # Batches ``session`` may run at once, one per model thread (``LocalEngine``): a
        # session of one intra-op thread each call, so that many calls fill that many cores.
        self.concurrent_calls = concurrent_calls
        # The runtime facts for the started record (which artifact, the probe's verdict).
        self.fields: dict[str, Any] = fields or {}
        self.before_forward: Callable[[int], None] | None = None
        self.batch_seconds: dict[int, float] = {}  # each warmed size → seconds it took
        self._input = session.get_inputs()[0].name
        self._output = session.get_outputs()[0].name
        self._mean = np.asarray(spec.mean, dtype=np.float32).reshape(1, 3, 1, 1) * 255
        self._std = np.asarray(spec.std, dtype=np.float32).reshape(1, 3, 1, 1) * 255
        self._luma = np.asarray(LUMA_WEIGHTS, dtype=np.int32).reshape(1, 3, 1, 1)

    # One network on equal-sized crops, as a torch Model (the flag matters on CUDA only).
    batches_overlap = True

    @property
    def device(self) -> Device:
        return HOST_CPU

    def input_of(self, image: DecodedImage) -> Any:
        """What ``predict`` takes for one decoded photo: its crop's pixels."""
        return image.model_input

    @property
    def on_gpu(self) -> bool:
        return False

    @property
    def runtime(self) -> str:
        return "onnxruntime"

    @property
    def precision(self) -> str:
        return "fp32"

    def normalise(self, images: Sequence[npt.NDArray[np.uint8]]) -> npt.NDArray[np.float32]:
        """N crops (H×W×3 uint8) → the network's contiguous N×3×H×W float32 input, computed as
        ``Model.normalise`` computes it."""
        batch = np.stack(images).transpose(0, 3, 1, 2)
        if self.color == "bgr":
            batch = batch[:, ::-1]
        elif self.color == "gray":
            luma = ((batch.astype(np.int32) * self._luma).sum(1, keepdims=True) + 0x8000) >> 16
            batch = np.broadcast_to(luma, (luma.shape[0], 3, *luma.shape[2:]))
        out = batch.astype(np.float32, order="C")  # one copy: converted and laid out NCHW
        out -= self._mean
        out /= self._std
        return out

    def outputs(self, images: Sequence[npt.NDArray[np.uint8]]) -> npt.NDArray[np.float32]:
        if self.before_forward is not None:
            self.before_forward(len(images))
        out = self.session.run([self._output], {self._input: self.normalise(images)})[0]
        return np.asarray(out, dtype=np.float32)

    def predict(self, images: Sequence[Any]) -> Sequence[Prediction]:
        outputs = self.outputs(images)
        if self.output == "embed":
            return [Embedding(np.array(row, dtype=np.float32)) for row in outputs]
        assert self.labels is not None
        shifted = outputs - outputs.max(axis=1, keepdims=True)
        exps = np.exp(shifted)
        scores = exps / exps.sum(axis=1, keepdims=True)
        top = np.argsort(-scores, axis=1, kind="stable")[:, :self.top_k]
        labels = self.labels
        return [Classification([{"label": labels[i], "index": i, "score": round(float(row[i]), 6)}
                                for i in map(int, indices)])
                for row, indices in zip(scores, top, strict=True)]

    def check_batch_size(self, max_size: int) -> None:
        """The built-in artifact takes any batch size."""

    def warm_up_sizes(self, max_size: int) -> list[int]:
        return sorted({1, max_size})

    def warm_up(self, sizes: Sequence[int]) -> float:
        """As the torch model's: ``batch_seconds`` keeps what each size took (the start-up
        check against WatchdogSec= reads it)."""
        started = time.perf_counter()
        blank = np.zeros((self.spec.crop, self.spec.crop, 3), dtype=np.uint8)
        for size in sizes:
            size_started = time.perf_counter()
            self.predict([blank] * size)
            self.batch_seconds[size] = time.perf_counter() - size_started
        return time.perf_counter() - started

    def health_problem(self) -> str | None:
        blank = np.zeros((self.spec.crop, self.spec.crop, 3), dtype=np.uint8)
        try:
            self.predict([blank])
        except Exception as exc:  # any failure here means the input was not the cause
            return f"{type(exc).__name__}: {exc}"
        return None

    def memory_fields(self) -> dict[str, int]:
        return {}


def calls_and_threads(cores: int, calls_sent: int = 1) -> tuple[int, int]:
    """(batches run at once, intra-op threads of the session) on ``cores``, for a caller that
    sends up to ``calls_sent`` batches at once (the task's ``in_flight_batches``). Where it
    sends a batch per core, a single-threaded call per core: a small network's batch split
    across the cores leaves one idle through every serial step and every straggler of a
    parallel one, while the decode workers wait for room in the preprocess cache; whole batches
    side by side keep every core busy. Where it sends fewer (a search query, a bound below the
    cores), a single-threaded call would leave cores idle: one call across all of them."""
    if 1 < cores <= calls_sent:
        return cores, 1
    return 1, cores


def load_cached(config: ModelConfig, root: Path = Path("/"), calls_sent: int = 1
                ) -> tuple[OnnxModel | None, str]:
    """The built-in model from its cached artifact, or None and why it cannot be served so
    (torch then loads the model, and builds the artifact if it is missing). ``calls_sent``:
    the most batches the caller sends at once (``calls_and_threads``)."""
    if config.kind != "builtin" or config.engine != "local":
        return None, "only the built-in model is served from its artifact without torch"
    if not cpu_only_host(config.device, root):
        return None, f"device: {config.device} may be a GPU, which torch runs"
    flags = cpu_flags(root)
    try:
        choice = choose(config, "cpu", flags=flags, cpu_capability=cpu_capability(flags))
    except Exception as exc:  # the torch path reports the same problem as a ConfigError
        return None, str(exc)
    if choice.runtime != "onnxruntime" or choice.precision != "fp32":
        return None, f"the choice is {choice.runtime} {choice.precision}"
    key = serving_key(config, root)
    if key is None or config.cache_dir is None:
        return None, "the built-in weights are not installed, or no cache_dir"
    weights = builtin_weights_path()
    path = onnx_artifact.artifact_path(config.cache_dir, BUILTIN_NAME,
                                       builtin_description(weights))
    try:
        data = onnx_artifact.read_artifact(path)
        metadata = onnx_artifact.check_self_contained(
            data, key, onnx_artifact.SERVING_KEY_METADATA)
        serving = json.loads(metadata[onnx_artifact.SERVING_METADATA])
        calls, threads = calls_and_threads(usable_cores(), calls_sent)
        session = onnx_artifact.session(data, threads)
    except onnx_artifact.ArtifactRefused as refused:
        return None, f"the artifact {path} cannot serve without torch: {refused}"
    except Exception as exc:  # a foreign or damaged file: torch rebuilds it
        return None, (f"the artifact {path} cannot serve without torch: "
                      f"{type(exc).__name__}: {str(exc)[:200]}")
    del data
    choice = dataclasses.replace(choice, reason=(
        f"{choice.reason}; served from the cached artifact without torch ({serving['probe']}, "
        "checked by the exporter against torch)"))
    given = serving["spec"]
    spec = PreprocessSpec(resize=given["resize"], crop=given["crop"],
                          interpolation=given["interpolation"], mean=tuple(given["mean"]),
                          std=tuple(given["std"]))
    fields = {"RUNTIME_STATE": "serving", "RUNTIME_ARTIFACT": "cached, served without torch",
              "RUNTIME_CACHE_FILE": str(path), "RUNTIME_CALLS": calls,
              **serving["probe_fields"]}
    model = OnnxModel(serving["name"], session, spec, serving["labels"], config.top_k,
                      output=config.output, color=config.input.color,
                      info=ModelInfo(**serving["info"]), choice=choice, fields=fields,
                      concurrent_calls=calls)
    return model, "served from the cached artifact"
