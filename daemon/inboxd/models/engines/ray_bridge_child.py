"""``engine: ray``'s Ray driver, in a process of its own:
``python -m inboxd.models.engines.ray_bridge_child``.

Why a process and not ``import ray`` in the daemon: a Ray driver whose cluster head is gone
exits its whole process once its GCS reconnection timeout runs out, and re-initialising Ray in
a process whose cluster vanished is not supported. In a child, a lost cluster costs the bridge,
never the daemon: the daemon sees the pipe close, holds its batches, and starts a fresh bridge
with backoff, which connects to whatever cluster is at the address by then. It also keeps Ray's
threads, memory and signal handlers out of the daemon.

The protocol, pickled over one socket (``multiprocessing.connection``): the daemon sends
``{"settings"}`` once, then ``("infer", call_id, photos, options)`` (``Replica.__call__``'s
photos and keyword arguments); the bridge answers ``("ready", info)``
or ``("failed", why)`` once, then ``("result", call_id, reply)`` or ``("lost", call_id, why)``
for each call: lost means the batch never got outcomes (its replica or node died, a timeout)
and the daemon retries it. The bridge dies with the daemon (``PR_SET_PDEATHSIG``)
and ignores SIGINT, SIGTERM and SIGHUP once connected.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any

from inboxd.children import die_with_parent, ignore_stop_signals

DEPLOYMENT_NAME = "inboxd_model"
# The GCS reconnection timeout this bridge runs with unless RAY_... says otherwise: how long a
# bridge whose head is gone lingers before it exits and the daemon starts a fresh one.
GCS_RECONNECT_TIMEOUT_S = 10
# Crops one replica works on at once: a second one is already on the replica when the first
# ends, so the GPU does not wait for the network. The bound on what is sent stays the daemon's
# capacity.in_flight_batches, never Serve's queue.
MAX_ONGOING_PER_REPLICA = 2
# How long a running application's replica may take to say which model it runs.
REUSE_CHECK_TIMEOUT_S = 60


def actor_options(resources: dict[str, float]) -> dict[str, Any]:
    """``replica_resources`` as Ray's actor options: CPU and GPU have keywords of their own."""
    options: dict[str, Any] = {"num_cpus": resources.get("CPU", 0),
                               "num_gpus": resources.get("GPU", 0)}
    custom = {k: v for k, v in resources.items() if k not in ("CPU", "GPU")}
    if custom:
        options["resources"] = custom
    return options


