"""``model.engine: ray``: batches go to a Ray Serve application whose replicas hold the model.

This host keeps everything durable (claims, results, moves, retries) and decodes each photo as
the task needs it (``ray_replica`` says what runs there: the model, with everything it does after
the decode); only that runs on the cluster, whatever the task: a classifier, an embedder, a
detector, OCR. A call carries the batch's decoded pixels and each photo's displayed size, and
the answers are checked against the task's type and bound (``Expected``) before they are
trusted. Ray itself lives in a child process (``ray_bridge``), started on the first
connection and again after the cluster was lost, so a dead head costs a bridge, never the daemon.
This module never imports Ray: with ``engine: local`` nothing of it is loaded at all.

What each failure costs:
- a replica or node that dies with a batch on it (or a batch past ``call_timeout_s``): that
  batch's items come back as ``TransientError`` and go through the retry list like any
  transient error (an attempt each); Serve replaces the replica where resources allow;
- the cluster unreachable (the bridge cannot connect, or exits because its head is gone):
  ``EngineUnavailable``, no attempt spent; the model stage holds its batches and sends them again
  after a backoff that doubles from ``reconnect_initial_s`` to ``reconnect_max_s``, and the
  backlog waits on disk behind the full pipeline.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from inboxd import logs, testing
from inboxd.config import ModelConfig
from inboxd.item import TransientError, WorkItem
from inboxd.models.engines.interface import EngineUnavailable, ModelEngine, Outcome
from inboxd.models.engines.ray_bridge import BridgeGone, BridgeProcess
from inboxd.models.engines.ray_replica import (
    BadReply,
    Photo,
    decode_reply,
    expected_answer,
    model_files,
)
from inboxd.models.predictions import TaskModel
from inboxd.stats import Window

# Deploying loads and warms the model on every replica; past this the attempt counts as failed.
START_TIMEOUT_S = 600
# Replicas whose latency the stats report: the most recent ones (replaced replicas drop out).
MAX_REPLICAS_TRACKED = 32
# What the log line of a connection reads from the bridge's ("ready", info).
INFO_KEYS = frozenset({"app_name", "reused", "nodes", "replicas"})
# The bridge times each call out itself (call_timeout_s); past this margin more, the bridge is
# the stuck one (or the pipe is out of step) and is replaced.
BRIDGE_MARGIN_S = 30.0


class RayEngine(ModelEngine):
    parallel_calls = True  # the model stage keeps capacity.in_flight_batches calls out

    def __init__(self, model: TaskModel, config: ModelConfig, max_batch_size: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.model = model  # on this host only for its checks; inference runs on the replicas
        self.expected = expected_answer(model.output, config)
        # OCR's crop layer: its capacity goes with every call (the bound holds on the replica,
        # and a SIGHUP's new one reaches it), its high-water mark comes back in every reply.
        self.crops = getattr(model, "crops", None)
        self.ray = config.ray
        # The longest one ``infer`` can legitimately take: (re)connecting and deploying, then
        # the call with the bridge's own timeout and our margin on it. Everything in it is
        # timed out here, so the watchdog must not call it hung sooner: a slow redeploy or a
        # remote node that hangs costs a retry, and restarting this host would bring no remote
        # GPU back.
        self.call_limit_s = START_TIMEOUT_S + self.ray.call_timeout_s + BRIDGE_MARGIN_S
        self.clock = clock
        self.settings: dict[str, Any] = {
            "address": self.ray.address, "app_name": self.ray.app_name,
            "replicas": self.ray.replicas, "replica_resources": dict(self.ray.replica_resources),
            "call_timeout_s": self.ray.call_timeout_s,
            "model_config": config.model_dump(mode="json"), "files": model_files(config),
            "max_batch_size": max_batch_size,
            # The test-only slow-replica hook: seconds every batch sleeps on the replica (a slow
            # GPU), sent with every call (any replica can be slowed).
            "replica_delay_s": float(testing.hook(testing.RAY_REPLICA_DELAY_S) or 0),
        }
        self.bridge: BridgeProcess | None = None
        self.info: dict[str, Any] = {}
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._next_id = 0
        self._lock: asyncio.Lock | None = None
        self._retry_at_s = 0.0
        self._backoff_s = self.ray.reconnect_initial_s
        self.unavailable_why = "not connected yet"
        self.connects = 0  # bridges that reached the cluster (1 + reconnections)
        self.lost_batches = 0  # batches handed back as transient (a replica or node died)
        self.replica_ms: OrderedDict[str, Window] = OrderedDict()

    @property
    def connected(self) -> bool:
        return self.bridge is not None and not self.bridge.closed

    async def warm_up(self, max_size: int) -> tuple[list[int], float]:
        """The replicas warm themselves up while Serve starts them; this connects and deploys.
        A cluster not reachable now is logged, not fatal: the first batch tries again."""
        self.model.check_batch_size(max_size)
        started = time.perf_counter()
        try:
            await self.connect()
        except EngineUnavailable as exc:
            logs.emit(logging.WARNING, "model_unavailable",
                      f"the Ray cluster at {self.ray.address} is not reachable ({exc}): files "
                      "wait in the inbox until it is", error=str(exc))
            return [], 0.0
        return self.model.warm_up_sizes(max_size), time.perf_counter() - started

    async def connect(self) -> dict[str, Any]:
        """A running bridge, started now if needed; ``EngineUnavailable`` while the cluster is
        unreachable (and during the backoff after a failed attempt)."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self.connected:
                return self.info
            wait_s = self._retry_at_s - self.clock()
            if wait_s > 0:
                raise EngineUnavailable(self.unavailable_why, wait_s)
            try:
                self.info = await self._start_bridge()
            except (BridgeGone, TimeoutError) as exc:
                self.unavailable_why = str(exc) or "connecting timed out"
                self._retry_at_s = self.clock() + self._backoff_s
                self._backoff_s = min(self._backoff_s * 2, self.ray.reconnect_max_s)
                raise EngineUnavailable(self.unavailable_why,
                                        self._retry_at_s - self.clock()) from None
            self._backoff_s = self.ray.reconnect_initial_s
            self.connects += 1
            logs.emit(logging.INFO, "model_connected",
                      f"Ray Serve application {self.info['app_name']} "
                      f"{'reused' if self.info['reused'] else 'deployed'} on "
                      f"{self.info['nodes']} node(s): replicas {self.info['replicas']}",
                      app_name=self.info["app_name"], nodes=self.info["nodes"],
                      replicas=json.dumps(self.info["replicas"]), connects=self.connects)
            return self.info

    async def _start_bridge(self) -> dict[str, Any]:
        bridge = BridgeProcess(self._on_message, lambda: self._on_closed(bridge))
        bridge.start_reading()
        try:
            await bridge.send(self.settings)
            first = await asyncio.wait_for(asyncio.shield(bridge.first), START_TIMEOUT_S)
        except BaseException:
            bridge.kill()
            raise
        # Checked like every reply: a hello that is not ("ready", info) is a failed start
        # (retried with backoff), not an exception out of the model stage.
        kind, payload = first if isinstance(first, tuple) and len(first) == 2 else ("?", first)
        if kind != "ready" or not isinstance(payload, dict) or not payload.keys() >= INFO_KEYS:
            bridge.kill()
            raise BridgeGone(f"cannot deploy on the Ray cluster at {self.ray.address}: "
                             f"{payload}")
        self.bridge = bridge
        return dict(payload)

    def _on_message(self, message: Any) -> None:
        # Anything but ("result" | "lost", a call of ours, payload) answers no call: a call
        # whose answer never comes is timed out like a stuck bridge.
        if not (isinstance(message, tuple) and len(message) == 3
                and message[0] in ("result", "lost") and isinstance(message[1], int)):
            logs.log.error("the Ray bridge sent something that is no reply: %.200r", message)
            return
        future = self._pending.get(message[1])
        if future is not None and not future.done():
            future.set_result(message)

    def _on_closed(self, bridge: BridgeProcess) -> None:
        if bridge is not self.bridge:
            return
        self.bridge = None
        code = bridge.process.exit_code()
        status = "" if code is None else f", exit status {code}"
        self.unavailable_why = (f"the connection to the Ray cluster at {self.ray.address} was "
                                f"lost (the Ray bridge process closed its connection{status})")
        self._retry_at_s = self.clock() + self._backoff_s
        for future in self._pending.values():
            if not future.done():
                future.set_exception(EngineUnavailable(self.unavailable_why, self._backoff_s))
        threading.Thread(target=bridge.kill, daemon=True).start()  # reap it off the loop

    async def infer(self, batch: list[WorkItem]) -> list[Outcome]:
        await self.connect()
        bridge = self.bridge
        assert bridge is not None
        call_id = self._next_id = self._next_id + 1
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[call_id] = future
        photos: list[Photo] = [(item.image.pixels, (item.image.width, item.image.height))
                               for item in batch if item.image is not None]
        options = {} if self.crops is None else {"ocr_crops": self.crops.capacity}
        try:
            await bridge.send(("infer", call_id, photos, options))
            kind, _, payload = await asyncio.wait_for(future,
                                                      self.ray.call_timeout_s + BRIDGE_MARGIN_S)
        except BridgeGone as exc:
            raise EngineUnavailable(str(exc), self._backoff_s) from None
        except TimeoutError:
            bridge.kill()  # a bridge that answers nothing is no bridge: start a fresh one
            raise EngineUnavailable("the Ray bridge stopped answering", 0) from None
        finally:
            self._pending.pop(call_id, None)
        if kind == "lost":
            return self._lost(batch, str(payload))
        try:
            decoded = decode_reply(payload, len(batch), self.expected)
            replica, ms = str(payload["replica"]), float(payload["ms"])
            crops_high_water = int(payload.get("ocr_crops_high_water", 0))
        except (BadReply, KeyError, TypeError, ValueError, AttributeError) as exc:
            return self._lost(batch, f"a malformed reply: {exc}")
        self._record(replica, ms)
        if self.crops is not None:
            self.crops.saw_elsewhere(crops_high_water)
        for item in batch:
            item.inference_ms = ms
        return list(zip(batch, decoded, strict=True))

    def _lost(self, batch: list[WorkItem], why: str) -> list[Outcome]:
        self.lost_batches += 1
        logs.emit(logging.WARNING, "batch_lost",
                  f"a batch of {len(batch)} was lost on the Ray cluster ({why}): its "
                  "files are retried", batch_size=len(batch), error=why)
        return [(item, TransientError(f"the batch was lost on the Ray cluster: {why}"))
                for item in batch]

    def _record(self, replica: str, ms: float) -> None:
        window = self.replica_ms.pop(replica, None) or Window()
        window.add(ms)
        self.replica_ms[replica] = window
        while len(self.replica_ms) > MAX_REPLICAS_TRACKED:
            self.replica_ms.popitem(last=False)

    def stats_fields(self) -> dict[str, Any]:
        latency = {name: {"p50_ms": round(w.percentile(50), 1),
                          "p95_ms": round(w.percentile(95), 1), "samples": len(w.samples)}
                   for name, w in self.replica_ms.items()}
        return {"RAY_CONNECTED": int(self.connected), "RAY_CONNECTS": self.connects,
                "RAY_LOST_BATCHES": self.lost_batches,
                "RAY_REPLICA_LATENCY_MS": json.dumps(latency, sort_keys=True,
                                                     separators=(",", ":"))}

    def close(self) -> None:
        bridge, self.bridge = self.bridge, None
        if bridge is not None:
            bridge.kill()
