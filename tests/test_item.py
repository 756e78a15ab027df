"""A result's timings: every one rounded once (a difference of rounded figures is not)."""

from __future__ import annotations

from pathlib import Path

from inboxd.item import WorkItem


def test_every_timing_of_a_result_has_at_most_three_decimals() -> None:
    item = WorkItem(Path("/in"), "a.png", "a.png", "/in/.processing/default/a.png",
                    noticed_s=10.0)
    # Stamps whose differences are not exact in binary floating point.
    item.enqueued_s, item.dequeued_s, item.preprocessed_s = 10.0001, 10.0040001, 10.0242
    item.inferred_s, item.inference_ms = 10.079404, 53.8000001
    timings = item.timings_ms(10.1931)  # batch_wait was 55.204 - 53.8 = 1.4039999999999964
    assert set(timings) == {"queue_wait", "preprocess", "batch_wait", "inference", "total"}
    for name, value in timings.items():
        assert len(repr(value).partition(".")[2]) <= 3, (name, value)
    assert timings["batch_wait"] == 1.404 and timings["inference"] == 53.8
