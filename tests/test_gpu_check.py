"""``bench/gpu_check.sh``, the device check, proven on the CPU before a GPU is at hand."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
STAGES = ["gpu_tests", "precision", "gpu_decode", "throughput", "flood_memory", "oom_split",
          "detection", "sandbox", "ocr"]


def gpu_check(out: Path, *args: str, timeout_s: float,
              root: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable}
    if root is not None:
        env["GPU_CHECK_ROOT"] = str(root)
    return subprocess.run(["bash", "bench/gpu_check.sh", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout_s, check=False)


@pytest.mark.devicecheck
@pytest.mark.timeout(300)
def test_dry_run_runs_every_stage_and_writes_the_report(tmp_path: Path) -> None:
    proc = gpu_check(tmp_path, "--dry-run", timeout_s=240)  # the bound: 4 minutes
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["status"] == "passed" and report["mode"].startswith("dry-run")
    assert list(report["stages"]) == STAGES
    for name, stage in report["stages"].items():
        assert stage["status"] in ("passed", "skipped"), (name, stage)
        assert stage["status"] == "passed" or stage["reason"], name  # a skip says why
    stages = report["stages"]
    assert stages["oom_split"]["completed"] == stages["oom_split"]["batch"]
    assert stages["flood_memory"]["completed"] == stages["flood_memory"]["files"]
    assert [row["batch"] for row in stages["throughput"]["rows"]] == [2, 4]
    assert stages["precision"]["fp16"]["reason"] == "fp16 needs a GPU"
    assert stages["ocr"]["read"] == ["Total 348.20 EUR"] * 2, stages["ocr"]
    assert stages["ocr"]["providers"] == ["CPUExecutionProvider"]
    decode = stages["gpu_decode"]
    assert decode["parity"]["ok"] and decode["parity"]["top5_identical"] == "2/2", decode
    assert decode["overlap"]["same_results"] and decode["overlap"]["staging_buffers"] == 2
    detection = stages["detection"]
    assert detection["reference_boxes"] > 0
    assert detection["matched_within_1px"] == detection["reference_boxes"], detection


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA works here")
def test_without_dry_run_and_without_cuda_it_fails_with_torchs_reason(tmp_path: Path) -> None:
    proc = gpu_check(tmp_path, timeout_s=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "--dry-run" in proc.stderr
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["status"] == "failed" and report["environment"]["cuda_error"] in report["error"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA works here")
def test_a_gpu_that_cuda_cannot_use_fails_the_check_with_torchs_message(tmp_path: Path) -> None:
    root = tmp_path / "host"  # the NVIDIA driver's files of a host with one GPU
    (root / "proc/driver/nvidia/gpus/0000:01:00.0").mkdir(parents=True)
    proc = gpu_check(tmp_path / "out", timeout_s=120, root=root)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert "0000:01:00.0" in proc.stderr and report["environment"]["cuda_error"] in proc.stderr
    assert "DeviceAllow=" in report["error"]
