"""A hostile model is refused, not fatal (issue 36, class 7): a bring-your-own ``.onnx`` that
asks for more memory than there is exits 78 with the reason instead of getting the daemon
OOM-killed; what is planted at the ONNX cache path cannot block or bloat the daemon; the
exporter dies with the daemon even when it was stopped as it started; a batch slower than the
watchdog allows is said at start-up."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.byo_models import labels_file, onnx_memory_bomb
from tests.conftest import make_image, write_config

CGROUP_LIMIT_BYTES = 2 << 30  # what the unit's MemoryMax= does, smaller


@contextlib.contextmanager
def memory_cgroup(name: str, limit_bytes: int) -> Iterator[Path]:
    """A memory cgroup (v1 or v2) of its own with a hard limit; its ``cgroup.procs`` to join."""
    v1 = Path("/sys/fs/cgroup/memory")
    folder = (v1 if v1.is_dir() else Path("/sys/fs/cgroup")) / name
    try:
        folder.mkdir()
        limit = folder / ("memory.limit_in_bytes" if v1.is_dir() else "memory.max")
        limit.write_text(str(limit_bytes))
    except OSError as exc:
        pytest.skip(f"cannot make a memory cgroup here: {exc}")
    try:
        yield folder / "cgroup.procs"
    finally:
        with contextlib.suppress(OSError):
            folder.rmdir()


@pytest.mark.daemon
@pytest.mark.slow  # a costly run: `make test`, not the fast tier
def test_a_memory_bomb_onnx_is_refused_with_78_not_oom_killed(tmp_path: Path) -> None:
    """Before: the start-up probe ran the graph in the daemon, which the cgroup's OOM killer
    ended (exit -9; under the unit a restart loop)."""
    bomb = onnx_memory_bomb(tmp_path / "bomb.onnx")
    config = write_config(tmp_path, model={"onnx": str(bomb),
                                           "labels": str(labels_file(tmp_path, 3))})
    make_image(tmp_path / "inbox" / "a.png")
    with memory_cgroup(f"inboxd-test-{os.getpid()}", CGROUP_LIMIT_BYTES) as procs:
        ran = subprocess.run(
            ["sh", "-c", f'echo $$ > "{procs}" && exec "$@"', "sh",
             sys.executable, "-m", "inboxd", "once", "-c", str(config)],
            cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert ran.returncode == 78, (ran.returncode, ran.stderr[-3000:])
    assert "needs more memory than the" in ran.stderr, ran.stderr[-3000:]
    assert "lower batch.max_size" in ran.stderr
    assert (tmp_path / "inbox" / "a.png").exists()


@pytest.mark.parametrize("planted", ["fifo", "huge"])
def test_what_is_planted_at_the_onnx_cache_path_is_refused_at_once(
        tmp_path: Path, planted: str) -> None:
    """Before: a FIFO blocked the build thread's open for good, with nothing logged; a 2 GiB
    file was read whole (peak RSS 2.9 GB) before it was found to be no model."""
    from inboxd.models.fast_path import FastPath

    from tests.models.test_runtimes import builtin

    model, config = builtin(tmp_path / "cache")
    target = FastPath(model, config).path
    target.parent.mkdir(parents=True)
    if planted == "fifo":
        os.mkfifo(target)
    else:
        with open(target, "wb") as sparse:  # 2 GiB that take no disk
            sparse.truncate(2 << 30)
    exports: list[Path] = []
    fast = FastPath(model, config, exporter=lambda _c, path, _k: exports.append(path))
    fast.start()
    fast.join(30)
    assert fast._thread is not None and not fast._thread.is_alive(), "the build is stuck"
    assert exports == [target], "refused, and exported again"
    reason = fast.fields["RUNTIME_REBUILD_REASON"]
    assert ("not a regular file" if planted == "fifo" else "where this network's export takes"
            ) in reason, reason


STOPPED_EXPORTER = """
import os, signal, subprocess, sys
from pathlib import Path
from inboxd.config import ModelConfig
from inboxd.models import onnx_export

class StoppedAtOnce(subprocess.Popen):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        os.kill(self.pid, signal.SIGSTOP)  # before its interpreter has run a line
        print(self.pid, flush=True)
        os._exit(0)  # the daemon goes: exits, or is killed

