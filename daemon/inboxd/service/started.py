"""The ``started`` record: what the daemon loaded, where it runs, how it watches, and how long
loading and warming up took. One journal record, read by people (its message) and by tools (its
fields: ``inboxd stats``, the device check)."""

from __future__ import annotations

import logging
import time
from typing import Any

from inboxd import __version__, logs
from inboxd.config import Config, ModelConfig
from inboxd.files.filesystems import WatchPlan
from inboxd.files.filesystems import describe as describe_watch
from inboxd.models.device import device_fields
from inboxd.models.engines.interface import ModelEngine
from inboxd.models.predictions import TaskModel
from inboxd.models.runtime_record import runtime_fields
from inboxd.models.tasks import TasksEngine
from inboxd.pipeline.model_stage import ModelStage
from inboxd.pipeline.task_stages import TaskStages


def log_started(config: Config, model: TaskModel, tasks: dict[str, TaskModel],
                engine: ModelEngine | TasksEngine, stages: ModelStage | TaskStages,
                plans: list[WatchPlan], profile: dict[str, str], warmed: list[int],
                warm_s: float, loading_started: float) -> None:
    """``loading_started``: ``time.perf_counter()`` when loading began; ``tasks``: {} for one
    ``model:``."""
    source = f" ({model.info.source})" if model.info is not None else ""
    device = {**device_fields(model.device), **profile}
    on = where(config.model, model)
    if config.model.engine != "ray" and "NVIDIA_DRIVER" in device:
        on += (f" ({device['DEVICE_NAME']}, compute capability "
               f"{device['COMPUTE_CAPABILITY']}, {int(device['GPU_MEMORY_BYTES']) / 2**30:.0f}"
               f" GiB, driver {device['NVIDIA_DRIVER']}, CUDA {device['CUDA_RUNTIME']}, "
               f"cuDNN {device['CUDNN_VERSION']})")
    runtime: dict[str, Any] = runtime_fields(model, engine.fast)
    state = runtime.get("RUNTIME_STATE")
    ran = (f"{model.runtime} {model.precision}"
           + (" (onnxruntime being prepared in the background)" if state == "building" else "")
           )
    if tasks and isinstance(stages, TaskStages):  # every task: what it runs, where, how
        calls_out = stages.calls_out  # the stages' bounds: one call on a serial engine
        source = " (tasks " + "; ".join(
            f"{task}: {m.name} {m.output} on {where(config.tasks[task], m)}, {m.runtime} "
            f"{m.precision}, batches of {config.task_batch(task).max_size}, "
            f"{calls_out[task]} in flight" for task, m in tasks.items()) + (
                f"; {stages.join.capacity} photos in the task join)")
        runtime["TASKS"] = ",".join(tasks)
    logs.emit(logging.INFO, "started",
              f"inboxd {__version__}: model {model.name}{source} on {on}, runs {ran}, "
              f"loaded and warmed up in {time.perf_counter() - loading_started:.1f} s; "
              f"watching {describe_watch(plans)}; {runtime.get('RUNTIME_REASON', '')}",
              **{key.lower(): value for key, value in runtime.items()},
              model=model.name, device=str(model.device), warmup_s=round(warm_s, 3),
              warmed_batch_sizes=",".join(map(str, warmed)), **device,
              instance=config.instance, version=__version__,
              watch=",".join("polling" if p.polling else "inotify" for p in plans),
              filesystems=",".join(p.filesystem for p in plans))


def where(block: ModelConfig, model: TaskModel) -> str:
    """Where a model block runs, in words: its device, or its Ray Serve application."""
    if block.engine == "ray":
        return f"Ray Serve application {block.ray.app_name} at {block.ray.address}"
    return str(model.device)
