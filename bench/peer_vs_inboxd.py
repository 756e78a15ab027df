"""``make bench-peer``: inboxd with its default configuration against the peer (``bench/peer.py``,
libvips + ONNX Runtime, what a user would write instead), in turns in one run, on the same
photos: 0.3-MP JPEG, 12-MP JPEG and 12-MP HEIC, and 12-MP JPEG once more with inboxd at the
peer's fidelity (``preprocess.resize: fastest``, the same shrink-on-load to 1/8 as libvips':
outside inboxd's fidelity contract, so not a default, but the two then do the same work). Prints
the ratios inboxd ÷ peer and writes ``peer.json`` and ``peer.txt`` under ``--out`` (default
``bench/out``).

inboxd is the real daemon (``python -m inboxd run``) on a temp folder layout, with the embedded
default config and only its folder paths changed, doing all its durable work (claims, hashes,
fsynced results, moves to ``done/``). One daemon per format serves every turn of that format, as
a service would: it is started with a backlog of ``WARM_FILES`` already in its inbox (start →
first result is timed on it, with start → READY), and the turns begin once that backlog is done
and the daemon has gone idle (its own CPU, children included, under ``IDLE_CORES`` for a second),
so a fast path built in the background after start-up is finished before anything is compared.
The daemon's cache (``$CACHE_DIRECTORY``: the exported ONNX artifact) is kept under
``bench/out/cache`` between runs, as a service's is, and the turns wait until the fast runtime
serves: they measure the service as it runs for good, not torch beside a running exporter (only
the first run on a machine pays the export, and its start → first result says so).
The peer is a fresh process per turn, on a folder holding the turn's files, as a user runs a
script.

Both are timed the same way, from outside: a thread lists the results folder every 10 ms and
stamps each new result (``bench.measure.ResultWatcher``). Steady files/s counts from the first
result to the last: the files after the first stamp over the time between the two, which leaves
out start-up (process, model, session) on both sides. The machine drifts, so each inboxd turn is
compared with the mean of the peer turns either side of it (the first with the one after it)
and the median of the turns is the figure. CPU per
file is each side's own (inboxd: the daemon and its helper processes; the peer: its process).

After the 12-MP JPEG turns, one more flood of 12-MP JPEGs is profiled (``bench/cpu_profile.py``:
/proc ticks by process and thread, py-spy samples by stage).

Sizes: files per turn (and turns) are chosen so the whole run takes a few minutes on a quiet
2-core machine: ``--scale full`` 600 / 200 / 48 files per turn, 2 turns each, 120 profiled;
``--scale quick`` 48 / 24 / 24, 2 turns, 16 profiled (a check that it works, not a figure).
A turn needs 3 batches at least: the first batch's results are not counted, and a rate needs
two more moments.

    python -m bench.peer_vs_inboxd [--scale full|quick] [--turns N] [--out DIR] [--emit]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from bench import cpu_profile
from bench.measure import ResultWatcher, drop_many
from bench.peer import DECODERS, ensure_model
from bench.photos import Photo, build_corpus
from bench.procs import RssSampler, cpu_s
from bench.scenarios import Running
from support import configs
from support.configs import shipped_config
from support.daemon import DaemonProcess
from support.harness import logger

log = logger("bench-peer")

BENCH_DIR = Path(__file__).resolve().parent
CORPUS_DIR = BENCH_DIR / "out" / "photos"
HEIC_DIR = BENCH_DIR / "out" / "photos-heic"
# Hard links need every inbox on the corpus's filesystem.
WORK_DIR = BENCH_DIR / "out" / "work" / "peer"
# The daemon's cache (the exported ONNX artifact) outlives a run, as a service's
# $CACHE_DIRECTORY does: only the first run on a machine pays the export.
CACHE_DIR = BENCH_DIR / "out" / "cache"
# How long the turns wait for a fast runtime that is still being exported (165-200 s seen on
# a loaded 2-core machine).
RUNTIME_BUILD_S = 600
# x265's fastest preset at quality 80: a 12-MP HEIC of 1.5-3 MB, like a phone's, encoded in
# seconds rather than the minute per photo a slow preset takes on 2 cores.
HEIC_QUALITY = 80
HEIC_PRESET = "ultrafast"
IDLE_CORES = 0.1
TARGET_RATIO = 1.2


@dataclass(frozen=True)
class Format:
    label: str
    size: str  # a key of bench.photos.SIZES
    fmt: str  # "jpg" or "heic"
    full: int  # files per turn, --scale full
    quick: int
    resize: str | None = None  # inboxd's preprocess.resize; None: the shipped config's


FASTEST = "12-MP JPEG, resize: fastest"

FORMATS = (
    Format("0.3-MP JPEG", "0.3MP", "jpg", 600, 48),
    Format("12-MP JPEG", "12MP", "jpg", 200, 24),
    Format("12-MP HEIC", "12MP", "heic", 48, 24),
    Format(FASTEST, "12MP", "jpg", 200, 24, resize="fastest"),
)
PROFILED = "12-MP JPEG"
# Fields of inboxd's `started` record that say nothing about what it chose to run.
STARTED_NOISE = ("MODEL", "DEVICE_NAME", "TORCH_VERSION", "INSTANCE", "VERSION", "WATCH",
                 "FILESYSTEMS", "WARMUP_S", "WARMED_BATCH_SIZES")
SCALES = {"full": {"warm": 16, "profile": 120, "settle_s": 180},
          "quick": {"warm": 8, "profile": 16, "settle_s": 60}}


# -- photos -----------------------------------------------------------------------------------


def heic_corpus(jpegs: list[Photo], folder: Path = HEIC_DIR) -> list[Photo]:
    """The 12-MP JPEGs of the corpus re-encoded as HEIC (pillow_heif, x265), cached by recipe."""
    import pillow_heif
    from PIL import Image

    pillow_heif.register_heif_opener()
    recipe = json.dumps([HEIC_QUALITY, HEIC_PRESET, pillow_heif.__version__,
                         pillow_heif.libheif_version(), [(p.path.name, p.nbytes) for p in jpegs]])
    key = hashlib.sha256(recipe.encode()).hexdigest()[:16]
    manifest = folder / "manifest.json"
    if not (manifest.is_file() and json.loads(manifest.read_text()).get("recipe") == key):
        shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True, exist_ok=True)
    photos = []
    for jpeg in jpegs:
        path = folder / jpeg.path.with_suffix(".heic").name
        if not path.is_file():
            log(f"encoding {path.name}")
            with Image.open(jpeg.path) as image:
                partial = path.with_suffix(".partial")
                image.convert(image.mode if image.mode == "L" else "RGB").save(
                    partial, format="HEIF", quality=HEIC_QUALITY,
                    enc_params={"preset": HEIC_PRESET})
                partial.rename(path)
        photos.append(Photo(path, jpeg.source, jpeg.size, "heic", jpeg.megapixels,
                            path.stat().st_size))
    manifest.write_text(json.dumps({"recipe": key}))
    return photos


def photos_for(fmt: Format) -> list[Photo]:
    jpegs = build_corpus(CORPUS_DIR, sizes=[fmt.size], formats=["jpg"])
    return heic_corpus(jpegs) if fmt.fmt == "heic" else jpegs


# -- one side each ----------------------------------------------------------------------------


def steady_files_per_s(stamps: list[float]) -> float:
    """Files after the first result over the time from the first result to the last (a batch's
    results land together, so the first stamp's whole batch is left out with it)."""
    first, last = min(stamps), max(stamps)
    after_first = sum(1 for t in stamps if t > first + 0.001)
    return after_first / (last - first) if last > first else float("nan")


def write_config(root: Path, changes: dict[str, Any] | None = None) -> Path:
    """The embedded default config with only the folder paths changed, and the keys of
    ``--set`` (e.g. ``preprocess.resize: fastest``, the peer's own shrink-on-load, to compare
    the two at equal fidelity)."""
    return configs.write_config(root, shipped_config(), changes)


def parse_changes(settings: list[str]) -> dict[str, Any]:
    """``["preprocess.resize=fastest", "batch.max_size=8"]`` → the config sections they set
    (values read as YAML)."""
    sections: dict[str, Any] = {}
    for setting in settings:
        dotted, sep, value = setting.partition("=")
        section, dot, key = dotted.partition(".")
        if not (sep and dot and key):
            raise SystemExit(f"--set {setting!r}: give SECTION.KEY=VALUE")
        sections.setdefault(section, {})[key] = yaml.safe_load(value)
    return sections


def busy_cores(pid: int, window_s: float = 1.0) -> float:
    before = sum(cpu_s(pid).values())
    time.sleep(window_s)  # the measurement's window, not a wait for an event
    return (sum(cpu_s(pid).values()) - before) / window_s


def start_inboxd(root: Path, photos: list[Photo], warm: int, settle_s: float,
                 changes: dict[str, Any] | None = None, env: dict[str, str] | None = None
                 ) -> tuple[Running, dict[str, Any]]:
    """A daemon started with ``warm`` files in its inbox; returns once they are done and it has
    gone idle. Start-up figures in the dict."""
    shutil.rmtree(root, ignore_errors=True)
    (root / "inbox").mkdir(parents=True)
    config = write_config(root, changes)
    names = drop_many(photos, root / "inbox", warm, "warm")
    results = ResultWatcher(root / "results")
    started = time.monotonic()
    daemon = DaemonProcess(config, env={"CACHE_DIRECTORY": str(CACHE_DIR), **(env or {})})
    rss = RssSampler(daemon.pid)
    try:
        ready_s = daemon.wait_ready()
        if not results.wait_for(names, 120 + warm * 5):
            daemon.check_alive()
            raise RuntimeError(f"inboxd: the {warm} warm-up files got no results")
        first_s = min(results.seen[name] for name in names) - started
        # The turns measure the service as it runs for good: with the fast runtime it swaps in
        # once the export is done, not torch beside a running exporter.
        runtime_state = daemon.wait_runtime_settled(RUNTIME_BUILD_S)
        idle_from = time.monotonic()
        busy = busy_cores(daemon.pid)
        while busy > IDLE_CORES and time.monotonic() - idle_from < settle_s:
            busy = busy_cores(daemon.pid)
    except BaseException:
        daemon.kill()
        rss.stop()
        results.stop()
        raise
    figures = {"ready_s": round(ready_s, 2), "start_to_first_result_s": round(first_s, 2),
               "warm_files": warm, "settle_s": round(time.monotonic() - idle_from, 1),
               "settled": busy <= IDLE_CORES, "runtime_state": runtime_state,
               "started": daemon.started_fields}
    return Running(root, daemon, rss, results, rss.now()), figures


def inboxd_turn(run: Running, photos: list[Photo], count: int, prefix: str) -> dict[str, Any]:
    pid = run.daemon.pid
    cpu_before = sum(cpu_s(pid).values())
    timings_from = len(run.results.timings)
    started = run.rss.mark()
    names = drop_many(photos, run.inbox, count, prefix)
    if not run.results.wait_for(names, 120 + count * 2):
        run.daemon.check_alive()
        raise RuntimeError(f"inboxd: results missing after a flood of {count}")
    stamps = [run.results.seen[name] for name in names]
    cpu = sum(cpu_s(pid).values()) - cpu_before
    return {"files_per_s": round(steady_files_per_s(stamps), 2),
            "first_result_s": round(min(stamps) - started, 2),
            "cpu_ms_per_file": round(cpu * 1000 / count, 1),
            "peak_rss_mb": round(run.rss.span_peak(started) / 2**20, 1),
            "stages_ms": run.results.stage_summary(timings_from)}


def peer_turn(work: Path, photos: list[Photo], count: int, model: Path,
              prefix: str) -> dict[str, Any]:
    shutil.rmtree(work, ignore_errors=True)
    inbox, results_dir = work / "inbox", work / "results"
    inbox.mkdir(parents=True)
    names = drop_many(photos, inbox, count, prefix)
    results = ResultWatcher(results_dir)
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "bench.peer", "run", str(inbox),
                             str(results_dir), "--model", str(model)], cwd=BENCH_DIR.parent,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    rss = RssSampler(proc.pid)
    try:
        out, err = proc.communicate(timeout=120 + count * 2)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    finally:
        rss.stop()
    try:
        if proc.returncode != 0:
            raise RuntimeError(f"the peer exited {proc.returncode}:\n{err[-3000:]}")
        if not results.wait_for(names, 10):
            raise RuntimeError(f"the peer wrote {len(results.seen)} of {count} results")
    finally:
        results.stop()
    summary = json.loads(out.strip().splitlines()[-1])
    stamps = [results.seen[name] for name in names]
    shutil.rmtree(work, ignore_errors=True)
    return {"files_per_s": round(steady_files_per_s(stamps), 2),
            "first_result_s": round(min(stamps) - started, 2),
            "cpu_ms_per_file": round(summary["cpu_s"] * 1000 / count, 1),
            "peak_rss_mb": round(rss.peak(started) / 2**20, 1),
            "decoders": summary["decoders"]}


