"""On a GPU, batch n+1's host→device copy runs while batch n computes, and results come back on
a thread of their own.

A call is split in two. ``launch`` (on the model thread) stacks the crops straight into a reused
pinned staging buffer, enqueues the copy on a copy stream, makes the compute stream wait for that
copy only (an event), enqueues the network, top-k and the small device→host copy of the result
into pinned memory, and returns at once: CUDA runs it all asynchronously. ``Pending.collect``
(on the results thread) waits for that batch's event and builds the predictions. So while batch
n computes, the model thread is free to launch batch n+1, whose copy overlaps n's compute on
the copy stream; the next batch never waits for the previous one's results. That needs two
calls in flight: ``LocalEngine.parallel_calls`` is True on CUDA, for a model stage that sends
``capacity.in_flight_batches`` at once; with one call at a time it is still correct, and the
staging buffer still saves a stack, a pinned allocation and a copy per batch.

Two staging buffers take turns; one is refilled only after the copy out of it has finished (its
event), so an in-flight copy never reads half-overwritten pixels. Crops already on the device
(``decode/tensor.py``) need no staging and are stacked there.

On the CPU the same code runs with no streams and unpinned buffers (the tests prove staging
and the split on it); the daemon takes this path only on CUDA.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from inboxd.item import WorkItem
from inboxd.models.host_buffers import Staging
from inboxd.models.model import Model, Pixels, Prediction, on_host


@dataclass
class Pending:
    """A launched batch: its results are on their way to the host."""

    model: Model
    items: list[WorkItem]
    reduced: list[torch.Tensor]  # on the host (pinned on a GPU), filled when ``done`` is
    done: Any  # a CUDA event after the device→host copy, None on the CPU
    started_s: float

    def collect(self) -> list[tuple[WorkItem, Prediction | Exception]]:
        if self.done is not None:
            self.done.synchronize()  # this batch only: a later launch is not waited for
        # NaN shows in the reduced scores or vectors too; any failure sends the batch down the
        # careful path (``LocalEngine``), which splits it.
        self.model.check_finite(self.reduced[0], len(self.items))
        predictions = self.model.predictions(self.reduced)
        elapsed_ms = (time.perf_counter() - self.started_s) * 1000
        for item in self.items:
            item.inference_ms = elapsed_ms
            item.runtime, item.precision = self.model.runtime, self.model.precision
        return list(zip(self.items, predictions, strict=True))


class Overlap:
    def __init__(self, model: Model) -> None:
        self.model = model
        self.cuda = model.on_gpu
        self.staging = Staging(pin=self.cuda)
        self.copy_stream = (torch.cuda.Stream(model.device)  # type: ignore[no-untyped-call]
                            if self.cuda else None)

    def launch(self, items: list[WorkItem]) -> Pending:
        model = self.model
        started_s = time.perf_counter()
        images: list[Pixels] = [item.image.model_input for item in items if item.image is not None]
        if model.before_forward is not None:
            model.before_forward(len(images))
        with torch.inference_mode():
            pixels = self._to_device(images)
            outputs = model.forward(pixels)
            model.check_shape(outputs, len(images))
            reduced = model.reduce(outputs)
            if not self.cuda:
                return Pending(model, items, reduced, None, started_s)
            host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in reduced]
            for target, source in zip(host, reduced, strict=True):
                target.copy_(source, non_blocking=True)
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record()
        return Pending(model, items, host, done, started_s)

    def _to_device(self, images: list[Pixels]) -> torch.Tensor:
        if not on_host(images):
            return self.model.to_device(images)  # crops decoded on the device: no copy
        arrays = [image for image in images if isinstance(image, np.ndarray)]
        view, slot = self.staging.fill(arrays)
        if self.copy_stream is None:
            return view.clone()  # the CPU: the "copy" the device would make
        compute = torch.cuda.current_stream(self.model.device)
        with torch.cuda.stream(self.copy_stream):
            pixels = view.to(self.model.device, non_blocking=True)
            slot.copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
            slot.copied.record(self.copy_stream)
        compute.wait_event(slot.copied)  # the compute waits for this copy, not the stream's past
        # Made on the copy stream, used and freed on the compute stream: tell the allocator.
        pixels.record_stream(compute)
        return pixels
