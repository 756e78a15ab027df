"""Which device the model runs on, and loud words when a GPU is there but CUDA cannot use it.

``torch.cuda.is_available()`` answers False without a reason, and the reasons differ in what to
do: a driver older than the torch build's CUDA needs (the wheel ``torch>=2.4`` resolves to today
is a CUDA 13 build: driver 580 or newer), a CPU-only torch, or a sandbox that hides the devices
(the unit's ``DeviceAllow=``). When the NVIDIA driver's own files say a GPU is there, ``device:
auto`` still falls back to the CPU (a slow daemon beats none) but says so with torch's error and
those remedies; ``device: cuda`` is a ``ConfigError`` (exit 78) with the same words.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from inboxd import logs
from inboxd.config import Config, ConfigError, Section
from inboxd.models.predictions import Device

if TYPE_CHECKING:
    import torch

# The oldest driver each CUDA major version runs on (NVIDIA's minor version compatibility:
# any 12.x build on 525.60.13+, any 13.x build on 580+).
MIN_DRIVER = {"12": "525.60.13", "13": "580"}
CUDA12_INDEX = "https://download.pytorch.org/whl/cu126"

# Defaults that depend on where the model runs, for the keys the YAML leaves unset (a key it
# sets always wins): the CPU keeps config.py's defaults; a GPU, thousands of images/s, needs
# decoders on every core but two (the event loop and the model thread), batches of 64 and room
# to queue for them: a queue slot per decoder and then some, two batches of decoded crops.
# Chosen by arithmetic, not yet measured by `make bench-sweep` on a GPU.
DeviceProfile = Literal["cpu", "gpu"]


def device_defaults(profile: DeviceProfile, cores: int,
                    workers: int | None = None) -> dict[str, dict[str, int]]:
    """``workers``: the YAML's own preprocess.workers, which the queue is then sized for."""
    if profile == "cpu":
        return {}
    workers = workers or max(2, cores - 2)
    return {"preprocess": {"workers": workers}, "batch": {"max_size": 64},
            "capacity": {"queue": 2 * workers, "preprocess_cache": 128,
                         "preprocess_cache_mb": 1024}}


def nvidia_hardware(root: Path = Path("/")) -> str | None:
    """What shows an NVIDIA GPU on this host, in words, or None: the driver's per-GPU folders,
    or its control device. ``root`` is the filesystem root (a test passes a fake one)."""
    gpus = root / "proc/driver/nvidia/gpus"
    try:
        found = sorted(entry.name for entry in gpus.iterdir())
    except OSError:
        found = []
    if found:
        return f"{gpus} lists {', '.join(found)}"
    if (root / "dev/nvidiactl").exists():
        return f"{root / 'dev/nvidiactl'} exists"
    return None


def nvidia_driver_version(root: Path = Path("/")) -> str | None:
    """The loaded kernel module's version ("570.86.15"), from /proc/driver/nvidia/version."""
    try:
        text = (root / "proc/driver/nvidia/version").read_text(errors="replace")
    except OSError:
        return None
    match = re.search(r"Kernel Module.*?\s(\d+\.\d+(?:\.\d+)?)\s", text)
    return match.group(1) if match else None


def cpu_only_host(requested: str, root: Path = Path("/")) -> bool:
    """Whether ``requested`` resolves to the CPU without asking torch: ``cpu``, or ``auto`` on
    a host that shows no NVIDIA GPU (where ``torch.cuda.is_available()`` could only say no)."""
    return requested == "cpu" or (requested == "auto" and nvidia_hardware(root) is None)


def cuda_failure() -> str:
    """torch's own reason why CUDA cannot be used here."""
    import torch

    try:
        torch.cuda.init()  # type: ignore[no-untyped-call]
    except Exception as exc:  # whatever torch raises is the message the user needs
        return f"{type(exc).__name__}: {exc}"
    return "torch.cuda.is_available() is False"


def remedies(root: Path = Path("/")) -> str:
    """What to do about CUDA failing on a host with NVIDIA hardware."""
    driver = nvidia_driver_version(root)
    have = f"driver {driver} is loaded" if driver else "no NVIDIA driver version is readable"
    import torch

    built = torch.version.cuda
    if built is None:
        build = (f"this torch ({torch.__version__}) is a CPU-only build: install a CUDA build "
                 f"(pip install torch --index-url {CUDA12_INDEX})")
    else:
        needs = MIN_DRIVER.get(built.split(".")[0], "the one its CUDA release notes name")
        build = (f"torch {torch.__version__} is built for CUDA {built}, which needs NVIDIA "
                 f"driver {needs} or newer ({have}): upgrade the driver, or install the CUDA 12 "
                 f"build (pip install torch torchvision --index-url {CUDA12_INDEX}), which runs "
                 f"on {MIN_DRIVER['12']}+")
    return (f"{build}; under systemd, the unit needs DeviceAllow= for /dev/nvidiactl, "
            "/dev/nvidia-uvm and /dev/nvidiaN; check CUDA_VISIBLE_DEVICES and nvidia-smi")


