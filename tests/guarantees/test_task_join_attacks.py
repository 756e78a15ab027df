"""Attacks on several tasks per photo (``models:``, issue 38): the task join and each task's
own batcher and model stage, against the real daemon. A task that fails, hangs or answers with
the wrong row count on its own, a signal or a kill while photos wait in the join, a file
replaced under its name while its copies sit in the tasks' feeds, a reload while the join is
full: no photo lost, none doubled, every result of the bytes that were claimed, the join within
its capacity in the stats record."""

from __future__ import annotations

import asyncio
import collections
import io
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from inboxd.config import load_config
from inboxd.service.runner import config_changes
from PIL import Image

from support.harness import sha256_hex as sha
from support.photos import png_bytes
from support.waiting import wait_until
from tests import detectors
from tests.byo_models import labels_file
from tests.conftest import DaemonProcess, make_image, read_json, write_config


def photo(n: int) -> bytes:
    """A small PNG of its own bytes (its width, and the noise seeded by it)."""
    return png_bytes((40 + n, 30))


def drop_bytes(inbox: Path, name: str, data: bytes) -> None:
    """As a well-behaved writer: a hidden temp name, then a rename into place."""
    tmp = inbox / f".{name}.part"
    tmp.write_bytes(data)
    os.rename(tmp, inbox / name)


