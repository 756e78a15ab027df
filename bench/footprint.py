"""The daemon's footprint with the CPU defaults: RSS of its main process and of all its processes
once ONNX Runtime serves, and the time from start to the first result, in turns.

Each turn starts ``inboxd run`` with one photo already in the inbox and a cache in a given state:
``cached`` (a valid artifact: served without torch), ``first-run`` (no artifact: torch serves
until the export is swapped in) and, with ``--compare-tree``, another checkout's daemon (main's,
say) on its own cached artifact. RSS is read from /proc once the runtime in the result is
onnxruntime and the stats record shows the swap is done.

    python -m bench.footprint --repeats 3 [--compare-tree /work/main]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent


def children(pid: int) -> list[int]:
    """Every descendant of ``pid``, from /proc."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        parents.setdefault(ppid, []).append(int(entry.name))
    found, stack = [], [pid]
    while stack:
        for child in parents.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def one_turn(tree: Path, cache: Path, photo: Path, root: Path) -> dict[str, Any]:
    if root.exists():
        shutil.rmtree(root)
    (root / "inbox").mkdir(parents=True)
    config = {"inbox": {"paths": [str(root / "inbox")], "settle_ms": 0},
              "results_dir": str(root / "results"), "done_dir": str(root / "done"),
              "failed_dir": str(root / "failed"), "stats": {"interval_s": 1},
              "model": {"cache_dir": str(cache), "device": "cpu"}}
    (root / "inboxd.yaml").write_text(yaml.safe_dump(config))
    shutil.copy(photo, root / "inbox" / photo.name)
    result = root / "results" / f"{photo.name}.json"
    log = (root / "daemon.log").open("w")
    env = {**os.environ, "PYTHONPATH": str(tree / "daemon"), "PYTHONUNBUFFERED": "1"}
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "inboxd", "run", "-c",
                             str(root / "inboxd.yaml")], stdout=log, stderr=subprocess.STDOUT,
                            env=env, cwd=root)
    try:
        while not result.exists():
            if proc.poll() is not None:
                raise RuntimeError((root / "daemon.log").read_text()[-2000:])
            time.sleep(0.02)
        first_s = time.perf_counter() - started
        deadline = time.monotonic() + 600
        # Served by onnxruntime: the swap (or the cached load) is done.
        while "RUNTIME=onnxruntime" not in (root / "daemon.log").read_text():
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("onnxruntime never served")
            time.sleep(0.2)
        swapped_s = time.perf_counter() - started
        time.sleep(2)  # the next stats record: the process has settled after the swap
        main = rss_mb(proc.pid)
        total = main + sum(rss_mb(child) for child in children(proc.pid))
        log_text = (root / "daemon.log").read_text()
        torch_loaded = "TORCH_VERSION='not loaded'" not in log_text
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        log.close()
    return {"first_result_s": first_s, "onnxruntime_serving_s": swapped_s, "main_rss_mb": main,
            "all_rss_mb": total, "torch_loaded": torch_loaded}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compare-tree", type=Path, default=None,
                        help="another checkout whose daemon runs in the same turns")
    parser.add_argument("--photo", type=Path, default=None)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from support.photos import photo_paths

    photo = args.photo or photo_paths()["chelsea"]
    work = Path(tempfile.mkdtemp(prefix="inboxd-footprint-"))
    caches = {"cached": work / "cache-here"}
    trees = {"cached": REPO, "first-run": REPO}
    if args.compare_tree is not None:
        caches["other"] = work / "cache-other"
        trees["other"] = args.compare_tree
    # A warm-up turn per tree fills its cache (the export), so "cached" turns find it.
    for name in caches:
        one_turn(trees[name], caches[name], photo, work / "run")
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
    for _ in range(args.repeats):
        for name, tree in trees.items():
            cache = caches.get(name) or work / "cache-empty"
            if name == "first-run":
                shutil.rmtree(cache, ignore_errors=True)
            runs[name].append(one_turn(tree, cache, photo, work / "run"))
    for name, turns in runs.items():
        cells = []
        for key in ("first_result_s", "onnxruntime_serving_s", "main_rss_mb", "all_rss_mb"):
            values = [turn[key] for turn in turns]
            cells.append(f"{key} {statistics.median(values):.1f} "
                         f"[{min(values):.1f}-{max(values):.1f}]")
        print(f"{name:10s} ({trees[name]}): " + ", ".join(cells)
              + f", torch loaded: {sorted({t['torch_loaded'] for t in turns})}")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