# -- the run ----------------------------------------------------------------------------------


def turn_ratios(inboxd: list[float], peer: list[float]) -> list[float]:
    """Turn order inboxd₀ peer₀ inboxd₁ peer₁ ...: each inboxd turn ÷ the mean of the peer turns
    either side of it (the first has one), which cancels a steady drift of the machine."""
    return [rate / ((peer[max(0, turn - 1)] + peer[turn]) / 2)
            for turn, rate in enumerate(inboxd)]



def compare(fmt: Format, scale: str, turns: int, model: Path, out: Path,
            changes: dict[str, Any] | None = None) -> dict[str, Any]:
    sizes = SCALES[scale]
    count = fmt.full if scale == "full" else fmt.quick
    photos = photos_for(fmt)
    log(f"{fmt.label}: starting inboxd with {sizes['warm']} files waiting")
    if fmt.resize:
        changes = {**(changes or {}), "preprocess": {**(changes or {}).get("preprocess", {}),
                                                     "resize": fmt.resize}}
    run, startup = start_inboxd(WORK_DIR / "inboxd", photos, sizes["warm"], sizes["settle_s"],
                                changes)
    log(f"{fmt.label}: READY {startup['ready_s']} s, first result "
        f"{startup['start_to_first_result_s']} s, runtime "
        f"{startup['runtime_state'] or 'as started'}, idle after {startup['settle_s']} s more")
    inboxd: list[dict[str, Any]] = []
    peer: list[dict[str, Any]] = []
    profile = None
    try:
        for turn in range(turns):
            inboxd.append(inboxd_turn(run, photos, count, f"t{turn}-"))
            peer.append(peer_turn(WORK_DIR / "peer", photos, count, model, f"t{turn}-"))
            log(f"{fmt.label} turn {turn}: inboxd {inboxd[-1]['files_per_s']} files/s, "
                f"peer {peer[-1]['files_per_s']} (load average {os.getloadavg()[0]:.1f})")
        if fmt.label == PROFILED:
            log(f"{fmt.label}: profiling a flood of {sizes['profile']}")
            profile = cpu_profile.profile_flood(run, photos, sizes["profile"], out,
                                                timeout_s=120 + sizes["profile"] * 2)
    finally:
        stopped = run.stop()
    ratios = turn_ratios([t["files_per_s"] for t in inboxd], [t["files_per_s"] for t in peer])
    result: dict[str, Any] = {
        "format": fmt.label, "count": count, "mean_bytes": round(
            sum(p.nbytes for p in photos) / len(photos)),
        "inboxd": inboxd, "peer": peer, "ratios": [round(r, 3) for r in ratios],
        "ratio": round(statistics.median(ratios), 3), "startup": startup,
        "inboxd_stop": stopped,
    }
    if profile is not None:
        result["profile"] = profile
    return result