def join_stats(daemon: DaemonProcess, timeout_s: float, what: str,
               holds: Callable[[dict[str, float | str]], bool]) -> dict[str, float | str]:
    """The first stats record from now on for which ``holds``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        record = daemon.next_stats(timeout_s)
        if holds(record):
            return record
    raise AssertionError(f"no stats record with {what}:\n{daemon.tail()}")


def layers_over(daemon: DaemonProcess) -> dict[str, tuple[float, float]]:
    """Every layer whose high-water passed its capacity in any stats record so far."""
    over = {}
    for _, record in daemon.stats:
        for key, value in record.items():
            if key.endswith("_CAPACITY") and not key.startswith("PREPROCESS_CACHE_CAP"):
                layer = key.removesuffix("_CAPACITY")
                high = record.get(f"{layer}_HIGH_WATER")
                if isinstance(high, float) and isinstance(value, float) and high > value:
                    over[layer] = (high, value)
    return over


def test_a_task_taken_out_of_models_by_a_reload_is_said_to_need_a_restart(
        tmp_path: Path) -> None:
    """The reload record listed only the keys the new file has: a task taken out of
    ``models:`` was not named, and the record said nothing waited for a restart while the task
    went on running and writing its section."""
    block = detectors.yolo_block(tmp_path)
    old = load_config(write_config(tmp_path, model=None, models={"a": block, "b": block}))
    new = load_config(write_config(tmp_path, model=None, models={"b": block},
                                   capacity={"task_join": 9}))
    assert config_changes(old, new) == (["capacity.task_join"], ["models.a"])
    assert config_changes(new, old) == (["capacity.task_join"], ["models.a"])


@pytest.mark.daemon
@pytest.mark.slow  # three daemons in turn: `make test`, not the fast tier
def test_a_hung_task_holds_the_join_at_its_bound_and_signals_lose_nothing(
        tmp_path: Path) -> None:
    """One task's model hangs on its first batch (the fault hook on the first task) while the
    other answers: the other runs ahead by the join's capacity and no further, the cache and
    the queue fill and intake waits, every stats record has each layer within its capacity.
    Meanwhile a photo in the join is replaced under its name in the inbox, and a reload
    changes the tasks (a restart's business: the running tasks go on) and raises the join.
    SIGTERM then hands every photo back; a second daemon, hung again, is killed with -9 with
    the join full; a third without the fault finishes: every input's bytes end once in done/,
    each with a result of those bytes holding both tasks' sections."""
    block = detectors.yolo_block(tmp_path)
    models = {"stuck": {**block, "batch": {"max_size": 2, "max_delay_ms": 50}},
              "fast": {**block, "batch": {"max_size": 2, "max_delay_ms": 50}}}
    sections: dict[str, Any] = dict(
        model=None, models=models, shutdown={"grace_s": 2},
        capacity={"queue": 1, "preprocess_cache": 2, "task_join": 4})
    config = write_config(tmp_path, **sections)
    inbox = tmp_path / "inbox"
    inputs = {f"p{n:02}.png": photo(n) for n in range(12)}
    hang = {"INBOXD_TEST_MODEL_FAULTS": "hang_on_batch=1"}

    first = DaemonProcess(config, env=hang)
    try:
        first.wait_for("ready", 180)
        for name, data in inputs.items():
            drop_bytes(inbox, name, data)
        full = join_stats(first, 120, "the join, the cache and the queue full", lambda r: (
            r["TASK_JOIN_SIZE"] == 4 and r["PREPROCESS_CACHE_SIZE"] == 2
            and r["QUEUE_SIZE"] == 1))
        assert full["COMPLETED"] == 0 and full["TASK_JOIN_HIGH_WATER"] == 4
        # A photo of the join replaced under its name: its copies sit in both tasks' feeds.
        claimed = sorted(p.name for p in (inbox / ".processing" / "default").glob("p*.png"))
        assert claimed, "nothing claimed while the join is full"
        replaced = claimed[0]
        inputs[f"again-{replaced}"] = photo(100)
        drop_bytes(inbox, replaced, inputs[f"again-{replaced}"])
        # The tasks change in the file (a restart's business), the join's bound live.
        write_config(tmp_path, **{**sections, "models": {"fast": models["fast"]},
                                  "capacity": {**sections["capacity"], "task_join": 6}})
        first.proc.send_signal(signal.SIGHUP)
        reloaded = first.wait_for("reloaded", 60)[-1]
        assert "reloaded: capacity.task_join; needs restart to change: models.stuck" \
            in reloaded, reloaded
        join_stats(first, 60, "the join at its new bound", lambda r: (
            r["TASK_JOIN_SIZE"] == 6 and r["TASK_JOIN_CAPACITY"] == 6))
        assert layers_over(first) == {}
        assert first.stop(timeout_s=60) == 0, first.tail()
    finally:
        first.kill()
    assert not list((tmp_path / "done").glob("*.png")), "a photo done with one task hung"
    assert not (tmp_path / "failed").exists() or not list((tmp_path / "failed").iterdir())
    assert not list((inbox / ".processing" / "default").rglob("*.png")), "left claimed"

    write_config(tmp_path, **sections)  # both tasks again
    second = DaemonProcess(config, env=hang)
    try:
        second.wait_for("ready", 180)
        join_stats(second, 120, "the join full again", lambda r: r["TASK_JOIN_SIZE"] == 4)
        assert layers_over(second) == {}
        second.proc.send_signal(signal.SIGKILL)
        second.proc.wait(30)
    finally:
        second.kill()

    third = DaemonProcess(config)
    try:
        third.wait_for("ready", 180)
        wait_until(lambda: len(list((tmp_path / "done").glob("*.png"))) >= len(inputs), 180,
                   "every input done")
        assert third.stop(timeout_s=60) == 0, third.tail()
    finally:
        third.kill()
    done = {p.name: p.read_bytes() for p in (tmp_path / "done").glob("*.png")}
    by_bytes = collections.Counter(sha(data) for data in done.values())
    assert by_bytes == collections.Counter(sha(data) for data in inputs.values()), (
        "lost or doubled", sorted(done))
    for name, data in done.items():
        result = read_json(tmp_path / "results" / f"{name}.json")
        assert result["sha256"] == sha(data), f"done/{name}: a result of other bytes"
        image = Image.open(io.BytesIO(data))
        for task in models:
            assert result[task]["detections"] == detectors.expected_boxes(*image.size), task
    assert not (tmp_path / "failed").exists() or not list((tmp_path / "failed").iterdir())
    assert not list(inbox.glob("*.png")) and not list((inbox / ".processing").rglob("*.png"))


def colour(n: int) -> tuple[int, int, int]:
    """Flat, dark with one bright channel; for ``n % 4 == 3`` bright all over (the failing
    detector's error)."""
    rgb = [10, 10, 10] if n % 4 != 3 else [200, 210, 220]
    rgb[n % 3] = 250
    return rgb[0], rgb[1], rgb[2]


def coloured(n: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (48 + n, 36), colour(n)).save(buffer, "PNG")
    return buffer.getvalue()


def strongest_logit(rgb: tuple[int, int, int]) -> int:
    """The wrong-rows classifier's answer for a flat photo: the channel of the largest
    normalised mean (its logits are the channels' means)."""
    from inboxd.decode.spec import TORCHVISION_INPUT

    logits = [(value / 255 - mean) / std for value, mean, std in
              zip(rgb, TORCHVISION_INPUT.mean, TORCHVISION_INPUT.std, strict=True)]
    return logits.index(max(logits))


@pytest.mark.daemon
@pytest.mark.slow  # a daemon over a flood: `make test`, not the fast tier
def test_one_task_s_wrong_row_counts_and_input_errors_fail_only_themselves(
        tmp_path: Path) -> None:
    """One task's .onnx answers batches of 3 to 7 with a row too few, the other task's
    detector raises on bright photos: each batch is split in its own task until every photo
    has its own answer there, a bright photo keeps its detector error in that section and its
    classifier answer in the other, and its batch-mates are not blamed. Every photo is done
    once, none failed."""
    from tests.byo_models import onnx_wrong_rows

    rows_folder = tmp_path / "rows"
    rows_folder.mkdir()
    wrong = onnx_wrong_rows(rows_folder / "wrong-rows.onnx", set(range(3, 8)))
    things = detectors.yolo_block(tmp_path)
    things["onnx"] = str(detectors.yolo_onnx(tmp_path / "models" / "bright.onnx",
                                             fails_above_mean=0.6))
    config = write_config(tmp_path, model=None, inbox={"settle_ms": 0}, models={
        "rows": {"onnx": str(wrong), "labels": str(labels_file(rows_folder, 3)),
                 "batch": {"max_size": 8, "max_delay_ms": 300}},
        "things": {**things, "batch": {"max_size": 4, "max_delay_ms": 300}}})
    inputs = {f"c{n:02}.png": coloured(n) for n in range(20)}
    daemon = DaemonProcess(config)
    try:
        daemon.wait_for("ready", 180)
        for name, data in inputs.items():
            drop_bytes(tmp_path / "inbox", name, data)
        daemon.wait_for("completed", 180, count=len(inputs))
        assert daemon.stop(timeout_s=60) == 0, daemon.tail()
    finally:
        daemon.kill()
    splits = daemon.records("batch_split")
    assert any("model error" in split for split in splits), "no batch came back wrong"
    assert not (tmp_path / "failed").exists() or not list((tmp_path / "failed").iterdir())
    for n, (name, data) in enumerate(inputs.items()):
        assert (tmp_path / "done" / name).read_bytes() == data
        result = read_json(tmp_path / "results" / f"{name}.json")
        assert result["sha256"] == sha(data)
        expected = strongest_logit(colour(n))
        assert result["rows"]["top_k"][0]["index"] == expected, (name, result["rows"])
        if n % 4 == 3:
            assert result["things"]["reason_class"] == "model", (name, result["things"])
            assert "detections" not in result["things"]
        else:
            assert result["things"]["detections"] == detectors.expected_boxes(48 + n, 36), name


@pytest.mark.daemon
@pytest.mark.slow  # two daemons: `make test`, not the fast tier
def test_one_task_s_device_failing_gives_every_photo_back_once_and_the_restart_ends_each(
        tmp_path: Path) -> None:
    """The first task's device fails from its second call on (the fault hook), the other
    task's is sound: the daemon exits 76 for a restart with every photo either done (both
    tasks answered before the fault) or back in the inbox, none failed, none done with one
    section; the restart without the fault ends each once."""
    block = detectors.yolo_block(tmp_path)
    config = write_config(tmp_path, model=None, inbox={"settle_ms": 0}, models={
        "broken": {**block, "batch": {"max_size": 2, "max_delay_ms": 100}},
        "sound": {**block, "batch": {"max_size": 3, "max_delay_ms": 100}}})
    inbox = tmp_path / "inbox"
    inputs = {f"d{n:02}.png": photo(n) for n in range(14)}
    first = DaemonProcess(config, env={"INBOXD_TEST_MODEL_FAULTS": "device_error_from_batch=2"})
    try:
        first.wait_for("ready", 180)
        for name, data in inputs.items():
            drop_bytes(inbox, name, data)
        assert first.proc.wait(120) == 76, first.tail()
    finally:
        first.kill()
    assert "device_fault" in first.output()
    assert not (tmp_path / "failed").exists() or not list((tmp_path / "failed").iterdir())
    done = {p.name for p in (tmp_path / "done").glob("*.png")}
    back = {p.name for p in inbox.glob("*.png")}
    assert done | back == set(inputs) and not done & back, (sorted(done), sorted(back))
    assert not list((inbox / ".processing").rglob("*.png")), "left claimed"
    for name in done:
        assert set(read_json(tmp_path / "results" / f"{name}.json")) >= {"broken", "sound"}

    second = DaemonProcess(config)
    try:
        second.wait_for("ready", 180)
        wait_until(lambda: {p.name for p in (tmp_path / "done").glob("*.png")} == set(inputs),
                   180, "every photo done")
        assert second.stop(timeout_s=60) == 0, second.tail()
    finally:
        second.kill()
    for name, data in inputs.items():
        result = read_json(tmp_path / "results" / f"{name}.json")
        assert result["sha256"] == sha(data) == sha((tmp_path / "done" / name).read_bytes())
        assert "detections" in result["broken"] and "detections" in result["sound"]
    assert len(list((tmp_path / "results").glob("*.json"))) == len(inputs)


def test_a_photo_replaced_under_its_name_while_its_copies_wait_in_the_join_is_another_input(
        tmp_path: Path) -> None:
    """``a.png`` is claimed and answered by the fast task; the slow task holds it. A new
    ``a.png`` (other bytes) is dropped, claimed and answered by the fast task too: two photos
    of one name in the join, their copies side by side in the slow task's feed. Let go, each
    gets its own result, of its own bytes, with both tasks' answers of its own pixels (the
    fake models answer a photo's red value), and neither overwrites the other in done/."""
    from inboxd.pipeline.task_stages import TaskStages
    from inboxd.pipeline.wiring import Pipeline

    from tests.fakes import FakeModel, ScriptedWatch
    from tests.pipeline.test_task_stages import GatedModel, with_models

    config = load_config(write_config(
        tmp_path, inbox={"settle_ms": 0, "rescan_interval_s": 3600}, model=None,
        models={"fast": {"batch": {"max_size": 2, "max_delay_ms": 20}},
                "slow": {"batch": {"max_size": 2, "max_delay_ms": 20}}}))
    watch = ScriptedWatch()
    fast, slow = GatedModel(), GatedModel()
    slow.gate.clear()
    tasks: dict[str, Any] = {"fast": FakeModel(), "slow": FakeModel()}
    pipeline = with_models(Pipeline(config, FakeModel(), watch=watch,  # type: ignore[arg-type]
                                    tasks=tasks), fast=fast, slow=slow)
    stages = pipeline.model_stage
    assert isinstance(stages, TaskStages)
    inbox = tmp_path / "inbox"

    async def until(done: Callable[[], bool]) -> None:
        while not done():
            await asyncio.sleep(0.01)

    async def scenario() -> None:
        stop, force = asyncio.Event(), asyncio.Event()
        serving = asyncio.create_task(pipeline.serve(stop, force))
        await watch.started.wait()
        for answered, red in ((1, 40), (2, 60)):
            watch.push(make_image(inbox / "a.png", size=(8, 8), color=(red, 0, 0)))
            await until(lambda answered=answered: fast.answered == answered)  # type: ignore[misc]
        assert stages.join.size == 2  # both copies of a.png wait for the slow task
        slow.gate.set()
        await until(lambda: pipeline.stats.counters.completed == 2)
        stop.set()
        await serving

    asyncio.run(asyncio.wait_for(scenario(), 60))
    done = sorted((tmp_path / "done").glob("a*.png"))
    assert len(done) == 2, done
    reds = set()
    for path in done:
        result = read_json(tmp_path / "results" / f"{path.name}.json")
        assert result["sha256"] == sha(path.read_bytes()), path.name
        red = Image.open(path).getpixel((0, 0))[0]  # type: ignore[index]
        assert result["fast"]["top_k"][0]["index"] == result["slow"]["top_k"][0]["index"] == red
        reds.add(red)
    assert reds == {40, 60}


@pytest.mark.skipif(os.geteuid() != 0, reason="acting as another uid needs root")
def test_the_daemon_s_first_area_swapped_back_in_is_put_back_despite_its_helpers_lock(
        root: Path) -> None:
    """Found by the several-task model-based run: a member renames ``.processing`` away (the
    daemon puts a fresh area back), then swaps the daemon's first area back in. That area's
    lock is still held by the helpers that inherited it at start-up, so the put-back failed
    with LockHeld (the daemon's own pid) for as long as the member left it there: claims went
    on into the area held under the member's name, and every claimed path, read by name (the
    commit process's moves), led into the first area, where nothing is (moves retried without
    end; a user with write access could touch the claimed files where they were)."""
    from inboxd.files.lifecycle import Lifecycle

    from tests.guarantees.test_planted_links import as_neighbour, shared_inbox

    config_path = write_config(root, inbox={"settle_ms": 0})
    inbox = root / "inbox"
    shared_inbox(inbox)
    lifecycle = Lifecycle(load_config(config_path))
    lifecycle.lock_instance()
    helper = os.dup(lifecycle.lock_fds()[0])  # what a helper process inherits at start-up
    try:
        (inbox / "first.png").write_bytes(b"first")
        first = lifecycle.claim(inbox, "first.png")
        assert first is not None
        as_neighbour(lambda: os.rename(inbox / ".processing", inbox / ".processing-was"))
        assert lifecycle.ensure_claim_areas() == 1  # a fresh area at the name
        assert Path(first).read_bytes() == b"first"

        def swap_back() -> None:
            os.rename(inbox / ".processing", inbox / ".processing-fresh")
            os.rename(inbox / ".processing-was", inbox / ".processing")

        as_neighbour(swap_back)
        assert lifecycle.ensure_claim_areas() == 1, "the area was not put back"
        assert Path(first).read_bytes() == b"first"  # the claimed path leads to its file
        (inbox / "second.png").write_bytes(b"second")
        second = lifecycle.claim(inbox, "second.png")
        assert second is not None and Path(second).read_bytes() == b"second"
        assert lifecycle.release(first, inbox / "first.png") is not None
        assert (inbox / "first.png").read_bytes() == b"first"
    finally:
        os.close(helper)
        lifecycle.unlock_instance()
