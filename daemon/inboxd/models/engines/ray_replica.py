"""What one Ray Serve replica runs: the configured model, loaded from files inboxd shipped.

The ingest host sends the model block of its config and the bytes of every file it names
(weights, ``.pt2``, labels) as the deployment's init arguments, so a GPU host needs only the
inboxd package installed, not a copy of the model at the same path. The replica writes them to a
private temporary folder, loads the model with the same checks as the local engine
(``load_model``) and warms it up before Serve routes anything to it.

A call gets a batch of preprocessed uint8 crops and returns one outcome per crop, in order,
through the local engine's splitting (``infer_splitting``): a model error on one input fails that
input only, CUDA OOM halves the batch. A device fault poisons this replica's CUDA context: the
replica reports the batch as lost (the ingest host retries it elsewhere) and fails its health
check, so Serve replaces it. Nothing here imports Ray: Serve calls it like any class.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from inboxd.config import ModelConfig
from inboxd.item import DecodedImage, ModelError, PermanentError, TransientError, WorkItem
from inboxd.models.engines.interface import DeviceFault
from inboxd.models.engines.local import infer_splitting
from inboxd.models.model import Classification, Embedding, Model

MODEL_FILE_KEYS = ("export", "weights", "labels")

Reply = dict[str, Any]  # {"replica", "ms", "outcomes": [("ok", Prediction) | (kind, why)]}


def model_files(config: ModelConfig) -> dict[str, bytes]:
    """The bytes of every file the model block names, keyed by its key (on the ingest host)."""
    files: dict[str, bytes] = {}
    for key in MODEL_FILE_KEYS:
        path = getattr(config, key)
        if path is not None:
            files[key] = Path(path).read_bytes()
    return files


class Replica:
    def __init__(self, model_config: dict[str, Any], files: dict[str, bytes],
                 max_batch_size: int) -> None:
        from inboxd.models.loading import load_network

        self.folder = tempfile.TemporaryDirectory(prefix="inboxd-replica-")
        update: dict[str, Path] = {}
        for key, data in files.items():
            name = Path(model_config[key]).name
            path = Path(self.folder.name) / key / name
            path.parent.mkdir()
            path.write_bytes(data)
            update[key] = path
        config = ModelConfig.model_validate(model_config).model_copy(update=update)
        self.model: Model = load_network(config)
        self.model.warm_up(self.model.warm_up_sizes(max_batch_size))
        self.name = f"{socket.gethostname()}:{os.getpid()}"
        self.broken: str | None = None

    def __call__(self, crops: list[npt.NDArray[np.uint8]], delay_s: float = 0.0) -> Reply:
        if self.broken is not None:
            raise RuntimeError(f"replica {self.name} is broken: {self.broken}")
        started = time.perf_counter()
        if delay_s:
            time.sleep(delay_s)
        items = [_item(n, crop) for n, crop in enumerate(crops)]
        try:
            outcomes = infer_splitting(self.model, items)
        except DeviceFault as fault:
            self.broken = str(fault)
            raise RuntimeError(f"the device of replica {self.name} failed: {fault}") from None
        by_index: dict[int, Any] = {int(item.rel): outcome for item, outcome in outcomes}
        encoded: list[tuple[str, Any]] = []
        for n in range(len(crops)):
            outcome = by_index[n]
            if isinstance(outcome, PermanentError):
                encoded.append(("permanent", str(outcome)))
            elif isinstance(outcome, Exception):
                encoded.append(("transient", str(outcome)))
            else:
                encoded.append(("ok", outcome))
        return {"replica": self.name, "ms": (time.perf_counter() - started) * 1000,
                "outcomes": encoded}

    def check_health(self) -> None:
        """Serve asks every few seconds; a raise makes it replace this replica."""
        if self.broken is not None:
            raise RuntimeError(self.broken)

    def describe(self) -> dict[str, Any]:
        return {"replica": self.name, "device": str(self.model.device), "model": self.model.name}


def _item(n: int, crop: npt.NDArray[np.uint8]) -> WorkItem:
    """A stand-in for the ingest host's item: ``infer_splitting`` only reads the pixels."""
    return WorkItem(Path(), str(n), str(n), "",
                    image=DecodedImage(crop, crop.shape[1], crop.shape[0], None, "RGB"))


class BadReply(Exception):
    """A reply that cannot be matched to its batch item by item: the batch is retried."""


def decode_reply(reply: Reply, count: int) -> list[Any]:
    """The replica's outcomes as predictions or this host's exception types, in order; one per
    crop of the ``count`` sent, or ``BadReply``. Checked, not trusted: a reply one short or one
    long would attach outcomes to the wrong files, and a stray object instead of a prediction
    would crash the result writer."""
    try:
        outcomes = list(reply["outcomes"])
    except (KeyError, TypeError) as exc:
        raise BadReply(f"a reply without outcomes ({type(exc).__name__}: {exc})") from None
    if len(outcomes) != count:
        raise BadReply(f"{len(outcomes)} outcomes for {count} crops")
    decoded: list[Any] = []
    for outcome in outcomes:
        kind, value = outcome if isinstance(outcome, tuple) and len(outcome) == 2 else ("?", "")
        if kind == "ok" and isinstance(value, Classification | Embedding):
            decoded.append(value)
        elif kind == "permanent":  # the replica's model failed on that input
            decoded.append(ModelError(str(value)))
        elif kind == "transient":
            decoded.append(TransientError(str(value)))
        else:  # that item's own problem: retried like any transient error
            decoded.append(TransientError(f"the replica sent no result for this file "
                                          f"({type(value).__name__} under {kind!r})"))
    return decoded
