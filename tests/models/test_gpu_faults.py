"""The GPU path's faults, shown on the CPU: the real ``Model`` and the real local engine, with
fakes only at the device boundary (a network that raises what CUDA raises, a fake CUDA memory
API). The same checks against a real GPU are the ``gpu``-marked tests at the end."""

from __future__ import annotations

import asyncio
import gc
import subprocess
import sys
import threading
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from inboxd.decode.spec import PreprocessSpec
from inboxd.item import DecodedImage, PermanentError, TransientError, WorkItem
from inboxd.models.engines.interface import DeviceFault
from inboxd.models.engines.local import LocalEngine, infer_splitting
from inboxd.models.model import Model
from torch import nn

CROP = 8
SPEC = PreprocessSpec(resize=CROP, crop=CROP, interpolation="nearest", mean=(0.5,) * 3,
                      std=(0.5,) * 3)
LABELS = [f"class{n}" for n in range(4)]


class Net(nn.Module):
    """A tiny classifier; subclasses fail the way a GPU does."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(3 * CROP * CROP, len(LABELS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x.flatten(1))  # type: ignore[no-any-return]


def model_for(network: nn.Module, device: str = "cpu") -> Model:
    return Model("test", network.eval(), SPEC, LABELS, torch.device(device), "fp32", 1)


def items(count: int) -> list[WorkItem]:
    made = []
    for n in range(count):
        item = WorkItem(Path("/inbox"), f"{n}.png", f"{n}.png", Path(f"/claimed/{n}.png"))
        pixels = np.full((CROP, CROP, 3), n, dtype=np.uint8)
        item.image = DecodedImage(pixels, CROP, CROP, "PNG", "RGB")
        made.append(item)
    return made


# -- fault 1: the OOM split keeps the failed batch alive -------------------------------------


class AllocatesThenOOMs(Net):
    """Allocates activations 64× its input, then runs out of memory above batch size 1. At
    batch size 1 it records which of the failed calls' tensors are still referenced."""

    def __init__(self) -> None:
        super().__init__()
        self.failed: list[tuple[int, weakref.ref[torch.Tensor], weakref.ref[torch.Tensor]]] = []
        self.alive_at_batch_1: list[list[int]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        activations = x.repeat(64, 1, 1, 1)
        if x.shape[0] > 1:
            self.failed.append((x.shape[0], weakref.ref(x), weakref.ref(activations)))
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected at the device)")
        gc.collect()  # only what is really referenced survives this
        self.alive_at_batch_1.append([size for size, x_ref, a_ref in self.failed
                                      if x_ref() is not None or a_ref() is not None])
        return super().forward(activations[:1])


def test_oom_split_retries_the_halves_with_nothing_of_the_failed_batch_alive() -> None:
    network = AllocatesThenOOMs()
    outcomes = infer_splitting(model_for(network), items(8))
    assert [type(result).__name__ for _, result in outcomes] == ["Classification"] * 8
    assert sorted(size for size, _, _ in network.failed) == [2, 2, 2, 2, 4, 4, 8]
    assert len(network.alive_at_batch_1) == 8
    assert network.alive_at_batch_1 == [[]] * 8, (
        "tensors of failed calls (their batch sizes) were still alive during the retries")


def test_oom_at_batch_size_1_is_transient() -> None:
    class AlwaysOOM(Net):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected at the device)")

    outcomes = infer_splitting(model_for(AlwaysOOM()), items(2))
    assert all(isinstance(result, TransientError) for _, result in outcomes)


# -- fault 2: one GPU fault must not send the whole inbox to failed/ --------------------------


class PoisonedContext(Net):
    """After the first call, every call fails as a CUDA context does after an illegal address."""

    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.error = error
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls > 1:
            raise self.error
        return super().forward(x)


@pytest.mark.parametrize("error", [
    torch.AcceleratorError("CUDA error: an illegal memory access was encountered"),
    RuntimeError("cuDNN error: CUDNN_STATUS_EXECUTION_FAILED"),
    RuntimeError("CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm( handle)`"),
], ids=["accelerator-error", "cudnn", "cublas"])
def test_a_device_error_is_a_device_fault_and_blames_no_input(error: Exception) -> None:
    network = PoisonedContext(error)
    model = model_for(network)
    infer_splitting(model, items(1))  # a healthy first call
    with pytest.raises(DeviceFault, match=str(error)[:20]):
        infer_splitting(model, items(8))
    assert network.calls == 2, "a device error is not split and retried down to single files"


