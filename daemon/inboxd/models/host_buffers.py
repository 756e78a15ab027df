"""A batch's host buffers, kept and reused: the crops' stack (``Staging``; pinned for the GPU's
overlapped copies, ``models/engines/cuda_overlap.py``) and, on the CPU path, the network's float
input too (``HostStaging``, per thread, for ``Model.outputs``)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

SLOTS = 2  # batch n's buffer may still be copying while batch n+1 fills the other


@dataclass
class _Slot:
    buffer: torch.Tensor  # capacity×H×W×3 uint8, pinned on a GPU
    copied: Any = None  # a CUDA event: the copy out of this buffer has finished


class Staging:
    """Reused host buffers for the crops of a batch, ``SLOTS`` of them in turn."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.slots: list[_Slot] = []
        self.turn = 0
        self.allocations = 0  # a test reads it: buffers are made once, not per batch

    def fill(self, images: Sequence[np.ndarray[Any, Any]]) -> tuple[torch.Tensor, _Slot]:
        """The images stacked in the next free buffer: an N×H×W×3 view of it, and its slot."""
        shape = (len(images), *images[0].shape)
        if len(self.slots) < SLOTS:  # as large as the largest batch so far: few reallocations
            largest = max([shape[0], *(s.buffer.shape[0] for s in self.slots)])
            self.slots.append(self._new((largest, *shape[1:])))
        slot = self.slots[self.turn % SLOTS]
        self.turn += 1
        if slot.copied is not None:
            slot.copied.synchronize()  # its last copy must be done before it is overwritten
        if tuple(slot.buffer.shape[1:]) != shape[1:] or slot.buffer.shape[0] < shape[0]:
            slot.buffer = self._new(shape).buffer  # a larger batch after a reload
        view = slot.buffer[: shape[0]]
        np.stack(images, out=view.numpy())
        return view, slot

    def _new(self, shape: tuple[int, ...]) -> _Slot:
        self.allocations += 1
        return _Slot(torch.empty(shape, dtype=torch.uint8, pin_memory=self.pin))



class HostStaging(threading.local):
    """A batch's host buffers on the CPU path, kept and reused: the stacked crops (uint8
    N×H×W×3) and the network's input (float32 N×3×H×W, channels_last). Made afresh for every
    batch, these blocks of hundreds of KB stayed in malloc's arenas and grew the daemon's peak
    RSS with the length of a flood (``docs/decisions.md``). Per thread, so
    concurrent callers never share one; each
    call's outputs are consumed before the thread's next call reuses them."""

    def __init__(self) -> None:  # threading.local: run again in each thread that uses it
        self.pixels = Staging(pin=False)
        self.inputs: torch.Tensor | None = None

    def stage(self, images: Sequence[np.ndarray[Any, Any]],
              memory_format: torch.memory_format = torch.channels_last
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """The images stacked (N×H×W×3 uint8) and a float input of their shape, in
        ``memory_format``, to normalise into, the input grown to the largest batch seen."""
        pixels, _ = self.pixels.fill(images)
        count, height, width, channels = pixels.shape
        if self.inputs is None or self.inputs.shape[1:] != (channels, height, width) or (
                len(self.inputs) < count) or not self.inputs.is_contiguous(
                    memory_format=memory_format):
            self.inputs = torch.empty((count, channels, height, width)).contiguous(
                memory_format=memory_format)
        return pixels, self.inputs[:count]
