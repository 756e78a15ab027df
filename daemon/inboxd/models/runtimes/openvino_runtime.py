"""OpenVINO's CPU plugin as a runner of the built-in model's ONNX artifact, without torch.

The artifact ONNX Runtime serves (``runtimes/onnx_artifact.py``) is read by OpenVINO as it is:
no second export, no second cache. OpenVINO would pick bf16 by itself on a CPU with AMX or
AVX512_BF16; here the precision is always set (``INFERENCE_PRECISION_HINT``), so a YAML gives
the same numbers on every CPU and a reduced precision serves only where the choice says so
(``runtimes/choice.py``). One stream, ``threads`` threads, the latency hint, no pinning: the
daemon sends one batch at a time and the decode workers share the cores.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import numpy as np

from inboxd.models.runtimes.choice import OPENVINO_NOT_INSTALLED

# OpenVINO's names for the precisions inboxd asks for.
OPENVINO_PRECISIONS = {"fp32": "f32", "bf16": "bf16"}


def available() -> str | None:
    """None when the openvino package is installed here, else why not (without importing it:
    a daemon that never runs it does not load its libraries)."""
    return None if importlib.util.find_spec("openvino") is not None else OPENVINO_NOT_INSTALLED


def precisions() -> list[str]:
    """The precisions (inboxd's names) OpenVINO's CPU plugin runs natively on this CPU."""
    import openvino as ov

    capabilities = set(ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES"))
    return ["fp32", *(["bf16"] if "BF16" in capabilities else [])]


class _Port:
    def __init__(self, name: str) -> None:
        self.name = name


class OpenVinoSession:
    """A compiled model behind the part of ONNX Runtime's ``InferenceSession`` interface that
    inboxd uses (``get_inputs``, ``get_outputs``, ``run``), so the ONNX model code serves it
    unchanged. One infer request: the model stage sends one batch at a time."""

    def __init__(self, data: bytes, threads: int, precision: str) -> None:
        import openvino as ov
        import openvino.properties as props
        import openvino.properties.hint as hints

        core = ov.Core()
        self.precision = precision
        self.model = core.compile_model(core.read_model(data), "CPU", {
            hints.inference_precision: OPENVINO_PRECISIONS[precision],
            hints.performance_mode: hints.PerformanceMode.LATENCY,
            props.inference_num_threads: threads,
            props.num_streams: 1,
            # Pinned threads would fight the decode workers for the same cores.
            hints.enable_cpu_pinning: False,
        })
        self._request = self.model.create_infer_request()
        self._inputs = [_Port(port.any_name) for port in self.model.inputs]
        self._outputs = [_Port(port.any_name) for port in self.model.outputs]

    def get_inputs(self) -> list[_Port]:
        return self._inputs

    def get_outputs(self) -> list[_Port]:
        return self._outputs

    def run(self, names: list[str] | None, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        result = self._request.infer({self._inputs[0].name: next(iter(feeds.values()))})
        wanted = names or [port.name for port in self._outputs]
        # The request reuses its output buffers: copied before the next batch overwrites them.
        return [np.array(result[self.model.output(name)], copy=True) for name in wanted]


def session(data: bytes, threads: int, precision: str) -> Any:
    return OpenVinoSession(data, threads, precision)
