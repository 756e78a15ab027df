"""CUDA memory for the stats record: figures a reader can check for a leak in the journal.

``max_memory_allocated`` alone is a lifetime peak, which the warm-up's largest batch dominates
for ever; here it is the peak *since the last record*, reset after each reading. Next to it:
what live tensors use (allocated) and what the caching allocator holds (reserved: above
allocated is its cache, not a leak), the device's own free/total (which also counts the CUDA
context and cuDNN workspaces, invisible to the allocator), the allocator's retries (it had to
free its cache to satisfy a request) and OOMs, and pinned host memory. After warm-up, reserved
and the per-interval peak stay flat while nothing unbounded exists.
"""

from __future__ import annotations

from typing import Any

import torch


def cuda_memory_fields(device: torch.device, cuda: Any = torch.cuda) -> dict[str, int]:
    """One stats record's CUDA figures; resets the peak. ``cuda`` is ``torch.cuda`` (a test
    passes a fake of its memory API: the only boundary that needs a GPU)."""
    counters = cuda.memory_stats(device)
    free_bytes, total_bytes = cuda.mem_get_info(device)
    fields = {
        "CUDA_ALLOCATED_BYTES": int(cuda.memory_allocated(device)),
        "CUDA_RESERVED_BYTES": int(cuda.memory_reserved(device)),
        "CUDA_PEAK_ALLOCATED_BYTES": int(cuda.max_memory_allocated(device)),
        "CUDA_FREE_BYTES": int(free_bytes),
        "CUDA_TOTAL_BYTES": int(total_bytes),
        "CUDA_ALLOC_RETRIES": int(counters.get("num_alloc_retries", 0)),
        "CUDA_OOMS": int(counters.get("num_ooms", 0)),
        "CUDA_PINNED_HOST_BYTES": int(cuda.host_memory_stats().get("allocated_bytes.current", 0)),
    }
    cuda.reset_peak_memory_stats(device)
    return fields
