"""Which device the model gets, and how loudly a GPU that CUDA cannot use is reported. On this
CPU machine torch's CUDA really is unusable; only the NVIDIA driver's files are faked, as a
folder passed in as the filesystem root."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from inboxd.config import ConfigError, ModelConfig
from inboxd.models.device import device_fields, nvidia_driver_version, pick_device
from inboxd.models.loading import load_model

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA works here")

DRIVER_VERSION_FILE = (
    "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.86.15  Release Build  "
    "(dvs-builder@U16-I3-B03-4-3)  Thu Jan  1 00:00:00 UTC 2026\n"
    "GCC version:  gcc version 12.3.0 (Ubuntu 12.3.0-1ubuntu1~22.04)\n")


def nvidia_host(root: Path) -> Path:
    """What the NVIDIA driver puts on a host with one GPU."""
    (root / "proc/driver/nvidia/gpus/0000:01:00.0").mkdir(parents=True)
    (root / "proc/driver/nvidia/version").write_text(DRIVER_VERSION_FILE)
    (root / "dev").mkdir()
    (root / "dev/nvidiactl").touch()
    return root


def test_auto_on_a_gpu_host_where_cuda_fails_warns_with_torchs_error_and_what_to_do(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="inboxd"):
        assert pick_device("auto", root=nvidia_host(tmp_path)) == torch.device("cpu")
    [warning] = [r for r in caplog.records if r.levelno == logging.WARNING]
    message = warning.getMessage()
    assert "0000:01:00.0" in message and "on the CPU" in message
    assert "driver 570.86.15" in message
    if torch.version.cuda:  # a CUDA build: torch's own reason, and the driver it needs
        assert "NVIDIA driver" in message and f"CUDA {torch.version.cuda}" in message
    assert "DeviceAllow=" in message and "download.pytorch.org/whl/cu12" in message


def test_auto_without_nvidia_hardware_is_the_cpu_quietly(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="inboxd"):
        assert pick_device("auto", root=tmp_path) == torch.device("cpu")
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_device_cuda_where_cuda_fails_is_a_config_error_with_torchs_message() -> None:
    with pytest.raises(ConfigError) as caught:
        load_model(ModelConfig(device="cuda"))
    message = str(caught.value)
    assert message.startswith("model: device: cuda")
    reason = "NVIDIA driver" if torch.version.cuda else "not compiled with CUDA"
    assert reason in message and "device: auto" in message


def test_the_driver_version_is_read_from_the_kernel_module(tmp_path: Path) -> None:
    assert nvidia_driver_version(nvidia_host(tmp_path)) == "570.86.15"
    assert nvidia_driver_version(tmp_path / "nothing") is None


def test_device_fields_on_the_cpu_name_the_cpu() -> None:
    assert device_fields(torch.device("cpu"))["DEVICE_NAME"] == "cpu"
