"""Helpers for ``test_models.py``: models the tests make and save themselves, the real pipeline
run over real photos, and an independent reference for what the network should have returned.

The reference normalises the decoded pixels with its own numpy arithmetic and calls a fresh copy
of the network, un-batched and in the default memory format, so a difference in how inboxd
stacks, converts, batches or lays out the input would show.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torchvision
from inboxd.config import load_config
from inboxd.decode.pillow import decode_image
from inboxd.decode.spec import PreprocessSpec
from inboxd.models.loading import load_model
from inboxd.models.model import Model
from inboxd.pipeline.wiring import Pipeline
from torch import nn

from tests.conftest import read_json, write_config

NUM_CLASSES = 10
TOLERANCE = 1e-5


def resnet18(seed: int = 0, num_classes: int = NUM_CLASSES) -> nn.Module:
    """A seeded, untrained resnet18: weights=None builds it without downloading anything."""
    torch.manual_seed(seed)
    network: nn.Module = torchvision.models.resnet18(weights=None, num_classes=num_classes)
    return network.eval()


def export(network: nn.Module, path: Path, size: int = 224, max_batch: int = 64) -> Path:
    batch = torch.export.Dim("batch", min=1, max=max_batch)
    example = torch.randn(2, 3, size, size)
    program = torch.export.export(network, (example,), dynamic_shapes=({0: batch},))
    torch.export.save(program, path)
    return path


def run_pipeline(root: Path, photos: dict[str, Path], model: dict[str, Any] | None,
                 **sections: Any) -> tuple[Pipeline, Model]:
    """Copy the photos into a fresh inbox, load the model as the daemon does, and run
    ``inboxd once``'s pipeline over them (``model=None, models={...}``: several tasks)."""
    for name, path in photos.items():
        (root / "inbox").mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, root / "inbox" / f"{name}{path.suffix}")
    inbox = {"settle_ms": 0, **sections.pop("inbox", {})}
    config = load_config(write_config(root, model=model, inbox=inbox, **sections))
    tasks = {task: load_model(block) for task, block in (config.models or {}).items()}
    loaded = next(iter(tasks.values())) if tasks else load_model(config.model)
    pipeline = Pipeline(config, loaded, tasks=tasks or None)
    asyncio.run(pipeline.process_backlog())
    counters = pipeline.stats.counters
    assert (counters.completed, counters.failed) == (len(photos), 0), counters
    return pipeline, loaded


def result(root: Path, name: str, path: Path) -> dict[str, Any]:
    document: dict[str, Any] = read_json(root / "results" / f"{name}{path.suffix}.json")
    return document


def vector(root: Path, name: str, path: Path) -> np.ndarray:
    loaded: np.ndarray = np.load(root / "results" / f"{name}{path.suffix}.npy",
                                 allow_pickle=False)
    return loaded


def reference_input(path: Path, spec: PreprocessSpec) -> torch.Tensor:
    """1×3×crop×crop: inboxd's decode (the same uint8 crop the pipeline made), normalised here."""
    pixels = decode_image(path.read_bytes(), spec, 89_478_485).pixels.astype(np.float32) / 255
    mean, std = np.array(spec.mean, np.float32), np.array(spec.std, np.float32)
    normalised = (pixels - mean) / std
    return torch.from_numpy(normalised.transpose(2, 0, 1).copy()).unsqueeze(0)


def call(network: nn.Module, x: torch.Tensor) -> np.ndarray:
    with torch.inference_mode():
        out: np.ndarray = network(x).float().numpy()[0]
    return out


def softmax(logits: np.ndarray) -> np.ndarray:
    shifted: np.ndarray = np.exp(logits.astype(np.float64) - logits.max())
    normalised: np.ndarray = shifted / shifted.sum()
    return normalised


def scores_by_index(document: dict[str, Any], classes: int) -> np.ndarray:
    """The JSON's top-k as a dense score vector (top_k covers every class in these tests)."""
    scores = np.full(classes, np.nan)
    for entry in document["top_k"]:
        scores[entry["index"]] = entry["score"]
    assert not np.isnan(scores).any(), "top_k must list every class for this comparison"
    return scores
