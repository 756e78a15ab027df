"""Where a file's CPU time goes in a running inboxd: by process, by thread, and by stage.

Two sources, each where it is exact:

* ``/proc/<pid>/stat`` ticks (``bench.procs.cpu_s`` / ``cpu_by_thread_s``), read before a
  flood and after its last result: the CPU each process and each of the daemon's named threads
  spent, whatever code ran (C libraries, OpenMP or ONNX Runtime threads included).
* ``py-spy record --subprocesses --nonblocking`` (on-CPU samples only, no ``--idle``) during
  the same flood: which Python frame each process's threads were in. A sample's stage is
  decided by its innermost frame that names one (``STAGE_RULES``, leaf first), so C work is
  charged to the Python call that made it (``Image.resize`` → resize, ``read_and_hash`` → read
  + hash).

A thread's ticks are split across stages in the proportions of its own samples. Threads py-spy
cannot see (a runtime's intra-op pool: they run no Python) are charged to the model when they
carry the interpreter's unchanged name, since inboxd names every thread it starts itself
(``os_threads``). The per-stage wall times inside inboxd come from the results'
``timings_ms`` (queue wait, preprocess, batch wait, inference, total).
"""

from __future__ import annotations

import collections
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.measure import drop_many
from bench.photos import Photo
from bench.procs import HELPERS, cpu_by_thread_s, cpu_s
from bench.scenarios import Running

OTHER = "other (event loop, claims, scans, stats)"
COMMIT = "commit (results, fsync, moves)"
SAMPLE_RATE_HZ = 97  # not a divisor of the stats/scan periods
# (stage, substrings of "function (file)"): the first rule a frame matches, leaf first, wins.
STAGE_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("read + hash", ("files/reading.py", "sha256", "read_and_hash")),
    ("resize", ("resize", ".reduce ", "thumbnail", "reducing")),
    ("decode", ("PIL/", "pyvips/", "pillow_heif/", "decode/pillow.py", "decode/vips",
                "decode_image")),
    ("model", ("torch/", "onnxruntime/", "inboxd/models/")),
    (COMMIT, ("files/commit", "files/durable", "files/results",
                                        "result_writer", "files/renames", "fsync")),
    ("decode IPC", ("inboxd/wire.py", "decode/pool.py", "decode/replies.py",
                    "decode/worker")),
)
HELPER_STAGES = {"commit": COMMIT, "decode_workers": "decode"}
INTRA_OP_NAMES = ("python", "python3", "pt_main_thread", "")
MODEL = "model"


def stage_of(frames: list[str]) -> str:
    for frame in reversed(frames):
        for stage, needles in STAGE_RULES:
            if any(needle in frame for needle in needles):
                return stage
    return OTHER


def thread_key(name: str) -> str:
    """py-spy's Python thread name as ``cpu_by_thread_s`` names the kernel's thread."""
    if name == "MainThread":
        return "event loop"
    return name.removeprefix("inboxd-").rstrip("0123456789").rstrip("_")


def process_kind(cmdline: str) -> str:
    return next((kind for module, kind in HELPERS.items() if module in cmdline), "daemon")


def parse_raw(text: str) -> dict[tuple[str, str], collections.Counter[str]]:
    """py-spy's raw output → samples by (process kind, thread) and stage."""
    found: dict[tuple[str, str], collections.Counter[str]] = collections.defaultdict(
        collections.Counter)
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        parts = stack.split(";")
        processes = [p for p in parts if p.startswith("process ")]
        kind = process_kind(processes[-1] if processes else "")
        thread = next((p for p in parts if p.startswith("thread (")), "")
        name = thread.split(": ", 1)[1] if ": " in thread else ""
        frames = [p for p in parts if not p.startswith(("process ", "thread ("))]
        found[(kind, "process" if kind != "daemon" else thread_key(name))][
            stage_of(frames)] += int(count)
    return found


