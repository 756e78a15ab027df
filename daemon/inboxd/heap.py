"""Keep the garbage collector's full collections short: freeze what start-up left.

A full collection (generation 2) walks every container object the process has, with the GIL
held, so no thread of the process runs Python meanwhile. torch, numpy and the model leave
hundreds of thousands of such objects in the daemon, and they live as long as it does: each full
collection then stalls every result for a visible pause under a flood (docs/decisions.md,
"Full garbage collections frozen out"), in the commit process too.

``gc.freeze()`` moves every object there is to a permanent generation that no collection walks;
later collections walk only what was made after. What the
frozen objects hold is still freed when its reference count drops to zero. What is never
freed is a reference cycle among frozen objects that becomes garbage later (a configuration a
reload replaces, say): at most what start-up built, never anything per file. The collection
just before the freeze takes the cycles start-up left (once, before ``READY=1``).
"""

from __future__ import annotations

import gc
import time


def freeze_startup_heap() -> dict[str, float]:
    """Collect start-up's garbage, then freeze every object left. Call it once, when start-up
    is done and before the work begins. Returns ``frozen_objects`` and ``freeze_ms``, for the
    ``ready`` record."""
    started_s = time.perf_counter()
    gc.collect()
    gc.freeze()
    return {"frozen_objects": gc.get_freeze_count(),
            "freeze_ms": round((time.perf_counter() - started_s) * 1000, 1)}