def pick_device(requested: str, root: Path = Path("/")) -> torch.device:
    import torch

    if requested == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        hardware = nvidia_hardware(root)
        if hardware is not None:
            logs.emit(logging.WARNING, "no_cuda",
                      f"an NVIDIA GPU is present ({hardware}) but CUDA cannot be used: "
                      f"{cuda_failure()}. Running on the CPU, many times slower. "
                      f"{remedies(root)}; or set model.device: cpu to mean it",
                      hardware=hardware, cuda_error=cuda_failure())
        return torch.device("cpu")
    device = torch.device(requested)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("model", [
                f"device: {requested}, but CUDA cannot be used: {cuda_failure()}. "
                f"{remedies(root)}; or set model.device: auto to fall back to the CPU"])
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError("model", [
                f"device: {requested}, but this process sees {torch.cuda.device_count()} "
                "GPU(s) (CUDA_VISIBLE_DEVICES renumbers them from 0)"])
    return device


def device_fields(device: Device, root: Path = Path("/")) -> dict[str, str | int]:
    """For the ``started`` record: what the model runs on, so a slow or odd run can be traced
    to its GPU, driver and libraries from the journal alone. ``TORCH_VERSION`` says
    ``not loaded`` when nothing in the daemon needed torch."""
    if device.type != "cuda" and "torch" not in sys.modules:
        return {"DEVICE_NAME": "cpu", "TORCH_VERSION": "not loaded",
                "CPU_THREADS": usable_cores()}
    import torch

    if device.type != "cuda":
        return {"DEVICE_NAME": "cpu", "TORCH_VERSION": torch.__version__,
                "CPU_THREADS": torch.get_num_threads()}
    assert isinstance(device, torch.device)
    properties = torch.cuda.get_device_properties(device)
    major, minor = torch.cuda.get_device_capability(device)
    return {
        "DEVICE_NAME": properties.name,
        "NVIDIA_DRIVER": nvidia_driver_version(root) or "unknown",
        "CUDA_RUNTIME": torch.version.cuda or "unknown",
        "CUDNN_VERSION": torch.backends.cudnn.version() or 0,  # type: ignore[no-untyped-call]
        "COMPUTE_CAPABILITY": f"{major}.{minor}",
        "GPU_MEMORY_BYTES": int(properties.total_memory),
        "TORCH_VERSION": torch.__version__,
    }


def profile_for(device: Device) -> DeviceProfile:
    """Which per-device defaults (``device_defaults``) fit the device the model got."""
    return "gpu" if device.type == "cuda" else "cpu"


def usable_cores() -> int:
    """The CPUs this process may run on (a cpuset or ``taskset`` counts, not the host's)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def with_device_defaults(config: Config, device: Device, max_batch: int | None = None
                         ) -> tuple[Config, dict[str, str]]:
    """``config`` with the defaults of ``device``'s profile in every key the YAML left unset,
    and for the ``started`` record: the profile and the keys it set ("batch.max_size=64,...").
    ``max_batch``: the model's own bound on a batch, if it has one."""
    profile = profile_for(device)
    sections: dict[str, Any] = {}
    applied: dict[str, int] = {}
    workers = (config.preprocess.workers if "workers" in config.preprocess.model_fields_set
               else None)
    for name, values in device_defaults(profile, usable_cores(), workers).items():
        section: Section = getattr(config, name)
        unset = {key: value for key, value in values.items()
                 if key not in section.model_fields_set}
        if name == "batch" and max_batch is not None and "max_size" in unset:
            unset["max_size"] = min(unset["max_size"], max_batch)
        if unset:
            sections[name] = section.model_copy(update=unset)
            applied.update({f"{name}.{key}": value for key, value in unset.items()})
    return config.model_copy(update=sections), {"PROFILE": profile, "PROFILE_DEFAULTS": ",".join(
        f"{key}={value}" for key, value in applied.items()) or "none"}
