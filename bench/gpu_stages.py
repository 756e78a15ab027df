"""The stages of ``bench/gpu_check.sh``, one per process (``python -m bench.gpu_stages NAME``),
each writing its figures to ``--result`` as JSON with a ``status``: passed, skipped (with the
reason), or failed (with the error). ``--dry-run`` runs the same code on the CPU with tiny
sizes; where a stage needs the GPU itself, the dry run says what it stood in for.

The stages of one script are here (gpu_decode and detection in their own modules), each small
and read against the issue's list (a-f): split, they would only scatter the sizes and verdicts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.gpu_decode_check import gpu_decode
from bench.gpu_detect_check import detection
from bench.gpu_ocr_check import ocr
from bench.photos import jpegs
from support import configs

REPO = Path(__file__).resolve().parent.parent
Result = dict[str, Any]
# The flood stops itself before gpu_check's deadline for the stage (90 s), to report what it saw.
FLOOD_DEADLINE_S = 75


_RESULT_PATH: list[Path] = []  # --result, set by main


def checkpoint(result: Result) -> None:
    """Write a stage's figures so far to ``--result``, so that a stage cut off by its
    deadline still leaves them."""
    for path in _RESULT_PATH:
        path.write_text(json.dumps({**result, "status": "running"}, indent=1, default=str))


def sizes(dry_run: bool) -> dict[str, Any]:
    if dry_run:
        return {"photos": 1, "batches": (2, 4), "e2e_files": 8, "workers": 2,
                "flood": 80, "flood_batch": 4, "oom_batch": 4}
    workers = min(12, os.cpu_count() or 4)
    return {"photos": None, "batches": (32, 64, 128), "e2e_files": 3000, "workers": workers,
            "flood": 20_000, "flood_batch": 64, "oom_batch": 128}


def write_config(root: Path, **sections: Any) -> Path:
    return configs.write_config(root, {"inbox": {"settle_ms": 0, "rescan_interval_s": 1},
                                       "stats": {"interval_s": 1}}, sections)


def fresh(out: Path, name: str) -> Path:
    root = out / "work" / name
    shutil.rmtree(root, ignore_errors=True)
    (root / "inbox").mkdir(parents=True)
    return root


def fill_inbox(inbox: Path, files: list[Path], count: int) -> None:
    """``count`` hard links to ``files``: old mtimes, so the daemon takes them at once."""
    for n in range(count):
        source = files[n % len(files)]
        os.link(source, inbox / f"f{n:06d}{source.suffix}")


# -- (a) the gpu-marked tests ---------------------------------------------------------------


def gpu_tests(dry_run: bool, out: Path) -> Result:
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider", "-q",
               "-o", "addopts=", "--timeout=100", "tests/models/test_models.py",
               "tests/models/test_gpu_faults.py", "tests/models/test_overlap.py",
               "tests/decode/test_tensor.py"]
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=False)
    (out / "gpu_pytest.txt").write_text(proc.stdout + proc.stderr)
    tail = (proc.stdout.strip().splitlines() or [""])[-1]
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|error)", tail)}
    result: Result = {"summary": tail.strip("= "), **counts}
    if proc.returncode not in (0, 5) or counts.get("failed") or counts.get("error"):
        return {**result, "status": "failed", "error": f"pytest exit {proc.returncode}"}
    if not counts.get("passed"):
        status = "skipped" if dry_run else "failed"
        return {**result, "status": status, "reason": "no CUDA here: every gpu test skips"}
    return {**result, "status": "passed"}


# -- (b) the built-in model in fp32/bf16/fp16 against CPU fp32 -------------------------------


def precision(dry_run: bool, out: Path) -> Result:
    import torch
    from inboxd.config import ModelConfig
    from inboxd.decode.pillow import decode_image
    from inboxd.models.loading import load_network
    from inboxd.models.model import Classification

    from support.photos import EXPECTED_TOP1, photo_paths

    photos = {n: p for n, p in sorted(photo_paths().items()) if n in EXPECTED_TOP1}
    photos = dict(list(photos.items())[:sizes(dry_run)["photos"]])
    device = "cuda" if torch.cuda.is_available() else "cpu"

    def top1(precision_name: str, on: str) -> dict[str, tuple[str, float]]:
        model = load_network(ModelConfig(device=on, precision=precision_name))  # type: ignore[arg-type]
        found = {}
        for name, path in photos.items():
            image = decode_image(path.read_bytes(), model.spec, 89_478_485)
            [prediction] = model.predict([image.pixels])
            assert isinstance(prediction, Classification)
            best = prediction.top_k[0]
            found[name] = (str(best["label"]), float(best["score"]))
        return found

    reference = top1("fp32", "cpu")
    result: Result = {"device": device, "photos": len(photos),
                      "cpu_fp32_correct": sum(reference[n][0] in EXPECTED_TOP1[n]
                                              for n in photos)}
    verdicts = []
    for name in ("fp32", "bf16", "fp16"):
        if name == "fp16" and device == "cpu":
            result[name] = {"status": "skipped", "reason": "fp16 needs a GPU"}
            continue
        if name == "bf16" and device == "cuda" and not torch.cuda.is_bf16_supported(
                including_emulation=False):
            result[name] = {"status": "skipped", "reason": "this GPU has no native bf16"}
            continue
        got = reference if (name, device) == ("fp32", "cpu") else top1(name, device)
        agree = sum(got[n][0] == reference[n][0] for n in photos)
        worst = max(abs(got[n][1] - reference[n][1]) for n in photos)
        ok = agree == len(photos) if name == "fp32" else agree >= len(photos) - 1
        verdicts.append(ok)
        result[name] = {"top1_agree": f"{agree}/{len(photos)}",
                        "top1_score_max_diff": round(worst, 5),
                        "correct": sum(got[n][0] in EXPECTED_TOP1[n] for n in photos)}
    result["summary"] = ", ".join(f"{k} {v['top1_agree']}" for k, v in result.items()
                                  if isinstance(v, dict) and "top1_agree" in v)
    result["status"] = "passed" if all(verdicts) else "failed"
    return result


# -- (c) end-to-end files/s against the same run's offline ceiling ---------------------------


def throughput(dry_run: bool, out: Path) -> Result:
    import torch
    from inboxd.config import PreprocessConfig, load_config
    from inboxd.models.engines.local import LocalEngine
    from inboxd.models.loading import load_network
    from inboxd.pipeline.wiring import Pipeline

    from bench.ceiling import run_loop

    size = sizes(dry_run)
    files = jpegs(out)
    model = None
    rows = []
    # On the CPU gpu_decode changes nothing (the device path needs CUDA): measured once there.
    decode_modes: list[str | None] = [None]
    if "gpu_decode" in PreprocessConfig.model_fields and torch.cuda.is_available():
        decode_modes = ["off", "auto"]
    for batch in size["batches"]:
        for decode_mode in decode_modes:
            root = fresh(out, f"e2e-{batch}")
            fill_inbox(root / "inbox", files, size["e2e_files"])
            preprocess: dict[str, Any] = {"workers": size["workers"]}
            if decode_mode is not None:
                preprocess["gpu_decode"] = decode_mode
            config = load_config(write_config(
                root, batch={"max_size": batch, "max_delay_ms": 5}, preprocess=preprocess,
                capacity={"queue": batch, "preprocess_cache": 2 * batch,
                          "preprocess_cache_mb": 1024, "event_buffer": 4 * batch}))
            if model is None:
                model = load_network(config.model)
            engine = LocalEngine(model)

            async def run(config: Any = config, engine: LocalEngine = engine,
                          model: Any = model) -> float:
                await engine.warm_up(config.batch.max_size)
                pipeline = Pipeline(config, model, engine=engine)
                started = time.perf_counter()
                await pipeline.process_backlog()
                done = pipeline.stats.counters.completed
                if done != size["e2e_files"]:
                    raise AssertionError(f"{done} of {size['e2e_files']} files completed")
                return done / (time.perf_counter() - started)

            # The ceiling before and after the daemon: their spread is this machine's noise
            # (once in a dry run, where it only proves the code).
            ceilings = [] if dry_run else [run_loop(model, files, size["e2e_files"], batch,
                                                    size["workers"],
                                                    config.preprocess.max_image_pixels)]
            try:
                e2e = asyncio.run(run())
            finally:
                engine.close()
            ceilings.append(run_loop(model, files, size["e2e_files"], batch, size["workers"],
                                     config.preprocess.max_image_pixels))
            ceiling = max(ceilings)
            rows.append({"batch": batch, "gpu_decode": decode_mode,
                         "files_per_s": round(e2e, 1), "ceiling_files_per_s": round(ceiling, 1),
                         "ceiling_before_after": [round(c, 1) for c in ceilings],
                         "ratio": round(e2e / ceiling, 3)})
            checkpoint({"rows": rows})
            shutil.rmtree(root, ignore_errors=True)
    assert model is not None
    return {"status": "passed", "device": str(model.device), "files": size["e2e_files"],
            "image": "0.3 MP JPEG", "rows": rows,
            "gpu_decode": ("measured off and auto" if len(decode_modes) == 2 else
                           "on the CPU only the CPU path exists: measured once"),
            "pipeline_overhead": "not in this build (the overhead scenario is issue 12)",
            "summary": ", ".join(f"b{r['batch']} {r['files_per_s']}/{r['ceiling_files_per_s']}"
                                 for r in rows) + " files/s (e2e/ceiling)"}


# -- (d) CUDA memory per stats interval across a flood ---------------------------------------

STAT_KEYS = ("COMPLETED", "RSS_BYTES", "CUDA_ALLOCATED_BYTES", "CUDA_RESERVED_BYTES",
             "CUDA_PEAK_ALLOCATED_BYTES", "CUDA_FREE_BYTES")


def stats_fields(line: str) -> dict[str, int]:
    found = {}
    for token in line.split():
        key, sep, value = token.partition("=")
        if sep and key in STAT_KEYS and value.lstrip("-").isdigit():
            found[key] = int(value)
    return found


def flood_memory(dry_run: bool, out: Path) -> Result:
    size = sizes(dry_run)
    root = fresh(out, "flood")
    fill_inbox(root / "inbox", jpegs(out), size["flood"])
    batch = size["flood_batch"]
    config = write_config(root, batch={"max_size": batch, "max_delay_ms": 5},
                          preprocess={"workers": size["workers"]},
                          capacity={"queue": batch, "preprocess_cache": 2 * batch})
    daemon = subprocess.Popen([sys.executable, "-m", "inboxd", "run", "-c", str(config)],
                              cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    records: list[dict[str, int]] = []
    assert daemon.stdout is not None
    started = time.perf_counter()
    with open(out / "flood_daemon.log", "w") as log:
        for line in daemon.stdout:
            log.write(line)
            if "[stats]" in line:
                records.append(stats_fields(line))
                checkpoint({"files": size["flood"], "records": records})
                if records[-1].get("COMPLETED", 0) >= size["flood"]:
                    break
                if time.perf_counter() - started > FLOOD_DEADLINE_S:
                    break  # reported below as not all completed
        elapsed_s = time.perf_counter() - started
        daemon.send_signal(signal.SIGTERM)
        for line in daemon.stdout:
            log.write(line)
    code = daemon.wait(60)
    done = records[-1].get("COMPLETED", 0) if records else 0
    result: Result = {"files": size["flood"], "completed": done, "exit_status": code,
                      "wall_s": round(elapsed_s, 1), "records": records}
    steady = records[2:-1] or records[1:]  # after warm-up and the first full interval
    if steady and "CUDA_RESERVED_BYTES" in steady[0]:
        reserved = [r["CUDA_RESERVED_BYTES"] for r in steady]
        result["cuda_reserved_growth_bytes"] = max(reserved) - min(reserved)
        result["flat"] = result["cuda_reserved_growth_bytes"] == 0
    elif steady:
        rss = [r["RSS_BYTES"] for r in steady]
        result["rss_growth_bytes"] = max(rss) - min(rss)
        result["note"] = "no CUDA figures on the CPU: RSS only"
    ok = done >= size["flood"] and code == 0 and result.get("flat", True)
    result["summary"] = (f"{done}/{size['flood']} files in {elapsed_s:.0f} s, "
                         + (f"reserved growth {result['cuda_reserved_growth_bytes']} B"
                            if "flat" in result else
                            f"RSS growth {result.get('rss_growth_bytes', 0) / 2**20:.1f} MiB"))
    result["status"] = "passed" if ok else "failed"
    shutil.rmtree(root, ignore_errors=True)
    return result


# -- (e) the OOM split with a real out-of-memory ----------------------------------------------


def oom_split(dry_run: bool, out: Path) -> Result:
    import numpy as np
    import torch
    from inboxd.config import load_config
    from inboxd.decode.pillow import decode_image
    from inboxd.item import DecodedImage, WorkItem
    from inboxd.models.engines.local import infer_splitting
    from inboxd.models.loading import load_network
    from inboxd.models.model import Classification

    count = sizes(dry_run)["oom_batch"]
    model = load_network(load_config(None).model)
    path = jpegs(out)[0]
    image = decode_image(path.read_bytes(), model.spec, 89_478_485)
    pixels: np.ndarray[Any, Any] = image.pixels
    splits: list[str] = []

    class Splits(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if getattr(record, "inboxd_event", None) == "batch_split":
                splits.append(record.getMessage())

    logging.getLogger("inboxd").addHandler(Splits())

    def batch() -> list[WorkItem]:
        items = [WorkItem(path.parent, f"{n}.jpg", f"{n}.jpg", str(path)) for n in range(count)]
        for item in items:
            item.image = DecodedImage(pixels, image.width, image.height, "JPEG", "RGB")
        return items

    result: Result = {"batch": count}
    if model.on_gpu:
        device = model.device
        model.warm_up([8])
        torch.cuda.synchronize(device)
        baseline = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        model.predict([pixels] * 8)
        per_8 = torch.cuda.max_memory_allocated(device) - baseline
        torch.cuda.empty_cache()  # only here: the filler must get what the cache held
        free, _total = torch.cuda.mem_get_info(device)
        room = 3 * per_8  # a batch of ~16-24 fits, 128 does not
        filler = torch.empty(max(0, free - room), dtype=torch.uint8, device=device)
        outcomes = infer_splitting(model, batch())
        del filler
        torch.cuda.synchronize(device)
        after = torch.cuda.memory_allocated(device)
        result.update(baseline_allocated_bytes=baseline, after_allocated_bytes=after,
                      room_bytes=room, ooms=torch.cuda.memory_stats(device).get("num_ooms", 0))
        back_to_baseline = after <= baseline
    else:
        result["note"] = ("no CUDA: torch.cuda.OutOfMemoryError injected above batch 2 at "
                          "the device boundary (the model's before_forward seam)")

        def oom_above_2(size: int) -> None:
            if size > 2:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected: dry run)")

        model.before_forward = oom_above_2
        outcomes = infer_splitting(model, batch())
        back_to_baseline = True
    completed: Callable[[Any], bool] = lambda r: isinstance(r, Classification)  # noqa: E731
    done = sum(completed(r) for _, r in outcomes)
    result.update(completed=done, splits=len(splits), back_to_baseline=back_to_baseline,
                  summary=f"{done}/{count} completed after {len(splits)} splits")
    result["status"] = "passed" if done == count and splits and back_to_baseline else "failed"
    return result


# -- (f) the unit's sandbox reaching the GPU --------------------------------------------------

# The unit's directives that decide whether CUDA works in it (devices, namespaces, syscalls).
SANDBOX_KEYS = ("DevicePolicy", "DeviceAllow", "NoNewPrivileges", "PrivateUsers",
                "RestrictNamespaces", "SystemCallArchitectures", "SystemCallFilter",
                "SystemCallErrorNumber", "ProtectKernelTunables", "ProtectKernelModules",
                "ProtectControlGroups", "LockPersonality", "RestrictRealtime", "ProtectProc")


def sandbox(dry_run: bool, out: Path) -> Result:
    import torch

    if not Path("/run/systemd/system").is_dir() or shutil.which("systemd-run") is None:
        init = Path("/proc/1/comm").read_text().strip() if Path("/proc/1/comm").exists() else "?"
        return {"status": "skipped", "reason": f"no systemd here (PID 1 is {init})"}
    if not torch.cuda.is_available():
        return {"status": "skipped", "reason": "no CUDA GPU to reach from the sandbox"}
    properties = []
    for line in (REPO / "systemd/inboxd.service").read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip() in SANDBOX_KEYS:
            properties += ["-p", f"{key.strip()}={value.strip()}"]
    probe = ("import torch; x = torch.ones(1024, device='cuda'); torch.cuda.synchronize(); "
             "print(torch.cuda.get_device_name(), float(x.sum()))")
    proc = subprocess.run(["systemd-run", "--wait", "--pipe", "--quiet", *properties,
                           f"--setenv=PYTHONPATH={os.environ.get('PYTHONPATH', '')}",
                           sys.executable, "-c", probe],
                          capture_output=True, text=True, timeout=15, check=False)
    ok = proc.returncode == 0 and "1024.0" in proc.stdout
    return {"status": "passed" if ok else "failed", "stdout": proc.stdout.strip(),
            "stderr": proc.stderr.strip()[-2000:], "summary": proc.stdout.strip()[:80]}


STAGES: dict[str, Callable[[bool, Path], Result]] = {
    "gpu_tests": gpu_tests, "precision": precision, "gpu_decode": gpu_decode,
    "throughput": throughput, "flood_memory": flood_memory, "oom_split": oom_split,
    "detection": detection, "sandbox": sandbox, "ocr": ocr,
}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("stage", choices=sorted(STAGES))
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--result", type=Path, required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    _RESULT_PATH.append(args.result)
    try:
        result = STAGES[args.stage](args.dry_run, args.out)
    except Exception as exc:  # the stage's verdict: recorded, then the traceback in its log
        result = {"status": "failed", "error": f"{type(exc).__name__}: {exc}"[:2000]}
        args.result.write_text(json.dumps(result, indent=1, default=str))
        raise
    args.result.write_text(json.dumps(result, indent=1, default=str))
    return 0 if result["status"] in ("passed", "skipped") else 1


if __name__ == "__main__":
    sys.exit(main())
