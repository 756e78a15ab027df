"""A model's answer that does not fit its batch fails only that batch's own input (issue 36,
class 3): a bring-your-own ``.onnx`` that answers some batch sizes with the wrong number of rows
is split until every photo has its own answer; a size the warm-up runs and the model cannot
answer is refused at start-up (exit 78) with the fix; and a stage that crashes counts the crash
against the files it held, not against every photo in flight."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
from pathlib import Path

import pytest
from inboxd.config import load_config
from inboxd.files.layout import processing_dir
from inboxd.item import WorkItem
from inboxd.models.engines.interface import ModelEngine, Outcome
from inboxd.pipeline.wiring import Pipeline

from tests.byo_models import labels_file, onnx_wrong_rows, run_pipeline
from tests.conftest import make_image, write_config
from tests.fakes import FakeModel


def photos(root: Path, count: int) -> dict[str, Path]:
    (root / "photos").mkdir()
    made = {}
    for n in range(count):
        path = root / "photos" / f"p{n:02}.png"
        make_image(path, size=(40, 30), color=(n * 9 % 250, 40, 90))
        made[f"p{n:02}"] = path
    return made


def test_a_model_answering_some_batch_sizes_with_wrong_rows_fails_no_photo(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Before: ``zip(strict=True)`` raised outside the model call's ``try``, the model stage
    crashed (exit 70), and two such crashes failed every claimed photo."""
    model = onnx_wrong_rows(tmp_path / "wrong.onnx", set(range(3, 8)))
    # The CPU warms batch sizes 1 and 8, which this model answers rightly; every size between
    # them but 2 (the start-up probe's) comes one row short.
    with caplog.at_level(logging.WARNING, logger="inboxd"):
        pipeline, _ = run_pipeline(
            tmp_path / "run", photos(tmp_path, 13),
            {"onnx": str(model), "labels": str(labels_file(tmp_path, 3))},
            batch={"max_size": 8, "max_delay_ms": 2000})
    assert pipeline.crashed is None
    splits = [r.getMessage() for r in caplog.records if "retrying as" in r.getMessage()]
    assert splits and all("tensor, not" in s for s in splits), splits


@pytest.mark.daemon
def test_a_batch_size_the_model_cannot_answer_is_refused_at_start_up(tmp_path: Path) -> None:
    model = onnx_wrong_rows(tmp_path / "wrong.onnx", {8})
    config = write_config(tmp_path, model={"onnx": str(model),
                                           "labels": str(labels_file(tmp_path, 3))},
                          batch={"max_size": 8})
    make_image(tmp_path / "inbox" / "a.png")
    ran = subprocess.run([sys.executable, "-m", "inboxd", "once", "-c", str(config)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert ran.returncode == 78, ran.stderr[-3000:]
    assert "answered a batch of 8 with a [7, 3] tensor" in ran.stderr, ran.stderr[-3000:]
    assert "set batch.max_size to 1" in ran.stderr, ran.stderr[-3000:]
    assert (tmp_path / "inbox" / "a.png").exists()


class CrashesOn(ModelEngine):
    """A model engine with a bug: a call with ``poison`` in its batch raises out of the engine
    (not an outcome), which crashes the model stage."""

    def __init__(self, poison: str, processing: Path, others: int) -> None:
        self.poison = poison
        self.processing = processing
        self.others = others
        self.model = FakeModel()

    async def warm_up(self, max_size: int) -> tuple[list[int], float]:
        return [], 0.0

    async def infer(self, batch: list[WorkItem]) -> list[Outcome]:
        if any(item.rel == self.poison for item in batch):
            # Not before other photos are claimed (queued, decoding, decoded) meanwhile.
            for _ in range(3000):
                if len(list(self.processing.iterdir())) > self.others:
                    break
                await asyncio.sleep(0.01)
            raise RuntimeError("a bug in the engine")
        pixels = [item.image.pixels for item in batch if item.image is not None]
        return list(zip(batch, self.model.classify(pixels), strict=True))

    def close(self) -> None:
        pass


@pytest.mark.slow  # a costly run: `make test`, not the fast tier
def test_a_crash_counts_only_against_the_files_inside_the_crashed_stage(tmp_path: Path) -> None:
    """Before: ``record_crash`` counted every claimed file, so after two crashes of the model
    stage on one photo's batch the photos being claimed and decoded meanwhile went to failed/
    as well ("the daemon crashed 2 times while this file was in flight")."""
    names = [f"f{n:02}.png" for n in range(12)]
    for n, name in enumerate(names):
        make_image(tmp_path / "inbox" / name, size=(8, 8), color=(n * 10 + 20, 0, 0))
    config = load_config(write_config(
        tmp_path, inbox={"settle_ms": 0}, batch={"max_size": 1},
        capacity={"queue": 4, "preprocess_cache": 4}))
    processing = processing_dir(config, tmp_path / "inbox")
    for _ in range(2):
        engine = CrashesOn("f00.png", processing, others=4)
        pipeline = Pipeline(config, FakeModel(), engine=engine)  # type: ignore[arg-type]
        asyncio.run(pipeline.process_backlog())
        assert pipeline.crashed is not None
    # The third start fails the crasher and finishes everything else.
    pipeline = Pipeline(config, FakeModel())  # type: ignore[arg-type]
    asyncio.run(pipeline.process_backlog())
    failed = sorted(p.name for p in (tmp_path / "failed").glob("*.png"))
    done = sorted(p.name for p in (tmp_path / "done").glob("*.png"))
    assert failed == ["f00.png"], failed
    assert done == names[1:], done
