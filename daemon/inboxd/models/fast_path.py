"""The fast runner, brought in without a start-up penalty: while the plain torch model serves, a
background thread finds a valid cached artifact or has one exported, and the model thread swaps
it in between two batches (within a second or two of start-up when the cache is valid).

Every artifact, cached or fresh, runs one probe batch beside the plain model first and is used only
if it agrees (``models/runtimes/agreement.py``). A build that fails, a file that cannot be used and
a runner that disagrees are each logged once (``INBOXD_EVENT=runtime``) with the reason, and the
plain model keeps serving. One build per process: a thread that waits on one exporter process.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from inboxd import logs
from inboxd.config import ModelConfig
from inboxd.models.model import Model
from inboxd.models.onnx_export import export_in_child
from inboxd.models.runtimes import onnx as onnx_runtime
from inboxd.models.runtimes import onnx_artifact
from inboxd.models.runtimes.agreement import measure
from inboxd.models.runtimes.serving_key import serving_key

Exporter = Callable[[ModelConfig, Path, str], None]
# The CLI's exit check looks for threads with the model thread's prefix: an export still
# running when the daemon is done must not hold the interpreter.
BUILD_THREAD_NAME = "inboxd-model-build"


def refuse_stale_serving_key(metadata: dict[str, str], config: ModelConfig) -> None:
    """Refuses an artifact whose torch-free key is another inboxd's. The torch key covers the
    weights and versions, not inboxd's own code, so after an upgrade the artifact still passes
    it while the torch-free start (``models/onnx_model.py``) refuses it: without this, every
    later start would load torch for good. An artifact with no torch-free key at all (its probe
    disagreed at export) is kept: exporting it again would only disagree again."""
    expected = serving_key(config)
    found = metadata.get(onnx_artifact.SERVING_KEY_METADATA)
    if expected is not None and found is not None and found != expected:
        raise onnx_artifact.ArtifactRefused(
            "its torch-free key is another inboxd's or another set of packages' (an upgrade)")


class FastPath:
    def __init__(self, model: Model, config: ModelConfig, exporter: Exporter = export_in_child
                 ) -> None:
        assert config.cache_dir is not None
        self.model = model
        self.config = config
        self.exporter = exporter
        source = model.info.source if model.info is not None else model.name
        self.path = onnx_runtime.artifact_path(config.cache_dir, model.name, source)
        self.threads = torch.get_num_threads()
        self.key = ""
        # pending → serving (from the cache) | building → serving | failed
        self.state = "pending"
        self.fields: dict[str, Any] = {}  # the latest runtime facts, for records
        self._ready: tuple[bytes, str] | None = None  # the artifact's bytes, cached | exported
        self._thread: threading.Thread | None = None
        # Called from the build thread once the artifact is ready: the local engine queues
        # ``swap_if_built`` on its model thread, so an idle daemon swaps too, between batches.
        self.on_exported: Callable[[], None] | None = None

    # -- on the model thread -----------------------------------------------------------------

    def start(self) -> None:
        """At start-up: look for the artifact (and export it if need be) in the build thread,
        so the first batch is served by torch at once, with nothing added to start-up."""
        if self.state != "pending":
            return
        self.state = "building"
        self._thread = threading.Thread(target=self._build, name=BUILD_THREAD_NAME, daemon=True)
        self._thread.start()

    def swap_if_built(self) -> None:
        """Between two batches: once the artifact is ready, load it, check it on the probe
        batch against the model serving now, and serve with it. The session is made here, on
        the model thread, because ONNX Runtime's pool threads inherit their maker's priority."""
        ready = self._ready
        if self.state != "building" or ready is None:
            return
        self._ready = None
        data, how = ready
        try:
            fast = onnx_runtime.from_bytes(data, self.threads)
        except onnx_runtime.ArtifactRefused as refused:
            self._fail(f"the artifact {self.path} cannot be used: {refused}")
            return
        del data
        plain = self.model.runner
        try:
            agreement = measure(lambda images: self.model.run(images, plain),
                                lambda images: self.model.run(images, fast),
                                self.model.spec.crop, self.model.output == "embed")
        except Exception as exc:  # the runner fails on the probe: it must not serve
            self._fail(f"onnxruntime fails on the probe batch: {type(exc).__name__}: {exc}")
            return
        if not agreement.ok:
            self._fail(f"onnxruntime does not agree with torch: {agreement.describe()}")
            return
        self.model.use(fast)
        self.state = "serving"
        self.fields.update({"RUNTIME_ARTIFACT": how, "RUNTIME_CACHE_FILE": str(self.path),
                            **agreement.fields()})
        self._record(logging.INFO, f"runtime: onnxruntime fp32 now serves ({how} artifact "
                     f"{self.path}), swapped in between two batches; {agreement.describe()}")

    # -- in the build thread -----------------------------------------------------------------

    def _build(self) -> None:
        try:
            self.key = onnx_runtime.expected_key(self.model.network, self.model.spec.crop,
                                                 self.model.max_batch)
            limit_bytes = onnx_runtime.artifact_limit_bytes(self.model.network)
            try:
                data = onnx_artifact.read_artifact(self.path, limit_bytes)
                refuse_stale_serving_key(
                    onnx_artifact.check_self_contained(data, self.key), self.config)
                self._ready = (data, "cached")
            except onnx_runtime.ArtifactRefused as refused:
                self.fields["RUNTIME_REBUILD_REASON"] = str(refused)
                self.exporter(self.config, self.path, self.key)
                self._ready = (onnx_runtime.verified(self.path, self.key, limit_bytes),
                               "exported")
        except Exception as exc:  # ExportFailed, an unusable export, the boundary failing
            self._fail(f"exporting the network to ONNX failed: {exc}")
            return
        if self.on_exported is not None:
            self.on_exported()

    def _fail(self, why: str) -> None:
        self.state = "failed"
        self.fields["RUNTIME_FAILURE"] = why
        self._record(logging.WARNING, f"runtime: {why}; torch {self.model.precision} keeps "
                     "serving (fix the cause, or set model.runtime: torch to skip the attempt)")

    def _record(self, level: int, message: str) -> None:
        logs.emit(level, "runtime", message, runtime=self.model.runtime,
                  precision=self.model.precision, runtime_state=self.state,
                  **{k.lower(): v for k, v in self.fields.items()})

    def join(self, timeout_s: float | None = None) -> None:
        """For tests and benchmarks: wait for the build thread."""
        if self._thread is not None:
            self._thread.join(timeout_s)

