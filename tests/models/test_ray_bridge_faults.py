"""The Ray engine against a bridge that misbehaves: a real child process on the real socket
protocol (``scripted_bridge.py``), no Ray. Every item of a call gets exactly one outcome, on
the right item, or the whole call comes back to be sent again; the daemon never hangs on it."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from inboxd.config import load_config
from inboxd.item import DecodedImage, PermanentError, TransientError, WorkItem
from inboxd.models.engines import ray_bridge as ray_pipe
from inboxd.models.engines import ray_serve as ray_engine
from inboxd.models.engines.interface import EngineUnavailable
from inboxd.models.engines.ray_bridge_child import Bridge
from inboxd.models.engines.ray_replica import Replica, decode_reply
from inboxd.models.engines.ray_serve import RayEngine
from inboxd.models.model import Classification

from tests.conftest import write_config
from tests.fakes import POISON_RED, FakeModel

SCRIPT = Path(__file__).with_name("scripted_bridge.py")


@pytest.fixture(autouse=True)
def scripted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ray_pipe, "BRIDGE_COMMAND", (str(SCRIPT),))
    monkeypatch.setattr(ray_engine, "BRIDGE_MARGIN_S", 1.0)


@pytest.fixture
def make_engine(tmp_path: Path) -> Iterator[Any]:
    engines: list[RayEngine] = []

    def make(script: str) -> RayEngine:
        config = load_config(write_config(tmp_path, model={"engine": "ray", "ray": {
            "address": "127.0.0.1:1", "replica_resources": {"CPU": 1}, "call_timeout_s": 1,
            "reconnect_initial_s": 0.05, "reconnect_max_s": 0.1}}))
        engine = RayEngine(FakeModel(), config.model, 8)  # type: ignore[arg-type]
        engine.settings["script"] = script
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()


def batch(n: int, tag: str = "f") -> list[WorkItem]:
    crop = np.zeros((8, 8, 3), dtype=np.uint8)
    return [WorkItem(Path(), f"{tag}{i}", f"{tag}{i}", Path(),
                     image=DecodedImage(crop, 8, 8, None, "RGB")) for i in range(n)]


def labels(outcomes: list[Any]) -> list[tuple[str, Any]]:
    return [(item.key, o.top_k[0]["label"] if isinstance(o, Classification) else type(o))
            for item, o in outcomes]


def test_a_reply_with_the_wrong_number_of_outcomes_retries_the_batch(make_engine: Any) -> None:
    engine = make_engine("short")
    items = batch(3)
    outcomes = asyncio.run(engine.infer(items))
    assert [item for item, _ in outcomes] == items, "each item once, none invented"
    assert all(isinstance(o, TransientError) for _, o in outcomes), outcomes
    assert engine.lost_batches == 1


def test_stray_objects_in_a_reply_are_those_items_errors_only(make_engine: Any) -> None:
    outcomes = asyncio.run(make_engine("stray").infer(batch(4)))
    assert labels(outcomes) == [("f0", TransientError), ("f1", TransientError),
                                ("f2", "n2"), ("f3", "n3")]


def test_a_reply_without_its_replica_retries_the_batch(make_engine: Any) -> None:
    outcomes = asyncio.run(make_engine("no_replica").infer(batch(2)))
    assert [type(o) for _, o in outcomes] == [TransientError, TransientError]


def test_replies_for_no_call_of_ours_are_ignored(make_engine: Any) -> None:
    async def four() -> list[list[Any]]:
        engine = make_engine("strangers")
        return await asyncio.gather(*(engine.infer(batch(2, tag=t)) for t in "abcd"))

    for tag, outcomes in zip("abcd", asyncio.run(four()), strict=True):
        assert labels(outcomes) == [(f"{tag}0", "n0"), (f"{tag}1", "n1")]


@pytest.mark.parametrize("script", ["garbage", "truncated"])
def test_a_bridge_out_of_step_is_replaced_and_its_calls_sent_again(
        make_engine: Any, script: str) -> None:
    """Bytes that do not unpickle used to kill the reader thread silently: every call then
    waited out its timeout, on a bridge nobody replaced until then."""
    engine = make_engine(script)

    async def attempt() -> float:
        started = time.monotonic()
        with pytest.raises(EngineUnavailable):
            await engine.infer(batch(2))
        return time.monotonic() - started

    waited_s = asyncio.run(attempt())
    limit_s = 1.0 if script == "garbage" else 1.0 + 1.0 + 1.5  # truncated: call + margin
    assert waited_s < limit_s, waited_s
    assert not engine.connected


def test_a_bridge_whose_hello_is_garbage_is_a_failed_connection(make_engine: Any) -> None:
    engine = make_engine("bad_hello")
    with pytest.raises(EngineUnavailable, match="cannot deploy"):
        asyncio.run(engine.infer(batch(1)))
    assert not engine.connected and engine.connects == 0


def test_a_bridge_killed_with_four_calls_out_hands_all_four_back(make_engine: Any) -> None:
    engine = make_engine("hold")

    async def scenario() -> list[Any]:
        await engine.connect()
        assert engine.bridge is not None
        calls = [asyncio.ensure_future(engine.infer(batch(2, tag=t))) for t in "abcd"]
        while len(engine._pending) < 4:
            await asyncio.sleep(0.01)
        os.kill(engine.bridge.process.pid, signal.SIGKILL)
        results = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 5)
        assert not engine._pending
        # The next call starts a fresh bridge once the backoff is over.
        engine.settings["script"] = "echo"
        await asyncio.sleep(0.1)
        results.append(await engine.infer(batch(1)))
        return results

    *gone, after = asyncio.run(scenario())
    assert all(isinstance(r, EngineUnavailable) for r in gone), gone
    assert labels(after) == [("f0", "n0")] and engine.connects == 2


def replica(model: Any) -> Replica:
    """A replica around ``model``, without Serve or the model files (``__init__``'s part)."""
    made = Replica.__new__(Replica)
    made.model, made.name, made.broken = model, "test:1", None
    made.running = threading.Lock()
    return made


def photos(crops: list[Any]) -> list[Any]:
    """A call's photos: each crop with its displayed size (here the crop's own)."""
    return [(crop, (crop.shape[1], crop.shape[0])) for crop in crops]


def test_a_replica_failing_on_one_input_fails_that_input_only() -> None:
    crops = [np.full((8, 8, 3), red, dtype=np.uint8) for red in (40, POISON_RED, 41, 42)]
    reply = replica(FakeModel())(photos(crops))
    outcomes = decode_reply(reply, len(crops))
    assert [type(o).__name__ for o in outcomes] == ["Classification", "ModelError",
                                                    "Classification", "Classification"]
    assert isinstance(outcomes[1], PermanentError) and outcomes[1].reason_class == "model"
    assert [o.top_k[0]["index"] for o in outcomes if isinstance(o, Classification)] == [40, 41,
                                                                                        42]


def test_a_replica_whose_device_failed_loses_the_batch_and_fails_its_health_check() -> None:
    class Broken(FakeModel):
        def classify(self, images: Any) -> Any:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        predict = classify

    broken = replica(Broken())
    with pytest.raises(RuntimeError, match="device of replica"):
        broken(photos([np.zeros((8, 8, 3), dtype=np.uint8)] * 2))
    with pytest.raises(RuntimeError):
        broken.check_health()  # Serve replaces it


class Handle:
    """Serve's handle as the bridge sees it: ``remote`` returns an awaitable reply."""

    def __init__(self, how: str) -> None:
        self.how = how

    def remote(self, crops: list[Any], delay_s: float, **options: Any) -> Any:
        async def answer() -> Any:
            if self.how == "never":
                await asyncio.sleep(3600)
            if self.how == "dies":
                raise RuntimeError("ActorDiedError: the replica's node is gone\nsecond line")
            return {"replica": "r", "ms": 1.0, "outcomes": [("ok", None)] * len(crops)}
        return answer()


@pytest.mark.parametrize(("how", "kind", "why"), [
    ("never", "lost", "TimeoutError"), ("dies", "lost", "RuntimeError: ActorDiedError"),
    ("answers", "result", None)])
def test_the_bridge_answers_every_call_once_even_a_call_that_never_returns(
        how: str, kind: str, why: str | None) -> None:
    ours, theirs = socket.socketpair()
    daemon_end, bridge_end = Connection(ours.detach()), Connection(theirs.detach())
    bridge = Bridge(bridge_end, Handle(how), {"call_timeout_s": 0.2, "replica_delay_s": 0})
    asyncio.run(bridge.call(7, photos([np.zeros((8, 8, 3), dtype=np.uint8)] * 3), {}))
    answer = daemon_end.recv()
    assert answer[:2] == (kind, 7) and not daemon_end.poll(0.1), "one answer, for call 7"
    if why is not None:
        assert answer[2].startswith(why) and "\n" not in answer[2], answer
    daemon_end.close()
    bridge_end.close()


def test_a_task_on_a_cluster_that_is_gone_holds_the_whole_batch_of_a_models_config(
        make_engine: Any) -> None:
    """``models:`` with one task on Ray and one local: while the cluster cannot be reached the
    batch is held (``EngineUnavailable`` for the model stage, no attempt spent, no photo answered
    by one task only); once it is back each photo gets both sections."""
    from inboxd.models.engines.local import LocalEngine
    from inboxd.models.predictions import TaskResults
    from inboxd.models.tasks import TasksEngine

    ray = make_engine("bad_hello")
    local = LocalEngine(FakeModel())  # type: ignore[arg-type]
    tasks = TasksEngine({"things": FakeModel(), "labels": FakeModel()},  # type: ignore[dict-item]
                        {"things": ray, "labels": local}, 4)
    crop = np.zeros((8, 8, 3), dtype=np.uint8)
    photos = [WorkItem(Path(), f"p{i}", f"p{i}", Path(),
                       image=DecodedImage(crop, 8, 8, None, "RGB", others=(crop,)))
              for i in range(2)]
    try:
        with pytest.raises(EngineUnavailable):
            asyncio.run(tasks.infer(photos))
        ray.settings["script"] = "echo"
        ray._retry_at_s = 0.0  # the backoff is over
        outcomes = asyncio.run(tasks.infer(photos))
    finally:
        local.close()
    assert [item.key for item, _ in outcomes] == ["p0", "p1"]
    for _, outcome in outcomes:
        assert isinstance(outcome, TaskResults), outcome
        assert set(outcome.sections) == {"things", "labels"}
        assert all(isinstance(s, Classification) for s in outcome.sections.values()), outcome