subprocess.Popen = StoppedAtOnce  # what children.HelperProcess starts every helper with
onnx_export.export_in_child(ModelConfig(), Path(sys.argv[1]), "key")
"""


def test_an_exporter_stopped_as_it_starts_dies_with_the_daemon(tmp_path: Path) -> None:
    """Before: ``die_with_parent`` ran in the exporter's ``main``; stopped before it, the
    exporter outlived the daemon (stopped, for ever). Every helper starts the same way
    (``children.HelperProcess``): the exporter stands for all of them."""
    from support.waiting import wait_until

    ran = subprocess.run([sys.executable, "-c", STOPPED_EXPORTER, str(tmp_path / "a.onnx")],
                         capture_output=True, text=True, timeout=60)
    pid = int(ran.stdout.split()[0])

    def gone() -> bool:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                return stat.read().rpartition(")")[2].split()[0] == "Z"
        except FileNotFoundError:
            return True

    try:
        wait_until(gone, 10, "the stopped exporter to die with its parent")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 9)


@pytest.mark.daemon
@pytest.mark.slow  # a costly run: `make test`, not the fast tier
def test_a_batch_slower_than_the_watchdog_allows_is_said_at_start_up(tmp_path: Path) -> None:
    """Before: nothing at start-up; the first busy batch stopped the pings and systemd
    restarted the service, again and again."""
    from tests.conftest import DaemonProcess

    config = write_config(tmp_path, batch={"max_size": 8})
    daemon = DaemonProcess(config, env={"WATCHDOG_USEC": "20000"})  # 20 ms: any batch is longer
    try:
        daemon.wait_for("ready", 180)
        warnings = [line for line in daemon.records("watchdog_too_short") if "at warm-up" in line]
    finally:
        daemon.stop()
    assert warnings, daemon.output()
    assert "Raise WatchdogSec= to at least" in warnings[0]
    assert "lower batch.max_size" in warnings[0]


@pytest.mark.daemon
@pytest.mark.slow  # a costly run: `make test`, not the fast tier
@pytest.mark.parametrize("as_task", [False, True], ids=["model", "models-task"])
def test_a_reload_to_a_batch_size_the_onnx_cannot_afford_is_refused_not_fatal(
        tmp_path: Path, as_task: bool) -> None:
    """Before: the reload warmed the new size in the daemon, which the OOM killer ended (with
    ``models:``, beside a detector, with the task join's photos in flight). As a task on the
    top-level batch, the refusal names the task's key."""
    import signal

    from tests import detectors
    from tests.conftest import DaemonProcess

    bomb = onnx_memory_bomb(tmp_path / "bomb.onnx", side=4000)  # 64 MB an image
    model = {"onnx": str(bomb), "labels": str(labels_file(tmp_path, 3))}
    blocks = ({"model": None, "models": {"things": detectors.yolo_block(tmp_path), "bomb": model}}
              if as_task else {"model": model})
    config = write_config(tmp_path, batch={"max_size": 8}, **blocks)
    with memory_cgroup(f"inboxd-test-{os.getpid()}", CGROUP_LIMIT_BYTES) as procs:
        daemon = DaemonProcess(config)
        try:
            procs.write_text(str(daemon.proc.pid))  # long before its model loads
            daemon.wait_for("ready", 180)
            write_config(tmp_path, batch={"max_size": 64}, **blocks)  # 4 GB at once
            daemon.proc.send_signal(signal.SIGHUP)
            refused = daemon.wait_for("reloaded", 120)[-1]
            assert "reload refused" in refused and "needs more memory" in refused, refused
            if as_task:
                assert "models.bomb" in refused, refused  # the task's key, to fix
            make_image(tmp_path / "inbox" / "a.png")
            daemon.wait_for("completed", 60)
        finally:
            code = daemon.stop()
    assert code == 0, daemon.output()
    assert (tmp_path / "done" / "a.png").is_file()


@pytest.mark.parametrize("command", ["check-config", "models", "once"])
def test_the_commands_that_read_an_onnx_probe_it_first(tmp_path: Path, command: str) -> None:
    """`inboxd models` loaded a bring-your-own .onnx in its own process and `check-config`
    only checked the file was readable: a graph whose memory follows the pixel values (here
    ~500 MB for a bright photo, gigabytes as easily) was listed as fine, and the daemon
    (`once`, as `run`) served it. All refuse it, with 78, the key and what to do."""
    from tests.byo_models import value_shaped_bomb

    bomb = value_shaped_bomb(tmp_path / "bomb.onnx", per_unit=4_400.0)
    config = write_config(tmp_path, model={"onnx": str(bomb),
                                           "labels": str(labels_file(tmp_path, 3))})
    make_image(tmp_path / "inbox" / "a.png")
    ran = subprocess.run([sys.executable, "-m", "inboxd", command, "-c", str(config)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert ran.returncode == 78, (ran.returncode, ran.stdout[-2000:], ran.stderr[-3000:])
    assert f"model: onnx: {bomb}: its memory follows the pixel values" in ran.stderr
    assert (tmp_path / "inbox" / "a.png").exists()  # nothing taken
    assert "export it with shapes that do not depend on the input's values" in ran.stderr