def test_an_input_that_fails_alone_on_a_broken_device_is_not_the_inputs_fault() -> None:
    """An error no marker recognises: split down to one input, then the device is asked."""
    network = PoisonedContext(ValueError("something went wrong"))
    model = model_for(network)
    infer_splitting(model, items(1))
    with pytest.raises(DeviceFault, match="a blank image fails too"):
        infer_splitting(model, items(4))


def test_an_input_that_fails_alone_on_a_healthy_device_is_that_inputs_fault() -> None:
    class FailsOnRed7(Net):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if bool((x[:, 0, 0, 0] == (7 - 127.5) / 127.5).any()):
                raise ValueError("this input breaks the model")
            return super().forward(x)

    outcomes = dict((item.key, result) for item, result in
                    infer_splitting(model_for(FailsOnRed7()), items(8)))
    assert isinstance(outcomes.pop("7.png"), PermanentError)
    assert all(type(result).__name__ == "Classification" for result in outcomes.values())


# -- fault 4: warm-up on the inference thread, at every size the batcher can produce ---------


class RecordsCalls(Net):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append((threading.current_thread().name, x.shape[0]))
        return super().forward(x)


def test_warm_up_runs_on_the_inference_thread() -> None:
    network = RecordsCalls()
    engine = LocalEngine(model_for(network))

    async def start_then_infer() -> None:
        await engine.warm_up(4)
        await engine.infer(items(3))

    try:
        asyncio.run(start_then_infer())
    finally:
        engine.close()
    threads = {name for name, _ in network.calls}
    assert len(threads) == 1 and threads.pop().startswith("inboxd-model"), network.calls
    assert [size for _, size in network.calls] == [1, 4, 3]


def test_on_a_gpu_every_batch_size_is_warmed_and_a_larger_one_later_only_adds_sizes() -> None:
    network = RecordsCalls()
    model = model_for(network)
    model.device = torch.device("cuda", 0)  # what warm_up_sizes decides by; nothing runs there
    assert model.warm_up_sizes(5) == [1, 2, 3, 4, 5]
    model.device = torch.device("cpu")
    assert model.warm_up_sizes(5) == [1, 5]


def test_a_larger_batch_than_a_programs_bound_is_refused() -> None:
    model = model_for(Net())
    model.max_batch = 16
    assert model.warm_up_sizes(16)[-1] == 16
    with pytest.raises(Exception, match=r"at most 16 images, but batch\.max_size is 17"):
        model.warm_up_sizes(17)


# -- fault 5: memory evidence that can show a leak -------------------------------------------


class FakeCudaMemory:
    """``torch.cuda``'s memory API for one device, with the figures a test sets."""

    def __init__(self) -> None:
        self.allocated_bytes = 100
        self.peak_bytes = 5000  # the warm-up's largest batch
        self.reserved_bytes = 6000
        self.free_bytes, self.total_bytes = 70_000, 80_000
        self.counters = {"num_alloc_retries": 2, "num_ooms": 1}
        self.pinned_bytes = 4096

    def memory_allocated(self, device: torch.device) -> int:
        return self.allocated_bytes

    def memory_reserved(self, device: torch.device) -> int:
        return self.reserved_bytes

    def max_memory_allocated(self, device: torch.device) -> int:
        return max(self.peak_bytes, self.allocated_bytes)

    def reset_peak_memory_stats(self, device: torch.device) -> None:
        self.peak_bytes = self.allocated_bytes  # what the allocator does

    def mem_get_info(self, device: torch.device) -> tuple[int, int]:
        return self.free_bytes, self.total_bytes

    def memory_stats(self, device: torch.device) -> dict[str, int]:
        return dict(self.counters)

    def host_memory_stats(self) -> dict[str, int]:
        return {"allocated_bytes.current": self.pinned_bytes}


