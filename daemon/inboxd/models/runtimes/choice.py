"""``runtime: auto`` and ``precision: auto`` made concrete: the one place that decides and why.

On the CPU, ONNX Runtime fp32 is the fast path: several times eager fp32 where it was measured
(``bench/runtimes.py``; figures in ``docs/decisions.md``), it agrees with torch fp32 to float
rounding and needs no native bf16, so it is fast on CPUs without it too. bf16 is chosen only
where the YAML asks for torch and the CPU runs bf16 natively (AVX512_BF16 or AMX): emulated, it
is slower than fp32. On a GPU the autocast dtype follows the compute capability. An explicit
YAML value always wins. Every
reduced precision chosen here is still checked against fp32 on a probe batch before it serves
(``models/runtimes/agreement.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from inboxd.config import ModelConfig
from inboxd.models.preflight import problem

Runtime = Literal["torch", "onnxruntime"]
Precision = Literal["fp32", "fp16", "bf16"]
# /proc/cpuinfo flags of the instructions that run bf16 arithmetic natively.
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
# bf16 autocast on Ampere (8.0) and newer, fp16 from Volta's tensor cores (7.0); fp32 before.
GPU_BF16_CAPABILITY = (8, 0)
GPU_FP16_CAPABILITY = (7, 0)


def cpu_flags(root: Path = Path("/")) -> frozenset[str]:
    """The CPU's feature flags from ``root``/proc/cpuinfo (a test passes a fake root); empty
    when it cannot be read (not Linux, or a sandbox without /proc)."""
    try:
        text = (root / "proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features"):  # x86, ARM
            return frozenset(value.split())
    return frozenset()


def cpu_capability(flags: frozenset[str]) -> str:
    """torch's name for the widest vector ISA its CPU kernels use here
    (``torch.backends.cpu.get_cpu_capability()``), read from the flags, without torch."""
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        return "AVX512"
    if {"avx2", "fma"} <= flags:
        return "AVX2"
    return "DEFAULT"


def native_bf16(flags: frozenset[str]) -> list[str]:
    """The flags that show bf16 runs natively, [] when it would be emulated."""
    return [flag for flag in NATIVE_BF16_FLAGS if flag in flags]


@dataclass(frozen=True)
class Choice:
    runtime: Runtime
    precision: Precision
    reason: str  # in words, for the started record
    # Chosen by auto, not by the YAML: a reduced precision is checked against fp32 first.
    precision_by_auto: bool

    def fields(self) -> dict[str, str]:
        return {"RUNTIME": self.runtime, "PRECISION": self.precision,
                "RUNTIME_REASON": self.reason}


def choose(config: ModelConfig, device_type: str, *, flags: frozenset[str],
           cpu_capability: str, gpu_capability: tuple[int, int] | None = None) -> Choice:
    """The runtime and precision for ``config`` on a device of ``device_type`` (cpu | cuda)."""
    by_auto = config.precision == "auto"
    if config.kind == "onnx":
        return Choice("onnxruntime", "fp32", "an onnx: model runs in onnxruntime, at the "
                      "precision it was exported with", False)
    if device_type == "cuda":
        return _on_gpu(config, gpu_capability or (0, 0), by_auto)
    bf16 = native_bf16(flags)
    cpu = (f"CPU capability {cpu_capability}, bf16 "
           + (f"native ({', '.join(bf16)})" if bf16 else "not native (emulated: slow)"))
    runtime: Runtime
    if config.runtime == "auto":
        if config.compile:
            runtime, why = "torch", "compile: true asks for torch.compile"
        elif config.precision in ("bf16", "fp16"):
            runtime, why = "torch", f"precision: {config.precision} runs in torch autocast"
        else:
            runtime, why = "onnxruntime", ("onnxruntime fp32 is the fastest measured CPU runtime "
                                           "and agrees with torch fp32 to float rounding")
    else:
        runtime, why = config.runtime, f"runtime: {config.runtime} in the YAML"
        if runtime == "onnxruntime" and (config.compile or config.precision in ("bf16", "fp16")):
            raise problem("runtime: onnxruntime runs the exported network in fp32 on the CPU: "
                          "remove compile: true and set precision: auto or fp32 (or use "
                          "runtime: torch for torch.compile or bf16)")
    precision: Precision
    if not by_auto:
        precision = config.precision  # type: ignore[assignment]
        pwhy = f"precision: {precision} in the YAML"
    elif runtime == "onnxruntime":
        precision, pwhy = "fp32", "fp32 (fast in onnxruntime without bf16)"
    elif bf16:
        precision, pwhy = "bf16", "bf16 autocast (native on this CPU)"
    else:
        precision, pwhy = "fp32", "fp32 (bf16 would be emulated)"
    return Choice(runtime, precision, f"{cpu}; {why}; {pwhy}", by_auto)


def _on_gpu(config: ModelConfig, capability: tuple[int, int], by_auto: bool) -> Choice:
    if config.runtime == "onnxruntime":
        raise problem("runtime: onnxruntime runs on the CPU only (the onnxruntime package has "
                      "no CUDA execution provider): set runtime: auto or torch on a GPU, or "
                      "device: cpu")
    where = f"compute capability {capability[0]}.{capability[1]}"
    precision: Precision
    if not by_auto:
        precision = config.precision  # type: ignore[assignment]
        why = f"precision: {precision} in the YAML"
    elif capability >= GPU_BF16_CAPABILITY:
        precision, why = "bf16", "bf16 autocast (native from 8.0)"
    elif capability >= GPU_FP16_CAPABILITY:
        precision, why = "fp16", "fp16 autocast (tensor cores from 7.0, no native bf16)"
    else:
        precision, why = "fp32", "fp32 (no tensor cores before 7.0)"
    return Choice("torch", precision, f"GPU {where}; torch runs the GPU; {why}", by_auto)