def by_stage(cpu_ms: dict[str, float], threads_ms: dict[str, float],
             samples: dict[tuple[str, str], collections.Counter[str]]) -> dict[str, float]:
    """CPU ms per file by stage: each process's (and the daemon's each thread's) ticks split in
    the proportions of its own samples."""
    stages: dict[str, float] = collections.defaultdict(float)

    def split(ms: float, counts: collections.Counter[str] | None, fallback: str) -> None:
        total = sum(counts.values()) if counts else 0
        if not counts or total == 0:
            stages[fallback] += ms
            return
        for stage, count in counts.items():
            stages[stage] += ms * count / total

    for kind, ms in cpu_ms.items():
        if kind != "daemon":  # a helper without samples does what it is there for
            split(ms, samples.get((kind, "process")), HELPER_STAGES.get(kind, OTHER))
    named = 0.0
    for thread, ms in threads_ms.items():
        fallback = MODEL if thread in INTRA_OP_NAMES else OTHER
        split(ms, samples.get(("daemon", thread)), fallback)
        named += ms
    # Threads that ended during the flood are in the process's total but not in any thread's.
    stages[OTHER] += max(0.0, cpu_ms.get("daemon", 0.0) - named)
    return {stage: round(ms, 2) for stage, ms in sorted(stages.items(), key=lambda kv: -kv[1])}


def profile_flood(run: Running, photos: list[Photo], count: int, out: Path,
                  timeout_s: float) -> dict[str, Any]:
    """One flood of ``count`` files into the running daemon with the ticks read around it and
    py-spy sampling it; figures per file."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    raw = out / "py-spy-12MP.txt"
    raw.unlink(missing_ok=True)
    pid = run.daemon.pid
    recorder = subprocess.Popen(
        [spy, "record", "--pid", str(pid), "--subprocesses", "--nonblocking", "--threads",
         "--full-filenames", "--nolineno", "--rate", str(SAMPLE_RATE_HZ), "--format", "raw",
         "--output", str(raw)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    timings_from = len(run.results.timings)
    cpu_before, threads_before = cpu_s(pid), cpu_by_thread_s(pid)
    names = drop_many(photos, run.inbox, count, "profile")
    done = run.results.wait_for(names, timeout_s)
    cpu_after, threads_after = cpu_s(pid), cpu_by_thread_s(pid)
    recorder.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
    try:
        _, spy_err = recorder.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        recorder.kill()
        _, spy_err = recorder.communicate()
    if not done:
        raise RuntimeError(f"profile flood: results missing after {timeout_s:.0f} s")
    per_file = {kind: (cpu_after[kind] - cpu_before[kind]) * 1000 / count for kind in cpu_after}
    threads = {name: (ms - threads_before.get(name, 0.0)) * 1000 / count
               for name, ms in threads_after.items()}
    samples = parse_raw(raw.read_text()) if raw.is_file() else {}
    result: dict[str, Any] = {
        "count": count,
        "cpu_ms_per_file": {k: round(v, 2) for k, v in per_file.items()},
        "cpu_ms_per_file_total": round(sum(per_file.values()), 2),
        "daemon_threads_ms_per_file": {k: round(v, 2) for k, v in
                                       sorted(threads.items(), key=lambda kv: -kv[1]) if v > 0},
        "stages_cpu_ms_per_file": by_stage(per_file, threads, samples) if samples else {},
        "samples": sum(sum(c.values()) for c in samples.values()),
        "stages_wall_ms": run.results.stage_summary(timings_from),
    }
    if not samples:
        result["py_spy_error"] = (spy_err or "no samples")[-500:]
    return result


def table(profile: dict[str, Any]) -> list[str]:
    lines = [f"where a 12-MP JPEG's CPU goes in inboxd ({profile['count']} files; "
             f"{profile['cpu_ms_per_file_total']:.1f} ms of CPU per file, "
             f"{profile['samples']} py-spy samples):"]
    lines.append("  by process: " + ", ".join(
        f"{k} {v:.1f}" for k, v in profile["cpu_ms_per_file"].items()) + " ms/file")
    lines.append("  daemon by thread: " + ", ".join(
        f"{k} {v:.1f}" for k, v in profile["daemon_threads_ms_per_file"].items()) + " ms/file")
    if profile["stages_cpu_ms_per_file"]:
        lines.append("  by stage: " + ", ".join(
            f"{k} {v:.1f}" for k, v in profile["stages_cpu_ms_per_file"].items()) + " ms/file")
    else:
        lines.append(f"  by stage: no py-spy samples ({profile.get('py_spy_error', '')})")
    lines.append("  wall inside inboxd, p50/p90 ms: " + ", ".join(
        f"{k} {v['p50']:.0f}/{v['p90']:.0f}" for k, v in profile["stages_wall_ms"].items()))
    return lines

