"""``make bench-ray``: the same flood through ``engine: local`` and ``engine: ray`` (one replica
on a local Ray cluster on this machine), in one run: files/s of each, their ratio, and what a
batch costs on top of the model when it goes through Ray (the engine call as the model stage
sees it, minus the forward pass as the replica measured it).

The pipeline runs in this process (``Pipeline.process_backlog``, the code of ``inboxd once``)
after the engine is warmed up and, for Ray, deployed, so start-up is not in the figures. The
model is a tiny exported classifier by default (the overhead is then most of a batch: the
worst case for Ray); ``--builtin`` uses EfficientNet-Lite0, ``--ocr`` the built-in OCR
(``name: ocr``) on receipts of one rendered line each, where a call ships the whole fitted photo
and its answer is text lines. Prints one table; ``--append`` adds it to ``bench/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml
from PIL import Image

from support.models import tiny_program
from support.text_images import draw_lines

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def start_cluster() -> tuple[Any, str]:
    from ray.cluster_utils import Cluster

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cluster = Cluster(initialize_head=True, head_node_args={
        "gcs_server_port": port, "num_cpus": 1, "node_ip_address": "127.0.0.1",
        "include_dashboard": False})
    cluster.add_node(num_cpus=1, resources={"fakegpu": 1}, node_ip_address="127.0.0.1")
    return cluster, f"127.0.0.1:{port}"


def flood(root: Path, files: int, size: int, text: bool = False) -> None:
    inbox = root / "inbox"
    inbox.mkdir(parents=True)
    for n in range(files):
        if text:  # a distinct line per file: the same bytes twice would be one result
            image = Image.new("RGB", (1000, 200), "white")
            draw_lines(image, [f"Total {n + 100}.20 EUR"], (40, 60), 40, "DejaVuSans.ttf",
                       (0, 0, 0))
        else:
            image = Image.new("RGB", (size, size), (n % 256, (n // 256) % 256, 90))
        image.save(inbox / f"f{n}.png")


async def run_once(config_path: Path) -> dict[str, Any]:
    from inboxd.config import load_config
    from inboxd.models.engines.choice import load_here, make_engine
    from inboxd.pipeline.wiring import Pipeline

    config = load_config(config_path)
    model = load_here(config.model)
    engine = make_engine(config, model)
    await engine.warm_up(config.batch.max_size)
    pipeline = Pipeline(config, model, engine=engine)
    started = time.perf_counter()
    await pipeline.process_backlog()
    wall_s = time.perf_counter() - started
    fields = pipeline.report.log_stats()
    stats = pipeline.stats
    replica: dict[str, dict[str, Any]] = json.loads(fields.get("RAY_REPLICA_LATENCY_MS", "{}"))
    return {"completed": stats.counters.completed, "failed": stats.counters.failed,
            "wall_s": wall_s, "files_per_s": stats.counters.completed / wall_s,
            "batches": len(stats.batch_sizes.samples),
            "call_ms_p50": stats.inference_ms.percentile(50),
            "replica_ms_p50": next(iter(replica.values()), {}).get("p50_ms"),
            "in_flight_high_water": fields["IN_FLIGHT_HIGH_WATER"]}


def configure(root: Path, engine: str, model: dict[str, Any], address: str,
              in_flight: int) -> Path:
    model = {**model, "engine": engine}
    if engine == "ray":
        model["ray"] = {"address": address, "replicas": 1, "replica_resources": {"fakegpu": 1},
                        "app_name": "inboxd-bench"}
    config = {"inbox": {"paths": [str(root / "inbox")], "settle_ms": 0},
              "results_dir": str(root / "results"), "done_dir": str(root / "done"),
              "failed_dir": str(root / "failed"), "model": model,
              "capacity": {"in_flight_batches": in_flight, "preprocess_cache": 16},
              "batch": {"max_size": 8}, "preprocess": {"workers": 2},
              "stats": {"interval_s": 3600}, "log_level": "warning"}
    path = root / "inboxd.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=800)
    parser.add_argument("--builtin", action="store_true", help="EfficientNet-Lite0, not tiny")
    parser.add_argument("--ocr", action="store_true", help="name: ocr on one-line receipts")
    parser.add_argument("--append", action="store_true", help="append to bench/RESULTS.md")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="inboxd-bench-ray-"))
    if args.ocr:
        model: dict[str, Any] = {"name": "ocr", "device": "cpu"}
        size = 1000
    elif args.builtin:
        model = {"name": "efficientnet_lite0", "device": "cpu"}
        size = 256
    else:
        program = tiny_program(work / "tiny.pt2")
        model = {"export": str(program), "device": "cpu", "input": {"resize": 32, "crop": 32}}
        size = 32
    cluster, address = start_cluster()
    results: dict[str, dict[str, Any]] = {}
    try:
        # Ray with one batch out (a batch's round trip, nothing queued behind another), then
        # two (the next batch already on the replica when one ends: the throughput setting).
        for label, engine, in_flight in (("local", "local", 1), ("ray, 1 in flight", "ray", 1),
                                         ("ray, 2 in flight", "ray", 2)):
            root = work / label.replace(" ", "").replace(",", "-")
            flood(root, args.files, size, text=args.ocr)
            results[label] = asyncio.run(run_once(configure(root, engine, model, address,
                                                            in_flight)))
    finally:
        cluster.shutdown()
    local, ray1, ray2 = (results[k] for k in ("local", "ray, 1 in flight",
                                                "ray, 2 in flight"))
    overhead = ray1["call_ms_p50"] - (ray1["replica_ms_p50"] or 0)
    name = ("name: ocr (PP-OCRv4, ONNX Runtime)" if args.ocr else
            "EfficientNet-Lite0" if args.builtin else "tiny .pt2 (32×32)")
    what = "one-line receipt PNGs 1000×200" if args.ocr else f"PNGs {size}×{size}"
    rows = [f"| {label} | {r['files_per_s']:.1f} | {r['wall_s']:.1f} | {r['batches']} | "
            f"{r['call_ms_p50']:.1f} | {r['replica_ms_p50'] or '—'} | "
            f"{r['in_flight_high_water']} | {r['failed']} |" for label, r in results.items()]
    table = "\n".join([
        f"### engine: local vs engine: ray (1 replica), {datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
        "",
        f"{args.files} {what}, model {name} on the CPU, batch 8; the replica on a "
        f"local 2-node Ray cluster on the same machine ({platform.node()}, {os.cpu_count()} "
        f"cores, load {os.getloadavg()[0]:.1f}); `python -m bench.ray_vs_local"
        f"{' --builtin' if args.builtin else ''}{' --ocr' if args.ocr else ''}`.",
        "",
        "| engine | files/s | wall s | batches | engine call p50 ms | replica forward p50 ms "
        "| in flight high water | failed |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"files/s ray/local: **{ray1['files_per_s'] / local['files_per_s']:.2f}** with 1 batch "
        f"in flight, **{ray2['files_per_s'] / local['files_per_s']:.2f}** with 2. Ray's "
        f"overhead per batch (call p50 − replica forward p50, 1 in flight): "
        f"**{overhead:.1f} ms**.",
        "",
    ])
    print(table)
    if args.append:
        with RESULTS.open("a") as out:
            out.write("\n" + table)


if __name__ == "__main__":
    main()
