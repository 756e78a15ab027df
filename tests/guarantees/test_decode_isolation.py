"""A file can only ever fail itself, and costs bounded memory and time first (issue 10, points 2
and 3), in the real daemon: one ``inboxd once`` over one file per class of hostile input, then
one plain test per class reading that file's outcome.

Real files where a real file does it (the bombs, Pillow decoders that raise unexpected types);
``INBOXD_TEST_DECODE_FAULTS`` inside the decode workers for what no file reliably does on this
Pillow (a segfault, an abort, a runaway allocation, a given exception type).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from support.photos import photo_paths
from tests.conftest import DaemonProcess, read_json, wait_until, write_config
from tests.decode import bombs
from tests.decode.processes import alive, decode_workers_in, decode_workers_of

CRASHERS = Path(__file__).parent / "crashers"
FAULTS = ("abort=abort,segv=segv,alloc=balloon,raise:RuntimeError=runtime,"
          "raise:struct.error=struct,raise:AttributeError=attribute")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("isolation")
    # A queue deep enough that each worker gets several files per request: every hostile file
    # below shares its request with others, which must not pay for it.
    config = write_config(root, inbox={"include": ["*"], "settle_ms": 0},
                          capacity={"queue": 16},
                          preprocess={"decode_timeout_s": 3, "decode_memory_mb": 512,
                                      "files_per_request": 8})
    inbox = root / "inbox"
    photos = sorted(photo_paths().values())[:2]
    shutil.copy(photos[0], inbox / "before.jpg")
    for name in ("runtime", "struct", "attribute", "abort", "segv", "balloon"):
        shutil.copy(photos[1], inbox / f"{name}.png")  # real photos; the fault is the worker's
    bombs.write(inbox / "texture.jpg", bombs.TYPE_ERROR_TIFF.read_bytes())  # TypeError
    for crasher in sorted(CRASHERS.iterdir()):
        shutil.copy(crasher, inbox / crasher.name)
    bombs.write(inbox / "scans.jpg", bombs.progressive_scan_bomb())
    bombs.write(inbox / "strip-8000.png", bombs.png_strip(1, 8000))
    bombs.write(inbox / "strip-40000.png", bombs.png_strip(1, 40000))
    bombs.sparse_file(inbox / "huge.jpg", bombs.jpeg_bytes(), 3 << 30)
    shutil.copy(photos[0], inbox / "zz-after.jpg")
    done = subprocess.run([sys.executable, "-m", "inboxd", "once", "-c", str(config)], cwd=root,
                          capture_output=True, text=True, timeout=240,
                          env={**os.environ, "INBOXD_TEST_DECODE_FAULTS": FAULTS})
    return {"root": root, "done": done}


def failure(run: dict[str, Any], name: str) -> str:
    done = run["done"]
    assert done.returncode == 1, f"exit {done.returncode}, not 1 (files failed):\n{done.stderr}"
    report = read_json(run["root"] / "failed" / f"{name}.error.json")
    assert (run["root"] / "failed" / name).exists()
    assert not (run["root"] / "results" / f"{name}.json").exists()
    return str(report["reason"])


def completed(run: dict[str, Any], name: str) -> dict[str, Any]:
    assert run["done"].returncode == 1, run["done"].stderr
    assert (run["root"] / "done" / name).exists()
    return read_json(run["root"] / "results" / f"{name}.json")  # type: ignore[no-any-return]


@pytest.mark.daemon
@pytest.mark.slow
@pytest.mark.parametrize("name, kind", [("runtime.png", "RuntimeError"),
                                        ("struct.png", "error"),
                                        ("attribute.png", "AttributeError")])
def test_an_exception_of_any_type_fails_only_its_file(run: dict[str, Any], name: str,
                                                      kind: str) -> None:
    assert f"the decoder failed on this file: {kind}" in failure(run, name)


@pytest.mark.daemon
def test_a_real_file_raising_an_unexpected_type_fails_only_itself(run: dict[str, Any]) -> None:
    assert "the decoder failed on this file: TypeError" in failure(run, "texture.jpg")


@pytest.mark.daemon
def test_every_kept_crasher_fails_only_itself(run: dict[str, Any]) -> None:
    for crasher in sorted(CRASHERS.iterdir()):
        assert failure(run, crasher.name), crasher.name


@pytest.mark.daemon
@pytest.mark.parametrize("name, signal_name", [("abort.png", "SIGABRT"), ("segv.png", "SIGSEGV")])
def test_a_decoder_crash_fails_only_its_file(run: dict[str, Any], name: str,
                                             signal_name: str) -> None:
    assert f"the decoder crashed on this file ({signal_name})" in failure(run, name)


@pytest.mark.daemon
def test_a_runaway_allocation_fails_only_its_file(run: dict[str, Any]) -> None:
    assert "more memory than preprocess.decode_memory_mb" in failure(run, "balloon.png")


@pytest.mark.daemon
def test_a_decode_that_never_ends_is_cut_at_decode_timeout_s(run: dict[str, Any]) -> None:
    """~330 KB of progressive JPEG whose last scan repeats 10,000 times: a minute or more of
    decoding (1,000 repeats once took 31 s here, and later only 5.7 s: under the timeout)."""
    assert "longer than preprocess.decode_timeout_s = 3 s" in failure(run, "scans.jpg")


@pytest.mark.daemon
def test_a_file_over_max_file_mb_is_refused_before_reading(run: dict[str, Any]) -> None:
    """3 GiB (sparse): a JPEG header and then gigabytes; it used to be read whole per worker."""
    assert "more than preprocess.max_file_mb = 256 MiB" in failure(run, "huge.jpg")


@pytest.mark.daemon
@pytest.mark.parametrize("name", ["strip-8000.png", "strip-40000.png"])
def test_an_extreme_aspect_ratio_costs_bounded_memory(run: dict[str, Any], name: str) -> None:
    """1×8000 used to take 2.1 GB, 1×40000 a MemoryError that stopped the daemon."""
    assert completed(run, name)["image"]["height"] == int(name[6:-4])


@pytest.mark.daemon
def test_the_daemon_carried_on_past_every_bad_file(run: dict[str, Any]) -> None:
    for name in ("before.jpg", "zz-after.jpg"):
        assert completed(run, name)["top_k"]
    assert "DECODE FAULT INJECTION ACTIVE" in run["done"].stderr, "it says so when armed"
    assert decode_workers_in(run["root"]) == [], "no decode worker outlives `inboxd once`"


@pytest.mark.daemon
@pytest.mark.slow
def test_no_decode_worker_outlives_a_killed_daemon(tmp_path: Path) -> None:
    daemon = DaemonProcess(write_config(tmp_path, preprocess={"workers": 2}))
    try:
        daemon.wait_for("ready")
        workers = wait_until(lambda: len(w := decode_workers_of(daemon.proc.pid)) == 2 and w,
                             30, "two decode workers")
        daemon.proc.send_signal(signal.SIGKILL)
        daemon.proc.wait(30)
        wait_until(lambda: not any(alive(pid) for pid in workers), 10,
                   "the decode workers to go with the daemon")
    finally:
        daemon.kill()
