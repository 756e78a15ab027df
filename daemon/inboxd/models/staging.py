"""The CPU path's host buffers for a batch, kept and reused by each thread (``Model.outputs``)."""

from __future__ import annotations

import threading

import numpy as np
import numpy.typing as npt
import torch


class HostStaging(threading.local):
    """A batch's host buffers on the CPU path, kept and reused: the stacked crops (uint8
    N×H×W×3) and the network's input (float32 N×3×H×W, channels_last). Made afresh for every
    batch, these blocks of hundreds of KB added to the daemon's peak RSS under a flood: with
    every block of 128 KB or more mmapped (a fixed ``MALLOC_MMAP_THRESHOLD_``) the growth from
    2,000 to 20,000 null-model files fell from +30% to +6%, which puts it in such blocks left
    in malloc's arenas. Measured 12-03, a fresh daemon per flood, three of each: peak RSS above
    idle 3.7 / 4.7 MiB (2,000 / 20,000 files, medians) with these buffers kept, 5.6 / 6.2 made
    afresh (``bench/RESULTS.md``). Per thread, so concurrent callers never share one; each
    call's outputs are consumed before the thread's next call reuses them."""

    pixels: npt.NDArray[np.uint8] | None = None
    inputs: torch.Tensor | None = None

    def buffers(self, count: int, crop_shape: tuple[int, ...]
                ) -> tuple[npt.NDArray[np.uint8], torch.Tensor]:
        """Views of ``count`` images, the buffers grown to the largest batch seen."""
        if self.pixels is None or self.pixels.shape[1:] != crop_shape or (
                len(self.pixels) < count):
            self.pixels = np.empty((count, *crop_shape), dtype=np.uint8)
            height, width, channels = crop_shape
            self.inputs = torch.empty((count, channels, height, width)).contiguous(
                memory_format=torch.channels_last)
        assert self.inputs is not None
        return self.pixels[:count], self.inputs[:count]
