"""The runtime facts of the ``started`` record, for any served model, without importing torch."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from inboxd.models.predictions import TaskModel
from inboxd.models.runtimes.choice import cpu_capability, cpu_flags, native_bf16

if TYPE_CHECKING:
    from inboxd.models.fast_path import FastPath


def runtime_fields(model: TaskModel, fast: FastPath | None) -> dict[str, Any]:
    """What serves now, what was chosen and why, and on the CPU the capability the choice
    rests on."""
    fields: dict[str, Any] = {"RUNTIME": model.runtime, "PRECISION": model.precision}
    choice = model.choice
    if choice is not None:
        fields.update({"RUNTIME_CHOSEN": choice.runtime, "PRECISION_CHOSEN": choice.precision,
                       "RUNTIME_REASON": choice.reason})
    if model.device.type == "cpu":
        flags = cpu_flags()
        torch = sys.modules.get("torch")
        capability = (torch.backends.cpu.get_cpu_capability() if torch is not None
                      else cpu_capability(flags))
        fields.update({"CPU_CAPABILITY": capability,
                       "BF16_NATIVE": ",".join(native_bf16(flags)) or "no"})
    if fast is not None:
        fields.update({"RUNTIME_STATE": fast.state, **fast.fields})
    fields.update(getattr(model, "fields", {}))
    return fields
