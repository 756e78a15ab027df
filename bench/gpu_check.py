"""``bench/gpu_check.sh``'s driver: the device check's stages, most important first, each in its
own process with its own deadline (a hung CUDA call or a poisoned context costs one stage, not
the run), and ``gpu_check.json`` rewritten after every stage so that a run cut short still
leaves every figure measured so far.

    python -m bench.gpu_check [--dry-run] [--out DIR]      (via bench/gpu_check.sh)

Without ``--dry-run`` it needs CUDA: where an NVIDIA GPU is present but CUDA fails it exits 1
with torch's message and what to do; where there is no GPU at all it exits 1 and says to use
``--dry-run``. A dry run runs every stage on the CPU with tiny sizes, so the script is proven
before a GPU is at hand; its figures are CPU figures and are labelled so.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

# (stage, deadline in seconds on the GPU machine, in a dry run on 2 shared CPU cores). GPU:
# 615 s in all if every stage ran to its deadline (none is expected to: each is an upper
# bound), with gpu_decode (issue 12), detection and ocr (issue 38) added. Dry run: what each stage
# took on the loaded CPU machine (10-65 s), with room; the suite's test bounds the whole at
# 4 min.
STAGES: tuple[tuple[str, int, int], ...] = (
    ("gpu_tests", 120, 60),
    ("precision", 60, 90),
    ("gpu_decode", 30, 90),
    ("throughput", 130, 90),
    ("flood_memory", 90, 60),
    ("oom_split", 45, 60),
    ("detection", 60, 60),
    ("sandbox", 20, 20),
    ("ocr", 60, 60),
)
OK = ("passed", "skipped")
# Where to look for the NVIDIA driver's files: "/" (a test points it at a fake host's root).
ROOT = Path(os.environ.get("GPU_CHECK_ROOT", "/"))


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def environment() -> dict[str, Any]:
    import torch
    from inboxd.models.device import cuda_failure, nvidia_driver_version, nvidia_hardware

    found: dict[str, Any] = {
        "host": platform.node(), "python": platform.python_version(), "cpus": os.cpu_count(),
        "torch": torch.__version__, "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(), "nvidia_hardware": nvidia_hardware(ROOT),
        "nvidia_driver": nvidia_driver_version(ROOT),
    }
    if torch.cuda.is_available():
        properties = torch.cuda.get_device_properties(0)
        found.update(gpu=properties.name, gpu_memory_bytes=properties.total_memory,
                     compute_capability="{}.{}".format(*torch.cuda.get_device_capability(0)),
                     cudnn=torch.backends.cudnn.version())  # type: ignore[no-untyped-call]
    else:
        found["cuda_error"] = cuda_failure()
    return found


def run_stage(name: str, deadline_s: int, dry_run: bool, out: Path) -> dict[str, Any]:
    result_path = out / f"stage-{name}.json"
    log_path = out / f"stage-{name}.log"
    result_path.unlink(missing_ok=True)
    command = [sys.executable, "-m", "bench.gpu_stages", name, "--out", str(out),
               "--result", str(result_path), *(["--dry-run"] if dry_run else [])]
    started = time.perf_counter()
    with open(log_path, "w") as log:
        try:
            code: int | str = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT,
                                             timeout=deadline_s, check=False).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    result: dict[str, Any] = {}
    if result_path.is_file():
        result = json.loads(result_path.read_text())
    if code == "timeout":
        result["status"] = "timed_out"
        result["error"] = f"over its {deadline_s} s deadline (figures so far above)"
    elif code != 0 and result.get("status") != "failed":  # crashed, or "running" when it did
        result["status"] = "failed"
        result.setdefault("error", f"exit status {code}: see {log_path.name}")
    result.setdefault("status", "passed")
    return {"status": result.pop("status"), "wall_s": round(time.perf_counter() - started, 1),
            "deadline_s": deadline_s, "log": log_path.name, **result}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true",
                        help="every stage on this machine's CPU with tiny sizes")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench/out")))
    args = parser.parse_args()
    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    report_path = out / "gpu_check.json"
    report: dict[str, Any] = {
        "mode": "dry-run (CPU, tiny sizes: not GPU figures)" if args.dry_run else "gpu",
        "started_at": now(), "status": "running", "environment": environment(), "stages": {},
    }

    def write() -> None:
        report["updated_at"] = now()
        tmp = report_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(report, indent=1, default=str) + "\n")
        os.replace(tmp, report_path)

    env = report["environment"]
    if not args.dry_run and not env["cuda_available"]:
        from inboxd.models.device import remedies

        if env["nvidia_hardware"]:
            report["error"] = (f"an NVIDIA GPU is present ({env['nvidia_hardware']}) but CUDA "
                               f"cannot be used: {env['cuda_error']}. {remedies(ROOT)}")
        else:
            report["error"] = (f"no NVIDIA GPU here ({env['cuda_error']}): run "
                               "bench/gpu_check.sh --dry-run to check the script on the CPU")
        report["status"] = "failed"
        write()
        print(f"gpu_check: {report['error']}", file=sys.stderr)
        return 1
    where = env.get("gpu") or "the CPU"
    print(f"gpu_check: {report['mode']} on {where}, torch {env['torch']}; "
          f"writing {report_path}", flush=True)
    write()
    for name, gpu_deadline_s, dry_deadline_s in STAGES:
        deadline_s = dry_deadline_s if args.dry_run else gpu_deadline_s
        stage = run_stage(name, deadline_s, args.dry_run, out)
        report["stages"][name] = stage
        write()
        note = stage.get("summary") or stage.get("reason") or stage.get("error") or ""
        print(f"gpu_check: {name:<13} {stage['status']:<9} {stage['wall_s']:6.1f} s  {note}",
              flush=True)
    failed = [n for n, s in report["stages"].items() if s["status"] not in OK]
    report["status"] = "failed" if failed else "passed"
    write()
    print(f"gpu_check: {report['status']}" + (f" ({', '.join(failed)})" if failed else "")
          + f"; {report_path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