def connect(settings: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """Connect to the cluster, deploy the application (or reuse a running one), and return its
    handle and a description for the log and ``inboxd models``."""
    import ray
    from ray import serve

    from inboxd.models.engines.ray_replica import Replica

    address = settings["address"]
    ray.init(address=address, namespace="inboxd", logging_level=logging.WARNING,
             log_to_driver=False, configure_logging=False)
    app_name = settings["app_name"]
    existing = serve.status().applications.get(app_name)
    reused = existing is not None and _name(existing.status) in ("RUNNING", "DEPLOYING")
    if reused:
        handle = serve.get_app_handle(app_name)
        check_same_model(handle, settings)
    else:
        serve.start(proxy_location="Disabled")
        deployment: Any = serve.deployment(
            Replica, name=DEPLOYMENT_NAME, num_replicas=settings["replicas"],
            max_ongoing_requests=MAX_ONGOING_PER_REPLICA,
            ray_actor_options=actor_options(settings["replica_resources"]),
            health_check_period_s=2, health_check_timeout_s=30)
        app = deployment.bind(settings["model_config"], settings["files"],
                              settings["max_batch_size"])
        handle = serve.run(app, name=app_name, route_prefix=None)
    return handle, describe(app_name, reused)


def check_same_model(handle: Any, settings: dict[str, Any]) -> None:
    """A running application under our name must run our model: another ingest host's (or an
    older config's) model would answer our photos with its own results."""
    from inboxd.models.engines.ray_replica import model_fingerprint

    ours = model_fingerprint(settings["model_config"], settings["files"])
    try:
        theirs = handle.describe.remote().result(timeout_s=REUSE_CHECK_TIMEOUT_S)["fingerprint"]
    except Exception as exc:  # an application of an inboxd without fingerprints, or none of ours
        theirs = f"unknown ({type(exc).__name__})"
    if theirs != ours:
        raise RuntimeError(
            f"the Serve application {settings['app_name']} at {settings['address']} runs "
            f"another model (fingerprint {theirs}, this config's {ours}): give this model "
            f"block its own ray.app_name, or remove the running one (serve.delete"
            f"({settings['app_name']!r}))")


def describe(app_name: str, reused: bool) -> dict[str, Any]:
    import ray
    from ray import serve

    app = serve.status().applications.get(app_name)
    replicas: dict[str, int] = {}
    if app is not None and DEPLOYMENT_NAME in app.deployments:
        replicas = {_name(state): count for state, count
                    in app.deployments[DEPLOYMENT_NAME].replica_states.items()}
    return {"app_name": app_name, "reused": reused,
            "status": _name(app.status) if app is not None else "missing",
            "replicas": replicas,
            "nodes": sum(bool(node.get("Alive")) for node in ray.nodes()),  # type: ignore[no-untyped-call]
            "resources": ray.cluster_resources(),  # type: ignore[no-untyped-call]
            "ray_version": ray.__version__}


def _name(status: Any) -> str:
    """Serve's status enums are str subclasses whose str() is 'ApplicationStatus.RUNNING'."""
    return str(getattr(status, "value", status))


class Bridge:
    def __init__(self, conn: Connection, handle: Any, settings: dict[str, Any]) -> None:
        self.conn = conn
        self.handle = handle
        self.call_timeout_s: float = settings["call_timeout_s"]
        self.delay_s: float = settings["replica_delay_s"]
        self.send_lock = threading.Lock()
        self.tasks: set[asyncio.Task[None]] = set()

    def send(self, message: Any) -> None:
        with self.send_lock:
            self.conn.send(message)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        closed = asyncio.Event()

        def read() -> None:
            while True:
                try:
                    message = self.conn.recv()
                except (EOFError, OSError):
                    loop.call_soon_threadsafe(closed.set)
                    return
                loop.call_soon_threadsafe(self.start_call, message)

        threading.Thread(target=read, name="inboxd-bridge-reader", daemon=True).start()
        await closed.wait()

    def start_call(self, message: tuple[str, int, Any, dict[str, Any]]) -> None:
        _, call_id, photos, options = message
        task = asyncio.create_task(self.call(call_id, photos, options))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def call(self, call_id: int, photos: list[Any], options: dict[str, Any]) -> None:
        try:
            reply = await asyncio.wait_for(self.handle.remote(photos, self.delay_s, **options),
                                           self.call_timeout_s)
        except Exception as exc:  # any way a batch can be lost on the cluster: retried
            why = f"{type(exc).__name__}: {exc}".splitlines()[0][:500]
            self.send(("lost", call_id, why))
        else:
            self.send(("result", call_id, reply))


def main() -> None:
    conn = Connection(int(sys.argv[1]))
    die_with_parent(int(sys.argv[2]))
    settings = conn.recv()
    try:
        handle, info = connect(settings)
    except Exception as exc:  # reported to the daemon, which retries with backoff
        conn.send(("failed", f"{type(exc).__name__}: {exc}".splitlines()[0][:1000]))
        return
    # As the other helpers do, from here on (ray.init has just installed a SIGTERM handler of
    # its own): a Ctrl-C to the terminal's group must not lose the batches on the cluster that
    # the daemon is still draining. The bridge ends on EOF from the daemon, or with it.
    ignore_stop_signals()
    conn.send(("ready", info))
    asyncio.run(Bridge(conn, handle, settings).run())
    os._exit(0)  # the daemon is gone or closed us: nothing of Ray's is worth waiting for


if __name__ == "__main__":
    os.environ.setdefault("RAY_gcs_rpc_server_reconnect_timeout_s", str(GCS_RECONNECT_TIMEOUT_S))
    main()
