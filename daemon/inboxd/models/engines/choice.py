"""Which engine runs the model, from ``model.engine``; Ray's is imported only when chosen."""

from __future__ import annotations

from typing import TYPE_CHECKING

from inboxd.config import Config, ModelConfig
from inboxd.models.engines.interface import ModelEngine
from inboxd.models.engines.local import LocalEngine
from inboxd.models.onnx_model import load_cached
from inboxd.models.predictions import TaskModel

if TYPE_CHECKING:
    from inboxd.models.fast_path import FastPath


def here(config: ModelConfig) -> ModelConfig:
    """The model block for the copy this host loads. With ``engine: ray`` that copy only checks
    the files and gives the preprocessing and labels; it runs on the CPU in fp32, so an ingest
    host without a GPU (or whose GPU is for something else) can load it."""
    if config.engine == "local":
        return config
    return config.model_copy(update={"device": "cpu", "precision": "fp32", "compile": False,
                                     "runtime": "torch"})


def load_here(config: ModelConfig, calls_sent: int = 1) -> TaskModel:
    """The built-in model from its cached ONNX artifact where it can serve so (torch is then
    never imported: ``models/onnx_model.py``), else the torch model. ``calls_sent``: the most
    batches the caller sends at once (the daemon: the task's ``in_flight_batches``)."""
    cached, _ = load_cached(here(config), calls_sent=calls_sent)
    if cached is not None:
        return cached
    from inboxd.models.loading import load_model

    return load_model(here(config))


def make_engine(config: Config, model: TaskModel) -> ModelEngine:
    """Where ``config.model`` runs; with ``models:`` each task's engine is made here from its
    own block, so a task on ``engine: ray`` and one on ``local`` run side by side."""
    if config.model.engine == "ray":
        from inboxd.models.engines.ray_serve import RayEngine

        return RayEngine(model, config.model, config.batch.max_size)
    return LocalEngine(model, fast=fast_path(config.model, model))


def fast_path(config: ModelConfig, model: TaskModel) -> FastPath | None:
    """The ONNX Runtime runner to bring in, where the choice was onnxruntime and torch serves
    (name: ocr and a model served from its artifact run in ONNX Runtime from the start)."""
    choice = model.choice
    if choice is None or choice.runtime != "onnxruntime" or model.runtime != "torch":
        return None
    from inboxd.models.fast_path import FastPath
    from inboxd.models.model import Model

    if not isinstance(model, Model):
        return None
    return FastPath(model, config)
