"""A bring-your-own ``.onnx`` is first loaded and run in a child process under a memory limit:
``python -m inboxd.models.onnx_probe``.

An ONNX graph decides at run time how much memory it takes (an ``Expand`` to N×30000×30000 asks
for gigabytes per image), and the daemon would load and probe it in its own process, where the
kernel's or the unit's OOM killer ends the daemon (SIGKILL, a restart loop). The child runs every
batch size the daemon will (the start-up probe's, 1 and ``batch.max_size``) under ``RLIMIT_AS``
set to what it maps after its imports plus the memory this machine and this cgroup can give now
(``memory_headroom_bytes``, a share of it): an allocation past that fails in the child, and the
daemon refuses the model with exit 78 and the reason. A model that passes has shown it fits.
"""

from __future__ import annotations

import json
import os
import resource
import sys
from pathlib import Path
from typing import Any

from inboxd.children import HelperProcess, die_with_parent, ignore_stop_signals
from inboxd.config import Config, ConfigError, ModelConfig

# The share of the free memory a model may take: the daemon itself, its decode workers and the
# page cache need the rest.
HEADROOM_SHARE = 0.75
PROBE_TIMEOUT_S = 300.0
EXIT_NO_MEMORY = 3
EXIT_FAILED = 2
_TAIL_CHARS = 400
CGROUP_ROOT = Path("/sys/fs/cgroup")


def memory_headroom_bytes(proc: Path = Path("/proc"), cgroups: Path = CGROUP_ROOT) -> int:
    """What can still be allocated here: the kernel's MemAvailable, and below it this process's
    memory cgroup limit minus what the cgroup uses (reclaimable file pages not counted)."""
    available = _meminfo_bytes(proc / "meminfo", "MemAvailable")
    for line in (proc / "self" / "cgroup").read_text().splitlines():
        _, controllers, where = line.split(":", 2)
        if controllers == "":  # cgroup v2
            folder = cgroups / where.lstrip("/")
            room = _cgroup_room(folder / "memory.max", folder / "memory.current",
                                folder / "memory.stat", "inactive_file")
        elif "memory" in controllers.split(","):  # cgroup v1
            folder = cgroups / "memory" / where.lstrip("/")
            room = _cgroup_room(folder / "memory.limit_in_bytes",
                                folder / "memory.usage_in_bytes", folder / "memory.stat",
                                "total_inactive_file")
        else:
            continue
        if room is not None:
            available = min(available, room)
    return max(0, available)


def _meminfo_bytes(path: Path, field: str) -> int:
    for line in path.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise OSError(f"no {field} in {path}")


def _cgroup_room(limit: Path, usage: Path, stat: Path, inactive: str) -> int | None:
    try:
        raw = limit.read_text().strip()
        if raw == "max" or int(raw) >= 1 << 60:
            return None  # no limit here
        used = int(usage.read_text())
        stats = dict(line.split() for line in stat.read_text().splitlines())
        return int(raw) - used + int(stats.get(inactive, 0))
    except (OSError, ValueError):
        return None  # not mounted where it says, or unreadable: the machine's figure stands


def daemon_sizes(config: Config) -> list[int]:
    """The batch sizes the daemon runs an ``.onnx`` at: the load's probe, then the warm-up's
    (``batch.max_size`` as the CPU's profile completes it: ONNX models run on the CPU)."""
    import torch

    from inboxd.models.device import with_device_defaults
    from inboxd.models.loading import PROBE_BATCH

    completed, _ = with_device_defaults(config, torch.device("cpu"))
    return sorted({1, PROBE_BATCH, completed.batch.max_size})


def probe_in_child(config: ModelConfig, sizes: list[int], timeout_s: float = PROBE_TIMEOUT_S
                   ) -> None:
    """Load ``config.onnx`` and run a blank batch of each of ``sizes`` in a child under a
    memory limit; a ``ConfigError`` saying why when it cannot."""
    assert config.onnx is not None
    limit_bytes = int(memory_headroom_bytes() * HEADROOM_SHARE)
    asked = {"path": str(config.onnx), "crop": config.input.crop, "sizes": sorted(set(sizes)),
             "limit_bytes": limit_bytes, "parent_pid": os.getpid()}
    try:
        probe = HelperProcess(("-m", "inboxd.models.onnx_probe"), capture_stderr=True)
    except OSError as exc:
        raise _refused(config, f"the probe process could not start: {exc.strerror or exc}"
                       ) from exc
    try:
        _, stderr = probe.communicate(json.dumps(asked).encode(), timeout_s)
    except TimeoutError as exc:
        raise _refused(config, f"loading and running it took more than {timeout_s:.0f} s"
                       ) from exc
    finally:
        probe.reap()
    code = probe.exit_code()
    if code == 0:
        return
    text = stderr.decode(errors="replace")
    last = (text.strip().splitlines() or ["(no output)"])[-1][-_TAIL_CHARS:]
    if code == EXIT_NO_MEMORY or code is None or code < 0:
        raise _refused(config, f"it needs more memory than the {limit_bytes >> 20} MiB this "
                       f"machine can give it now ({last}): it is refused rather than let it "
                       "get the daemon killed; if the model is sound, give inboxd more memory "
                       "(the unit's MemoryMax=) or lower batch.max_size")
    if code == EXIT_FAILED:
        return  # an error of the model's own: the in-process load says it, with its fix
    raise _refused(config, f"the probe process exited with {probe.describe_exit()}: {last}")


def _refused(config: ModelConfig, why: str) -> ConfigError:
    return ConfigError("model", [f"onnx: {config.onnx}: {why}"])


def main() -> int:
    asked: dict[str, Any] = json.loads(sys.stdin.read())
    die_with_parent(asked["parent_pid"])
    ignore_stop_signals()  # the daemon ends it (it dies with it); a Ctrl-C is the daemon's
    import numpy as np
    import onnxruntime as ort

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    limit = _vm_size_bytes() + asked["limit_bytes"]
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    try:
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        options.log_severity_level = 3
        session = ort.InferenceSession(asked["path"], options, providers=["CPUExecutionProvider"])
        first = session.get_inputs()[0]
        shape = list(first.shape)
        fixed = shape[2] if len(shape) == 4 and isinstance(shape[2], int) else None
        crop = fixed or asked["crop"] or 224
        for size in asked["sizes"]:
            blank = np.zeros((size, 3, crop, crop), dtype=np.float32)
            session.run(None, {first.name: blank})
    except MemoryError as exc:
        print(f"MemoryError: {exc}", file=sys.stderr)
        return EXIT_NO_MEMORY
    except Exception as exc:  # onnxruntime's own errors, allocation failures among them
        print(f"{type(exc).__name__}: {str(exc)[-200:]}", file=sys.stderr)  # the size is last
        text = str(exc).lower()
        return EXIT_NO_MEMORY if "alloc" in text or "memory" in text else EXIT_FAILED
    return 0


def _vm_size_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise OSError("no VmSize in /proc/self/status")


if __name__ == "__main__":
    sys.exit(main())
