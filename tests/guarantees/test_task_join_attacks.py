"""Attacks on several tasks per photo (``models:``, issue 38): the task join and each task's
own batcher and model stage, against the real daemon. A task that fails, hangs or answers with
the wrong row count on its own, a signal or a kill while photos wait in the join, a file
replaced under its name while its copies sit in the tasks' feeds, a reload while the join is
full: no photo lost, none doubled, every result of the bytes that were claimed, the join within
its capacity in the stats record."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest

from tests import detectors
from tests.byo_models import labels_file, onnx_memory_bomb
from tests.conftest import DaemonProcess, make_image, write_config
from tests.guarantees.test_hostile_models import CGROUP_LIMIT_BYTES, memory_cgroup


def detector_block(root: Path) -> dict[str, Any]:
    """The constant YOLO-layout detector (``tests/detectors.py``): cheap, and its boxes known."""
    folder = root / "models"
    folder.mkdir(exist_ok=True)
    labels = folder / "coco.txt"
    labels.write_text("\n".join(detectors.LABELS) + "\n")
    return {"onnx": str(detectors.yolo_onnx(folder / "yolo.onnx")), "output": "detect",
            "labels": str(labels)}


@pytest.mark.daemon
@pytest.mark.slow  # a costly run: `make test`, not the fast tier
def test_a_reload_to_a_batch_size_a_task_s_onnx_cannot_afford_is_refused_not_fatal(
        tmp_path: Path) -> None:
    """A ``models:`` task's bring-your-own .onnx that takes the top-level batch: a reload to a
    size it has never run is tried in the memory-limited child first, as the one-model .onnx
    is (before: the reload warmed the new size in the daemon, which the OOM killer ended, with
    the photos of the join in flight)."""
    bomb_folder = tmp_path / "bomb"
    bomb_folder.mkdir()
    bomb = onnx_memory_bomb(bomb_folder / "bomb.onnx", side=4000)  # 64 MB an image
    models = {"things": detector_block(tmp_path),
              "bomb": {"onnx": str(bomb), "labels": str(labels_file(bomb_folder, 3))}}
    config = write_config(tmp_path, model=None, models=models, batch={"max_size": 8})
    with memory_cgroup(f"inboxd-test-{os.getpid()}", CGROUP_LIMIT_BYTES) as procs:
        daemon = DaemonProcess(config)
        try:
            procs.write_text(str(daemon.proc.pid))  # long before its models load
            daemon.wait_for("ready", 180)
            write_config(tmp_path, model=None, models=models, batch={"max_size": 64})  # 4 GB
            daemon.proc.send_signal(signal.SIGHUP)
            refused = daemon.wait_for("reloaded", 120)[-1]
            assert "reload refused" in refused and "needs more memory" in refused, refused
            assert "models.bomb" in refused, refused  # the task's key, to fix
            make_image(tmp_path / "inbox" / "a.png")
            daemon.wait_for("completed", 60)
        finally:
            code = daemon.stop()
    assert code == 0, daemon.output()
    assert (tmp_path / "done" / "a.png").is_file()