def test_stats_records_carry_the_peak_since_the_last_record_and_the_device_view() -> None:
    from inboxd.models.memory import cuda_memory_fields

    cuda = FakeCudaMemory()
    device = torch.device("cuda", 0)
    first = cuda_memory_fields(device, cuda)
    assert first == {
        "CUDA_ALLOCATED_BYTES": 100, "CUDA_RESERVED_BYTES": 6000,
        "CUDA_PEAK_ALLOCATED_BYTES": 5000, "CUDA_FREE_BYTES": 70_000, "CUDA_TOTAL_BYTES": 80_000,
        "CUDA_ALLOC_RETRIES": 2, "CUDA_OOMS": 1, "CUDA_PINNED_HOST_BYTES": 4096,
    }
    cuda.allocated_bytes = 300  # a steady state after warm-up: no batch above 300 since
    second = cuda_memory_fields(device, cuda)
    assert second["CUDA_PEAK_ALLOCATED_BYTES"] == 300, "the warm-up's peak was not reset"
    cuda.peak_bytes = 900  # one batch reached 900 in this interval
    assert cuda_memory_fields(device, cuda)["CUDA_PEAK_ALLOCATED_BYTES"] == 900


def test_memory_fields_of_the_model_on_a_gpu_name_every_figure() -> None:
    """The real model's stats probe, with the CUDA memory API faked at the device."""
    model = model_for(Net())
    model.device = torch.device("cuda", 0)  # only the probe looks at it here
    model.cuda_memory = FakeCudaMemory()
    fields = model.memory_fields()
    assert {"CUDA_PEAK_ALLOCATED_BYTES", "CUDA_FREE_BYTES", "CUDA_TOTAL_BYTES",
            "CUDA_ALLOC_RETRIES", "CUDA_OOMS", "CUDA_PINNED_HOST_BYTES"} <= set(fields)


# -- fault 6: smaller items ------------------------------------------------------------------


def test_the_batch_independence_probe_runs_without_tf32() -> None:
    """TF32 matmuls differ by ~1e-3 between batch sizes and would reject a valid program."""
    from inboxd.models.loading import probe

    seen: list[tuple[bool, bool]] = []

    class RecordsTF32(Net):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append((torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32))
            return super().forward(x)

    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    try:
        probe(RecordsTF32().eval(), SPEC, torch.device("cpu"), check_batch_independence=True)
        assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == (
            True, True), "the probe restores the settings it changed"
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
    assert seen and set(seen) == {(False, False)}


def test_the_builtin_network_runs_with_batchnorm_folded_into_its_convolutions() -> None:
    from inboxd.models import efficientnet_lite as lite
    from inboxd.models.sources import builtin

    folded = builtin().network
    assert not [m for m in folded.modules() if isinstance(m, nn.BatchNorm2d)]
    reference = lite.load_efficientnet_lite0()
    x = torch.rand(2, 3, lite.CROP_SIZE, lite.CROP_SIZE, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        assert float((folded(x) - reference(x)).abs().max()) < 1e-3


# -- the same on a real GPU ------------------------------------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
def test_a_real_device_side_error_is_recognised_as_a_device_fault() -> None:
    """In a child process: the error leaves its CUDA context unusable."""
    code = ("import torch\nfrom inboxd.models.engines.interface import is_device_error\n"
            "x = torch.zeros(4, device='cuda')\n"
            "try:\n    x[torch.tensor([10], device='cuda')] = 1\n    torch.cuda.synchronize()\n"
            "except Exception as exc:\n    print('device fault:', is_device_error(exc), exc)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)
    assert "device fault: True" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.gpu
@gpu
def test_on_the_gpu_every_size_is_warmed_on_the_inference_thread() -> None:
    network = RecordsCalls()
    engine = LocalEngine(model_for(network, "cuda"))
    try:
        asyncio.run(engine.warm_up(6))
    finally:
        engine.close()
    assert [size for _, size in network.calls] == [1, 2, 3, 4, 5, 6]
    threads = {name for name, _ in network.calls}
    assert len(threads) == 1 and threads.pop().startswith("inboxd-model")


@pytest.mark.gpu
@gpu
def test_real_cuda_memory_fields_give_the_peak_of_each_interval() -> None:
    model = model_for(Net(), "cuda")
    blank = np.zeros((CROP, CROP, 3), dtype=np.uint8)
    model.predict([blank] * 256)
    first = model.memory_fields()
    model.predict([blank])
    second = model.memory_fields()
    assert second["CUDA_PEAK_ALLOCATED_BYTES"] < first["CUDA_PEAK_ALLOCATED_BYTES"]
    assert 0 < first["CUDA_FREE_BYTES"] < first["CUDA_TOTAL_BYTES"]
