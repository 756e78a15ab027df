"""``bench/gpu_stages.py``'s OOM stage on a real GPU: a CUDA out-of-memory error is split until
every file completes, and the allocator ends back at its baseline (the device check runs the
same stage; ``tests/models/test_gpu_faults.py`` proves the split on the CPU with a fake OOM)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.gpu_stages import oom_split

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
def test_a_real_cuda_oom_is_split_until_every_file_completes_back_at_baseline(
        tmp_path: Path) -> None:
    result = oom_split(dry_run=False, out=tmp_path)
    assert result["status"] == "passed", result