def table(r: dict[str, Any]) -> str:
    changed = ", ".join(f"{section}.{key}: {value}" for section, keys in
                        r.get("changes", {}).items() for key, value in keys.items())
    config = f"default config but {changed}" if changed else "default config"
    lines = [f"inboxd ({config}, all durable work) against the peer (libvips + ONNX "
             f"Runtime fp32, {r['peer_threads']} threads, batches of 8, "
             f"{r['peer_decoders']} decode threads), in turns, {r['date']}, "
             f"{r['scale']} scale, {r['wall_s']:.0f} s"]
    header = ("format", "files/turn", "inboxd files/s", "peer files/s", "inboxd ÷ peer",
              f"≥ {TARGET_RATIO}×", "CPU ms/file inboxd / peer", "start → first result")
    rows = [header]
    for f in r["formats"]:
        reported_only = "HEIC" in f["format"] or f["format"] == FASTEST
        target = "" if reported_only else ("yes" if f["ratio"] >= TARGET_RATIO else "no")
        rows.append((
            f["format"], str(f["count"]),
            ", ".join(f"{t['files_per_s']:.1f}" for t in f["inboxd"]),
            ", ".join(f"{t['files_per_s']:.1f}" for t in f["peer"]),
            f"{f['ratio']:.2f} ({', '.join(f'{x:.2f}' for x in f['ratios'])})", target,
            f"{statistics.median(t['cpu_ms_per_file'] for t in f['inboxd']):.1f} / "
            f"{statistics.median(t['cpu_ms_per_file'] for t in f['peer']):.1f}",
            f"{f['startup']['start_to_first_result_s']:.1f} s (READY "
            f"{f['startup']['ready_s']:.1f} s)"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for index, row in enumerate(rows):
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
        if index == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines.append(f"median of the format ratios at the contract: {r['median_ratio']:.2f}; "
                 f"peer export (one-off, not counted) {r['peer_export_s']:.1f} s")
    started = r["formats"][0]["startup"].get("started", {})
    chosen = {k: v for k, v in started.items() if k not in STARTED_NOISE}
    if chosen:
        lines.append("inboxd's started record: " + ", ".join(f"{k}={v}" for k, v in chosen.items()))
    states = {f["format"]: f["startup"].get("runtime_state") for f in r["formats"]}
    lines.append("inboxd's runtime during the turns: " + ", ".join(
        f"{name} {state or 'as started'}" for name, state in states.items()))
    unsettled = [f["format"] for f in r["formats"] if not f["startup"]["settled"]]
    if unsettled:
        lines.append(f"NOTE: inboxd never went idle after its warm-up backlog "
                     f"({', '.join(unsettled)}): a background build may have overlapped the turns")
    for f in r["formats"]:
        if "profile" in f:
            lines += cpu_profile.table(f["profile"])
    return "\n".join(lines)


def median_ratio_at_contract(results: list[dict[str, Any]]) -> float:
    """The median ratio of the formats inboxd decodes within its fidelity contract (the row at
    the peer's fidelity is another comparison); nan when only that row ran."""
    ratios = [f["ratio"] for f in results if f["format"] != FASTEST]
    return statistics.median(ratios) if ratios else float("nan")


def run(scale: str, turns: int, formats: list[str] | None, out: Path,
        changes: dict[str, Any] | None = None) -> dict[str, Any]:
    started = time.monotonic()
    export_started = time.monotonic()
    model = ensure_model()
    export_s = time.monotonic() - export_started

    chosen = [f for f in FORMATS if formats is None or f.label in formats]
    results = [compare(f, scale, turns, model, out, changes) for f in chosen]
    shutil.rmtree(WORK_DIR, ignore_errors=True)
    return {"date": datetime.now(UTC).isoformat(timespec="seconds"), "scale": scale,
            "turns": turns, "changes": changes or {}, "peer_threads": 2,
            "peer_decoders": DECODERS,
            "peer_export_s": round(export_s, 1), "formats": results,
            "median_ratio": round(median_ratio_at_contract(results), 3),
            "cpus": os.cpu_count(), "wall_s": round(time.monotonic() - started, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", choices=sorted(SCALES), default="full")
    parser.add_argument("--turns", type=int, default=2, help="turns per format (at least 2)")
    parser.add_argument("--format", action="append", dest="formats", default=None,
                        choices=[f.label for f in FORMATS], help="only this format (repeatable)")
    parser.add_argument("--out", type=Path, default=BENCH_DIR / "out")
    parser.add_argument("--emit", action="store_true",
                        help="print the JSON as the last stdout line (for bench.run)")
    parser.add_argument("--set", action="append", dest="changes", default=[],
                        metavar="SECTION.KEY=VALUE",
                        help="change one key of inboxd's config (repeatable); "
                             "preprocess.resize=fastest decodes as the peer does, for a "
                             "comparison at equal fidelity")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    result = run(args.scale, max(2, args.turns), args.formats, args.out,
                 parse_changes(args.changes))
    (args.out / "peer.json").write_text(json.dumps(result, indent=1) + "\n")
    text = table(result)
    (args.out / "peer.txt").write_text(text + "\n")
    print(text, file=sys.stderr if args.emit else sys.stdout)
    if args.emit:
        sys.stdout.write(json.dumps(result) + "\n")
    log(f"wrote {args.out / 'peer.txt'} and peer.json in {result['wall_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
