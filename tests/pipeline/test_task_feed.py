"""The task join's feed gives a photo's copy back by identity (pipeline/task_join.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from inboxd.item import DecodedImage, WorkItem
from inboxd.pipeline.task_join import TaskFeed


def twin(shade: int) -> WorkItem:
    pixels = np.full((4, 4, 3), shade, dtype=np.uint8)
    return WorkItem(Path("/inbox"), "a.png", "a.png", "/inbox/.processing/default/a.png",
                    noticed_s=0.0, image=DecodedImage(pixels, 4, 4, "PNG", "RGB"))


def test_a_discarded_copy_leaves_the_feed_even_beside_an_equal_looking_one() -> None:
    """Two copies alike in every field but their pixels (``==`` on them compares numpy arrays,
    which raises): the one given back leaves the feed, the other stays."""
    first, second = twin(10), twin(200)
    feed = TaskFeed()
    feed.push(first)
    feed.push(second)
    feed.discard(second)
    assert len(feed) == 1 and feed.take_nowait() is first
    feed.discard(first)  # already taken into a batch: nothing to do
    assert len(feed) == 0
