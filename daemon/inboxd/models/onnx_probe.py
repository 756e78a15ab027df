"""A bring-your-own ``.onnx`` is first loaded and run in a child process under a memory limit:
``python -m inboxd.models.onnx_probe``.

An ONNX graph decides at run time how much memory it takes (an ``Expand`` to N×30000×30000 asks
for gigabytes per image), and the daemon would load and probe it in its own process, where the
kernel's or the unit's OOM killer ends the daemon (SIGKILL, a restart loop). The child runs every
batch size the daemon will (the start-up probe's, 1 and ``batch.max_size``) under ``RLIMIT_AS``
set to what it maps after its imports plus the memory this machine and this cgroup can give now
(``memory_headroom_bytes``, a share of it): an allocation past that fails in the child, and the
daemon refuses the model with exit 78 and the reason.

A graph may also size a tensor from the pixel *values* (``ConstantOfShape``, ``Range``,
``Expand``, ``Tile``, ``NonZero``, ``TopK`` fed a number computed from the input): nothing for a
blank batch, gigabytes for a bright photo. So each size runs three batches: all-zero, every
pixel at its largest value after normalisation, and seeded random pixels. The all-zero batches
run first and set the ceiling; the others run under the peak they reached plus
``VALUE_SLACK_BYTES``, and a graph that needs more, or whose output shape changes with the
values where a fixed one is expected, is refused: no photo can then make it take more than the
probe saw. A detector with NMS inside may answer a different number of boxes (the boxes
layout's K): that axis alone may move, within the same memory bound. A model that passes has
shown it fits.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import sys
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from inboxd.children import HelperProcess, die_with_parent, ignore_stop_signals
from inboxd.config import Config, ConfigError, ModelConfig
from inboxd.decode.spec import DEFAULT_DETECT_SIDE, PROBE_BATCH, TORCHVISION_INPUT, UNIT_SCALE
from inboxd.proc_status import status_bytes

# The share of the free memory a model may take: the daemon itself, its decode workers and the
# page cache need the rest.
HEADROOM_SHARE = 0.75
PROBE_TIMEOUT_S = 300.0
EXIT_NO_MEMORY = 3
EXIT_FAILED = 2
EXIT_VALUE_MEMORY = 4  # a batch of other pixel values needed more memory than the blank one
EXIT_VALUE_SHAPE = 5  # ... or answered a shape the blank one did not
# What a batch of other pixel values may map beyond the blank batches' peak: allocator and
# ONNX Runtime bookkeeping, a detector's NMS keeping more candidates. Far below what a
# value-sized tensor asks for at a bright photo (gigabytes).
VALUE_SLACK_BYTES = 128 << 20
VALUE_SEED = 0
# mallopt(3): a fixed threshold (no dynamic raise) and one arena for every thread.
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
MMAP_THRESHOLD_BYTES = 128 << 10
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
    from inboxd.models.device import with_device_defaults
    from inboxd.models.predictions import HOST_CPU

    completed, _ = with_device_defaults(config, HOST_CPU)
    return sorted({1, PROBE_BATCH, completed.batch.max_size})


def probe_onnx_blocks(config: Config) -> None:
    """Each bring-your-own ``.onnx`` of ``config`` probed in a child (``probe_in_child``) at the
    sizes the daemon runs: before anything loads one in this process."""
    sizes = daemon_sizes(config)
    for task, block in config.tasks.items():
        if block.kind != "onnx":
            continue
        own = [block.batch.max_size] if block.batch is not None else []  # a task's own batch
        _probe_task(config, task, block, sorted({*sizes, *own}))


def probe_reloaded_size(running: Config, ran: Mapping[str, Collection[int]], size: int
                        ) -> None:
    """A reload to the top-level ``batch.max_size`` ``size``: each running ``.onnx`` that takes
    the top-level batch (a task with a ``batch:`` of its own keeps it; a change to ``models:``
    waits for a restart) and has not run batches of ``size`` (``ran``: the sizes each task,
    by ``Config.tasks``'s keys, has run) is probed at it in a child first, before the warm-up
    runs it in the daemon."""
    for task, block in running.tasks.items():
        if block.kind == "onnx" and block.batch is None and size not in ran.get(task, ()):
            _probe_task(running, task, block, [size])


def _probe_task(config: Config, task: str, block: ModelConfig, sizes: list[int]) -> None:
    """``probe_in_child``, its refusal naming the task's key with ``models:``."""
    try:
        probe_in_child(block, sizes)
    except ConfigError as exc:
        if config.models is None:
            raise
        raise ConfigError(f"models.{task}", exc.problems) from exc


def probe_in_child(config: ModelConfig, sizes: list[int], timeout_s: float = PROBE_TIMEOUT_S
                   ) -> None:
    """Load ``config.onnx`` and run a blank, a brightest and a random batch of each of
    ``sizes`` in a child under a memory limit; a ``ConfigError`` saying why when it cannot."""
    assert config.onnx is not None
    limit_bytes = int(memory_headroom_bytes() * HEADROOM_SHARE)
    detect = config.output == "detect"
    mean, std = UNIT_SCALE if detect else (TORCHVISION_INPUT.mean, TORCHVISION_INPUT.std)
    side = (config.input.size or DEFAULT_DETECT_SIDE) if detect else (
        config.input.crop or TORCHVISION_INPUT.crop)
    asked = {"path": str(config.onnx), "side": side, "sizes": sorted(set(sizes)),
             "mean": list(config.input.mean or mean), "std": list(config.input.std or std),
             "detect": detect, "limit_bytes": limit_bytes, "parent_pid": os.getpid()}
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
    if code in (EXIT_VALUE_MEMORY, EXIT_VALUE_SHAPE):
        what = "memory" if code == EXIT_VALUE_MEMORY else "output shape"
        raise _refused(config, f"its {what} follows the pixel values ({last}): a photo could "
                       "make it ask for any memory inside the daemon, so it is refused; "
                       "export it with shapes that do not depend on the input's values (no "
                       "Range, ConstantOfShape, Expand, Tile, NonZero or TopK sized from "
                       "pixels; a detector's NMS may vary only its box count)")
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
    _map_what_is_used()
    limit = status_bytes("VmSize") + asked["limit_bytes"]
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    try:
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        options.log_severity_level = 3
        # Without the arena, what a run maps is what its tensors take: the arena grows by
        # doubling, which would hide a value-sized tensor or blame a few extra boxes.
        options.enable_cpu_mem_arena = False
        session = ort.InferenceSession(asked["path"], options, providers=["CPUExecutionProvider"])
        first = session.get_inputs()[0]
        shape = list(first.shape)
        fixed = shape[2] if len(shape) == 4 and isinstance(shape[2], int) else None
        side = fixed or asked["side"]
        blank_shapes = {}
        for size in asked["sizes"]:
            blank = np.zeros((size, 3, side, side), dtype=np.float32)
            blank_shapes[size] = _shapes(session.run(None, {first.name: blank}))
            del blank
    except MemoryError as exc:
        print(f"MemoryError: {exc}", file=sys.stderr)
        return EXIT_NO_MEMORY
    except Exception as exc:  # onnxruntime's own errors, allocation failures among them
        print(f"{type(exc).__name__}: {str(exc)[-200:]}", file=sys.stderr)  # the size is last
        return EXIT_NO_MEMORY if _is_allocation(exc) else EXIT_FAILED
    blank_peak = status_bytes("VmPeak")
    value_limit = min(limit, blank_peak + VALUE_SLACK_BYTES)
    resource.setrlimit(resource.RLIMIT_AS, (value_limit, limit))
    mean = np.asarray(asked["mean"], dtype=np.float32).reshape(1, 3, 1, 1)
    std = np.asarray(asked["std"], dtype=np.float32).reshape(1, 3, 1, 1)
    low = -mean / std  # a black pixel after normalisation
    span = 1.0 / std  # to a white one
    rng = np.random.default_rng(VALUE_SEED)
    for kind in ("brightest", "random"):
        for size in asked["sizes"]:
            try:
                if kind == "brightest":
                    batch = np.empty((size, 3, side, side), dtype=np.float32)
                    batch[:] = low + span
                else:
                    batch = rng.random((size, 3, side, side), dtype=np.float32)
                    batch *= span
                    batch += low
                shapes = _shapes(session.run(None, {first.name: batch}))
                del batch
            except Exception as exc:
                if isinstance(exc, MemoryError) or _is_allocation(exc):
                    room_mib = (value_limit - status_bytes("VmSize")) >> 20
                    print(f"a {kind} batch of {size} needed more than the {room_mib} MiB "
                          f"beyond what the blank batch left mapped: "
                          f"{type(exc).__name__}: {str(exc)[-160:]}", file=sys.stderr)
                    return EXIT_VALUE_MEMORY
                # The model's own error on these pixels: at run time it fails that batch
                # (split, the photo that still fails fails alone), which is not a reason to
                # refuse the model.
                continue
            moved = _moved_axes(blank_shapes[size], shapes, asked["detect"])
            if moved:
                print(f"a blank batch of {size} answered {blank_shapes[size]}, a {kind} one "
                      f"{shapes}", file=sys.stderr)
                return EXIT_VALUE_SHAPE
    return 0


def _map_what_is_used() -> None:
    """Make the address space follow what is allocated, so that the blank batches' peak
    measures the graph: glibc otherwise raises its mmap threshold after a large free (later
    blocks then come from a heap that does not shrink) and gives a new thread an arena of
    64 MiB of address space, either of which would pass for a tensor sized from the pixels."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
    libc.mallopt(M_ARENA_MAX, 1)


def _shapes(outputs: list[Any]) -> list[list[int]]:
    return [list(getattr(output, "shape", ())) for output in outputs]


def _moved_axes(blank: list[list[int]], other: list[list[int]], detect: bool) -> bool:
    """Whether ``other`` differs from ``blank`` beyond what a detector's NMS may move (the
    second axis, the box count, of an output that has one)."""
    if len(blank) != len(other):
        return True
    for was, now in zip(blank, other, strict=True):
        if len(was) != len(now):
            return True
        if any(a != b for axis, (a, b) in enumerate(zip(was, now, strict=True))
               if not (detect and axis == 1)):
            return True
    return False


def _is_allocation(exc: Exception) -> bool:
    text = str(exc).lower()
    return "alloc" in text or "memory" in text


if __name__ == "__main__":
    sys.exit(main())
