"""The launch/collect split of the local engine (``models/engines/cuda_overlap.py``), forced on the
CPU: the same staging, split and fallback code the GPU runs, without the streams. The GPU itself
(copy stream, events, pinned memory, the overlap measured) is bench/gpu_check.sh's ``gpu_decode``
stage."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import torch
from inboxd.item import DecodedImage, WorkItem
from inboxd.models.engines.cuda_overlap import Overlap
from inboxd.models.engines.interface import DeviceFault
from inboxd.models.engines.local import LocalEngine, infer_splitting
from inboxd.models.host_buffers import SLOTS

from tests.models.test_gpu_faults import (
    CROP,
    AllocatesThenOOMs,
    Net,
    PoisonedContext,
    items,
    model_for,
)


def scores(outcomes: list[tuple[WorkItem, object]]) -> list[object]:
    return [result.top_k if hasattr(result, "top_k") else result for _, result in outcomes]


def test_on_the_cpu_the_engine_keeps_one_careful_path() -> None:
    engine = LocalEngine(model_for(Net()))
    assert engine.overlap is None and not engine.parallel_calls
    engine.close()


def test_staged_batches_give_the_careful_paths_results_and_reuse_their_buffers() -> None:
    torch.manual_seed(0)
    model = model_for(Net())
    overlap = Overlap(model)
    pointers = set()
    for size in (4, 3, 4, 1, 2, 4):
        batch = items(size)
        for n, item in enumerate(batch):  # distinct pixels per image and batch
            assert item.image is not None
            item.image.pixels[:] = (n * 37 + size * 11) % 256
        pending = overlap.launch(batch)
        pointers.add(overlap.staging.slots[(overlap.staging.turn - 1) % SLOTS].buffer.data_ptr())
        assert scores(pending.collect()) == scores(infer_splitting(model, batch))
    assert overlap.staging.allocations == SLOTS and len(pointers) == SLOTS


def test_a_larger_batch_after_a_reload_gets_a_larger_buffer() -> None:
    overlap = Overlap(model_for(Net()))
    for size in (2, 2, 8):
        overlap.launch(items(size)).collect()
    assert overlap.staging.allocations == SLOTS + 1


def test_crops_already_on_the_device_skip_the_staging() -> None:
    model = model_for(Net())
    overlap = Overlap(model)
    host, device = items(3), items(3)
    for item in device:
        assert item.image is not None
        item.image = DecodedImage.on_device(torch.from_numpy(item.image.pixels.copy()), CROP,
                                            CROP, "JPEG", "RGB")
    assert scores(overlap.launch(device).collect()) == scores(overlap.launch(host).collect())
    assert overlap.staging.allocations == 1  # only the host batch was staged


def test_a_second_call_launches_while_the_first_waits_for_its_results() -> None:
    """The next batch never waits for the previous one's results: batch 2 is launched (its
    copy enqueued) while batch 1's collect is still blocked."""
    engine = LocalEngine(model_for(Net()), overlap=True)
    assert engine.overlap is not None and engine.parallel_calls
    launched_second = threading.Event()
    order: list[str] = []
    launch = engine.overlap.launch

    def traced_launch(batch: list[WorkItem]) -> object:
        pending = launch(batch)
        order.append(f"launch {len(batch)}")
        if len(batch) == 2:
            launched_second.set()
        collect = pending.collect

        def traced_collect() -> object:
            if len(batch) == 3:
                assert launched_second.wait(10), "batch 2 was not launched while 1 waited"
            order.append(f"collect {len(batch)}")
            return collect()

        pending.collect = traced_collect  # type: ignore[method-assign]
        return pending

    engine.overlap.launch = traced_launch  # type: ignore[method-assign]

    async def two_in_flight() -> list[list[tuple[WorkItem, object]]]:
        first = asyncio.create_task(engine.infer(items(3)))
        await asyncio.sleep(0)
        return list(await asyncio.gather(first, engine.infer(items(2))))

    first, second = asyncio.run(two_in_flight())
    engine.close()
    assert len(first) == 3 and len(second) == 2
    assert order.index("launch 2") < order.index("collect 3")


def test_an_oom_on_the_overlapped_path_splits_with_nothing_of_the_batch_alive() -> None:
    network = AllocatesThenOOMs()
    engine = LocalEngine(model_for(network), overlap=True)
    outcomes = asyncio.run(engine.infer(items(8)))
    engine.close()
    assert [type(result).__name__ for _, result in outcomes] == ["Classification"] * 8
    assert network.alive_at_batch_1 == [[]] * 8


def test_a_device_error_on_the_overlapped_path_is_still_a_device_fault() -> None:
    error = torch.AcceleratorError("CUDA error: an illegal memory access was encountered")
    model = model_for(PoisonedContext(error))
    engine = LocalEngine(model, overlap=True)
    asyncio.run(engine.infer(items(1)))
    with pytest.raises(DeviceFault):
        asyncio.run(engine.infer(items(4)))
    engine.close()


def test_staging_needs_matching_crops() -> None:
    overlap = Overlap(model_for(Net()))
    batch = items(2)
    assert batch[1].image is not None
    batch[1].image.pixels = np.zeros((CROP + 1, CROP, 3), dtype=np.uint8)
    with pytest.raises(ValueError):
        overlap.launch(batch)


# -- on a real GPU: streams, events and pinned staging --------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
def test_on_the_gpu_two_calls_in_flight_give_the_careful_paths_results() -> None:
    model = model_for(Net(), device="cuda")
    engine = LocalEngine(model)
    assert engine.overlap is not None and engine.parallel_calls
    batches = [items(4) for _ in range(6)]
    for n, batch in enumerate(batches):
        for k, item in enumerate(batch):
            assert item.image is not None
            item.image.pixels[:] = (n * 31 + k * 7) % 256

    async def in_flight() -> list[list[tuple[WorkItem, object]]]:
        return list(await asyncio.gather(*(engine.infer(b) for b in batches)))

    got = asyncio.run(in_flight())
    engine.close()
    for batch, outcomes in zip(batches, got, strict=True):
        expected = scores(infer_splitting(model, batch))
        assert [r[0]["label"] for r in scores(outcomes)] == [r[0]["label"] for r in expected]
    assert engine.overlap.staging.pin and engine.overlap.staging.allocations == SLOTS
