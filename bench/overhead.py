"""Pipeline overhead: the daemon's own per-file cost, with a model that costs nothing.

A trivial ``torch.export`` program (32×32 input, a mean and a 3→10 linear layer), tiny JPEGs of
64×48 and batches of 64: what is left is inboxd's own work per file. Measured in one run, next
to the same durable work done by one Python thread in a plain loop (claim by rename, read +
sha256, Pillow decode + resize, the null model per 64, JSON to a temp file + fsync + rename, one
results-folder fsync per 64, then the 64 sources renamed to ``done/``):

- files/s of one daemon and of two daemons (instances ``a`` and ``b``) on one inbox, each
  flood taken in turns with the loop and divided by the mean of the loop runs either side (this
  machine's speed drifts within a run, and the loop's by up to 2x between runs: a loop measured
  minutes away from a flood measures the drift); one daemon's figure is the median of ``TURNS``;
- a second daemon run under cProfile (``bench/profiled.py``): where its time goes per file;
- CPU seconds per file of the daemon process and of its decode workers;
- peak RSS growth of a fresh daemon under a 2,000- and a 20,000-file flood, per size the median
  of ``MEMORY_ROUNDS`` floods taken in turns; and of one daemon under ``REPEATED_FLOODS``
  floods in a row of half the larger size (does it level off?).

    python -m bench.overhead [--count 4000] [--memory 2000,20000]  →  one JSON line on stdout
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from bench import profiled, report
from bench.measure import ResultWatcher, drop_many
from bench.offline import emit
from bench.photos import Photo
from bench.procs import cpu_by_thread_s, cpu_s
from bench.scenarios import Running, flood, watch
from support import configs
from support.configs import shipped_config
from support.daemon import DaemonProcess
from support.harness import logger
from support.models import NullModel

log = logger("overhead")

BENCH_DIR = Path(__file__).resolve().parent
WORK_DIR = BENCH_DIR / "out" / "overhead"
DISTINCT_JPEGS = 256
BATCH = 64
TURNS = 3  # loop, flood, loop, flood, loop, flood, loop: the median of three ratios


def make_inputs(work: Path) -> tuple[Path, Path, list[Photo]]:
    """The null program, its labels and ``DISTINCT_JPEGS`` seeded 64×48 JPEGs (kept)."""
    work.mkdir(parents=True, exist_ok=True)
    program, labels = work / "null.pt2", work / "labels.txt"
    if not program.exists():
        torch.manual_seed(0)
        batch = torch.export.Dim("batch", min=1, max=BATCH)
        exported = torch.export.export(NullModel().eval(), (torch.randn(2, 3, 32, 32),),
                                       dynamic_shapes=({0: batch},))
        torch.export.save(exported, program)
    labels.write_text("".join(f"class{i}\n" for i in range(10)))
    folder = work / "jpegs"
    folder.mkdir(exist_ok=True)
    rng = np.random.default_rng(12)
    photos = []
    for index in range(DISTINCT_JPEGS):
        path = folder / f"tiny{index:03d}.jpg"
        if not path.exists():
            base = rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)
            image = Image.fromarray(base).resize((64, 48), Image.Resampling.BICUBIC)
            image.save(path, quality=90)
        photos.append(Photo(path, "seeded", "64x48", "jpg", 64 * 48 / 1e6, path.stat().st_size))
    return program, labels, photos


def write_config(root: Path, program: Path, labels: Path, instance: str = "default") -> Path:
    config = shipped_config()
    config["model"] = {"export": str(program), "labels": str(labels), "device": "cpu",
                       "input": {"resize": 32, "crop": 32}, "top_k": 5}
    # Room for a whole batch behind the decoders, or batches could never reach 64.
    return configs.write_config(root, config, {
        # next_stats waits for a record, idle too
        "instance": instance, "stats": {"interval_s": 1, "heartbeat_s": 1},
        "batch": {"max_size": BATCH, "max_delay_ms": 10},
        "capacity": {"queue": BATCH, "preprocess_cache": 2 * BATCH}},
        name=f"inboxd-{instance}.yaml")


def reference(root: Path, config_path: Path, photos: list[Photo], count: int) -> dict[str, Any]:
    """One thread, no daemon, the same durable work (see the module docstring)."""
    from inboxd.config import load_config
    from inboxd.decode.pillow import decode_image
    from inboxd.files.durable import fsync_dir, json_bytes, write_tmp
    from inboxd.files.reading import read_and_hash
    from inboxd.models.loading import load_network

    config = load_config(config_path)
    model = load_network(config.model)
    model.warm_up(model.warm_up_sizes(BATCH))
    inbox, processing, results, done, tmp = (root / n for n in (
        "inbox", "processing", "results", "done", "tmp"))
    for folder in (processing, results, done, tmp):
        folder.mkdir(parents=True, exist_ok=True)
    names = drop_many(photos, inbox, count, "ref")
    max_pixels = config.preprocess.max_image_pixels
    started, cpu_started = time.perf_counter(), time.process_time()
    for first in range(0, count, BATCH):
        batch = names[first:first + BATCH]
        claimed, images, hashes = [], [], []
        for name in batch:
            os.rename(inbox / name, processing / name)
            claimed.append(processing / name)
            data, sha256 = read_and_hash(processing / name)
            images.append(decode_image(data, model.spec, max_pixels))
            hashes.append((sha256, len(data)))
        predictions = model.classify([image.pixels for image in images])
        for name, image, (sha256, size), prediction in zip(batch, images, hashes, predictions,
                                                           strict=True):
            document = {"source": name, "sha256": sha256, "size_bytes": size,
                        "model": model.name, "top_k": prediction.top_k,
                        "image": {"width": image.width, "height": image.height,
                                  "format": image.format, "mode": image.mode}}
            os.rename(write_tmp(tmp, json_bytes(document), ".json"), results / f"{name}.json")
        fsync_dir(results)
        for path in claimed:
            os.rename(path, done / path.name)
    elapsed = time.perf_counter() - started
    cpu_ms = (time.process_time() - cpu_started) * 1000 / count
    return {"count": count, "files_per_s": round(count / elapsed, 1),
            "cpu_ms_per_file": round(cpu_ms, 3)}


# How long a daemon may take to export its fast runtime before the scenario measures it.
RUNTIME_BUILD_S = 600


def start(root: Path, config: Path, program: list[str] | None = None,
          code: Path | None = None) -> Running:
    """A daemon in ``root``, once its fast runtime is settled (``settled``) and it has been
    idle for one stats tick after that; ``code``: a ``daemon/`` folder whose ``inboxd`` it
    runs (another checkout's, for an A/B), else the one this Python imports."""
    # The daemon runs in its folder: the profiled runner must still find this package.
    path = os.pathsep.join(filter(None, [str(code) if code else None, str(BENCH_DIR.parent),
                                         os.environ.get("PYTHONPATH")]))
    # Results are looked for, never read or deleted (bench/measure.py says why).
    run = watch(root, DaemonProcess(config, env={"PYTHONPATH": path},
                                    program=program or ("-m", "inboxd")), consume=False)
    try:
        settled(run.daemon)
        run.daemon.next_stats()
    except BaseException:
        run.stop()
        raise
    # Idle is the settled service's figure: the swapped-in runtime's session is not a flood's.
    run.idle_rss = run.rss.now()
    return run


def settled(daemon: DaemonProcess) -> None:
    """Wait until ``daemon`` no longer exports its fast runtime. Every run here starts with an
    empty cache, so the ONNX export runs in a child for the first tens of seconds: measured
    then, a flood would compete with that child for the two cores (and ``cpu_s`` would count
    its CPU as the daemon's) and would be served by torch, then swapped mid-flood. The scenario
    measures the service as it runs for good."""
    state = daemon.wait_runtime_settled(RUNTIME_BUILD_S)
    if state == "building":
        raise RuntimeError(f"the fast runtime was still being exported after {RUNTIME_BUILD_S} s")


# On this machine's ext4 (no journal) a file created after thousands of others were deleted
# costs far more kernel CPU for minutes: measured 12-02, 18-31 us per create on a quiet disk,
# 200-1,200 us from 20 s to 4 minutes after 8,000 deletes (while more files were being created),
# 20-24 us again from 260 s; 67 us was still enough to put recently_deleted at the top of the
# daemon's io thread. ext4 without a journal does not reuse an inode deleted within the
# last 60 s (360 s while its inode table block is dirty, fs/ext4/ialloc.c recently_deleted()),
# and each create checks every such inode it passes: perf puts recently_deleted and the inode
# table lookups at the top of the daemon's io thread, and of the loop, in that window. So the
# scenario starts on a quiet disk (wait_for_quiet_disk) and deletes nothing until the end: its
# result watcher only looks, and every run has a folder of its own.
QUIET_CREATE_US = 40
QUIET_WAIT_MAX_S = 480
PROBE_FILES = 200


def create_us(folder: Path) -> float:
    """Microseconds per create of ``PROBE_FILES`` empty files in the empty ``folder`` (kept)."""
    started = time.perf_counter()
    for index in range(PROBE_FILES):
        os.close(os.open(folder / f"{index}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    return (time.perf_counter() - started) * 1e6 / PROBE_FILES


def wait_for_quiet_disk(scratch: Scratch) -> dict[str, float]:
    """Wait (``QUIET_WAIT_MAX_S`` at most) until a create costs what it does on a quiet disk:
    whatever deleted files before this scenario (an earlier run's clean-up, make bench's own
    stages) has aged out, and every run meets the same disk."""
    started = time.monotonic()
    probes = 0
    while True:
        probes += 1
        cost_us = create_us(scratch(f"probe-{probes}"))
        waited_s = time.monotonic() - started
        if cost_us <= QUIET_CREATE_US or waited_s >= QUIET_WAIT_MAX_S:
            return {"waited_s": round(waited_s), "create_us": round(cost_us, 1),
                    "quiet_us": QUIET_CREATE_US}
        log(f"a create costs {cost_us:.0f} us (files were deleted lately): waiting for the "
            f"disk to be quiet ({QUIET_CREATE_US} us or less)")
        time.sleep(10)


class Scratch:
    """A new folder per scenario, none deleted before the whole run is over (see
    ``QUIET_CREATE_US``)."""

    def __init__(self) -> None:
        self.root = WORK_DIR / "runs" / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"

    def __call__(self, name: str) -> Path:
        folder = self.root / name
        folder.mkdir(parents=True)
        return folder

    def clean(self) -> None:
        """Every run's folders, this one's and any a killed run left, once all is measured."""
        shutil.rmtree(WORK_DIR / "runs", ignore_errors=True)


def measured_flood(run: Running, photos: list[Photo], count: int, prefix: str
                   ) -> dict[str, Any]:
    """One flood of ``count`` files into ``run``, with the CPU it cost the daemon (by thread)
    and its helper processes."""
    pid = run.daemon.pid
    cpu_before, before = cpu_s(pid), cpu_by_thread_s(pid)
    figures = flood(run, photos, count, timeout_s=count / 20 + 120, prefix=prefix)
    cpu_after, after = cpu_s(pid), cpu_by_thread_s(pid)
    # A thread that started during the flood counts from 0; its whole life was the flood.
    by_thread = {name: round((after[name] - before.get(name, 0.0)) * 1000 / count, 3)
                 for name in after}
    figures["cpu_ms_per_file"] = {kind: round((cpu_after[kind] - cpu_before[kind]) * 1000 / count,
                                              3) for kind in cpu_after}
    figures["cpu_ms_per_file_by_thread"] = dict(sorted(by_thread.items(), key=lambda kv: -kv[1]))
    for unused in ("rss_series", "stages_ms"):  # (no timings: results are not read)
        figures.pop(unused, None)
    return figures


def profiled_flood(root: Path, program: Path, labels: Path, photos: list[Photo],
                   count: int, out: Path) -> dict[str, Any]:
    """One flood into a daemon run under cProfile, which writes its profile to ``out``."""
    run = start(root, write_config(root, program, labels), ["-m", "bench.profiled", str(out)])
    try:
        base = Path(f"{out}.base")  # the profile counts from here
        base.unlink(missing_ok=True)
        os.kill(run.daemon.pid, signal.SIGUSR1)
        while not base.exists():
            time.sleep(0.01)
        figures = measured_flood(run, photos, count, "prof")
    finally:
        figures_stop = run.stop()
    figures["stop"] = figures_stop
    return figures


def in_turns(scratch: Scratch, program: Path, labels: Path, photos: list[Photo], count: int,
             turns: int) -> dict[str, Any]:
    """The loop, then one daemon's flood, ``turns`` times, then the loop again; then two
    daemons on one inbox, and the loop once more. Each flood is divided by the mean of the loop
    runs just before and after it, which cancels a steady drift of this machine's speed."""
    def loop(turn: int) -> dict[str, Any]:
        root = scratch(f"loop-{turn}")
        return reference(root, write_config(root, program, labels), photos, count)

    root = scratch("one")
    run = start(root, write_config(root, program, labels))
    loops, floods = [], []
    try:
        for turn in range(turns):
            loops.append(loop(turn))
            floods.append(measured_flood(run, photos, count, f"ov{turn}-"))
            log(f"turn {turn}: inboxd {floods[-1]['files_per_s']} files/s after the loop's "
                f"{loops[-1]['files_per_s']}")
    finally:
        stopped = run.stop()
    loops.append(loop(turns))
    two = two_instances(scratch("two"), program, labels, photos, count)
    loops.append(loop(turns + 1))
    ratios = [flood_run["files_per_s"] / mean_files_per_s(before, after)
              for flood_run, before, after in zip(floods, loops[:turns], loops[1:turns + 1],
                                                     strict=True)]
    median = sorted(range(turns), key=lambda turn: ratios[turn])[turns // 2]
    return {"loops": loops, "floods": floods, "ratios_one": [round(r, 3) for r in ratios],
            "ratio_one": round(ratios[median], 2),
            # The median flood's own figures (CPU per file, batch sizes) stand for the daemon.
            "one": {**floods[median], "stop": stopped},
            "two": two, "ratio_two": round(
                two["files_per_s"] / mean_files_per_s(loops[-2], loops[-1]), 2)}


def mean_files_per_s(*runs: dict[str, Any]) -> float:
    return statistics.mean(float(run["files_per_s"]) for run in runs)


def two_instances(root: Path, program: Path, labels: Path, photos: list[Photo],
                  count: int) -> dict[str, Any]:
    daemons = [DaemonProcess(write_config(root, program, labels, name)) for name in ("a", "b")]
    watcher = ResultWatcher(root / "results", 0.01, consume=False)
    try:
        for daemon in daemons:
            daemon.wait_ready()
            settled(daemon)
            daemon.next_stats()
        started = time.monotonic()
        names = drop_many(photos, root / "inbox", count, "two")
        if not watcher.wait_for(names, count / 20 + 120):
            raise RuntimeError("two instances: results missing")
        elapsed = max(watcher.seen[n] for n in names) - started
    finally:
        codes = [daemon.stop() for daemon in daemons]
        watcher.stop()
    return {"count": count, "files_per_s": round(count / elapsed, 1), "exit_codes": codes}


# Peak RSS above idle moves by 1-3 MB between identical floods (measured 12-02: 4.2-5.7 MB for
# 2,000 files, 4.8-8.4 MB for 20,000 within one hour; the growth is spread over malloc's
# per-thread arenas, while tracemalloc saw Python's own objects grow by tens of KB): one
# flood per size compares two draws of that noise. The figure per size is the median of
# MEMORY_ROUNDS, the sizes taken in turns.
MEMORY_ROUNDS = 3


def memory(scratch: Scratch, program: Path, labels: Path, photos: list[Photo],
           counts: list[int]) -> dict[str, Any]:
    """A fresh daemon per flood: peak RSS above its own idle figure, per flood size the median
    of ``MEMORY_ROUNDS`` floods (each listed)."""
    runs: dict[str, list[dict[str, Any]]] = {str(count): [] for count in counts}
    for round_ in range(MEMORY_ROUNDS):
        for count in counts:
            root = scratch(f"memory-{count}-{round_}")
            run = start(root, write_config(root, program, labels))
            try:
                figures = flood(run, photos, count, timeout_s=count / 20 + 120, prefix="mem")
            finally:
                run.stop()
            runs[str(count)].append({key: figures[key] for key in (
                "files_per_s", "peak_rss_above_idle", "idle_rss")})
    return {count: {"peak_rss_above_idle": statistics.median(
                        r["peak_rss_above_idle"] for r in found),
                    "runs": found}
            for count, found in runs.items()}


# Whether the daemon's memory levels off: one daemon, REPEATED_FLOODS floods in a row. The
# fresh-daemon figures above cannot say it; a slow leak would hide in their spread.
REPEATED_FLOODS = 5


def memory_over_floods(scratch: Scratch, program: Path, labels: Path, photos: list[Photo],
                       count: int) -> dict[str, Any]:
    """One daemon flooded ``REPEATED_FLOODS`` times with ``count`` files: each flood's peak RSS
    and the RSS once it is done, both above the daemon's idle figure before the first."""
    root = scratch("memory-repeated")
    run = start(root, write_config(root, program, labels))
    floods = []
    try:
        for index in range(REPEATED_FLOODS):
            figures = flood(run, photos, count, timeout_s=count / 20 + 120, prefix=f"rep{index}-")
            floods.append({"peak_rss_above_idle": figures["peak_rss_above_idle"],
                           "rss_after_above_idle": run.rss.now() - run.idle_rss})
    finally:
        run.stop()
    return {"count": count, "floods": floods}


def run(count: int, memory_counts: list[int], profile: bool) -> dict[str, Any]:
    program, labels, photos = make_inputs(WORK_DIR)
    scratch = Scratch()
    result: dict[str, Any] = {"setup": {"files": count, "jpeg": "64x48", "distinct": len(photos),
                                        "model": "torch.export null program, 32x32 input",
                                        "batch": BATCH}}
    try:
        result["disk"] = wait_for_quiet_disk(scratch)
        return measure(result, scratch, program, labels, photos, count, memory_counts, profile)
    finally:
        scratch.clean()


def measure(result: dict[str, Any], scratch: Scratch, program: Path, labels: Path,
            photos: list[Photo], count: int, memory_counts: list[int],
            profile: bool) -> dict[str, Any]:
    result.update(in_turns(scratch, program, labels, photos, count, TURNS))
    # CPU per file is far steadier than files/s on a shared machine: the loop's (one thread)
    # against the daemon's own plus its decode workers'.
    loop_cpu = statistics.median(loop["cpu_ms_per_file"] for loop in result["loops"])
    result["cpu_ratio"] = round(loop_cpu / sum(result["one"]["cpu_ms_per_file"].values()), 2)
    if profile:
        out = WORK_DIR / "daemon.prof"
        result["profiled"] = profiled_flood(scratch("profiled"), program, labels, photos, count,
                                            out)
        result["profile"] = profiled.summary(str(out), count)
    if memory_counts:
        result["memory"] = memory(scratch, program, labels, photos, memory_counts)
        result["memory_repeated"] = memory_over_floods(scratch, program, labels, photos,
                                                       max(memory_counts) // 2)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=4000)
    parser.add_argument("--memory", default="2000,20000",
                        help="flood sizes for the peak-RSS comparison ('' skips it)")
    parser.add_argument("--no-profile", action="store_true")
    args = parser.parse_args()
    counts = [int(c) for c in args.memory.split(",") if c]
    result = run(args.count, counts, not args.no_profile)
    print("\n".join(report.overhead_lines(result)), file=sys.stderr)
    emit(result)


if __name__ == "__main__":
    main()
