"""The decode worker pool with real worker processes: every way a decode can go wrong costs that
one file, with a reason, and the pool carries on with a fresh worker.

Faults a real file cannot be relied on to cause (a segfault, an abort, a hang, any exception
type) are injected inside the worker by ``INBOXD_TEST_DECODE_FAULTS``, keyed by file name; the real
bombs (tests/decode/bombs.py) are real files.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from inboxd.decode.pillow import decode_image
from inboxd.decode.pool import DecodePool
from inboxd.decode.replies import DecodeTimedOut
from inboxd.decode.spec import PreprocessSpec, ResizeMode
from inboxd.decode.worker_process import WorkerSettings
from inboxd.files.reading import HASH_CHUNK_BYTES
from inboxd.item import PermanentError, TransientError
from PIL import Image

from tests.conftest import make_image, wait_until
from tests.decode import bombs
from tests.decode.processes import alive

SPEC = PreprocessSpec(256, 224, "bicubic", (0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
FAULTS = ("abort=abort,segv=segv,hang=hang,alloc=balloon,exit=exits,"
          "raise:RuntimeError=runtime,raise:NotImplementedError=notimpl,"
          "raise:AttributeError=attribute,raise:struct.error=struct,raise:MemoryError=memory")
MiB = 1 << 20


def settings(spec: PreprocessSpec = SPEC, **overrides: float) -> WorkerSettings:
    values = {"max_image_pixels": 89_478_485, "max_file_bytes": 256 * MiB,
              "decode_memory_bytes": 512 * MiB, "decode_timeout_s": 20.0, **overrides}
    return WorkerSettings(spec, int(values["max_image_pixels"]), int(values["max_file_bytes"]),
                          int(values["decode_memory_bytes"]), float(values["decode_timeout_s"]))


@pytest.fixture(scope="module")
def pool() -> Iterator[DecodePool]:
    """One pool for the module (workers take ~1 s to start), faults armed by file name."""
    os.environ["INBOXD_TEST_DECODE_FAULTS"] = FAULTS
    try:
        decode_pool = DecodePool(2, settings(decode_timeout_s=3))
        decode_pool.start()
    finally:
        del os.environ["INBOXD_TEST_DECODE_FAULTS"]
    yield decode_pool
    decode_pool.close()


@pytest.fixture
def balloon_pool(tmp_path: Path) -> Iterator[DecodePool]:
    """A pool of its own for the files that balloon to the memory limit, without the shared
    pool's 3 s timeout: zeroing 512 MiB took longer than that once, in a fresh clone's
    `make test` on a loaded machine (12-03), and the file failed as a hang instead."""
    balloon = faulty_pool(tmp_path, FAULTS, decode_timeout_s=60)
    yield balloon
    balloon.close()


def faulty_pool(tmp_path: Path, faults: str, **overrides: float) -> DecodePool:
    """A one-worker pool, started, whose workers have ``faults`` armed (read at their start)."""
    os.environ["INBOXD_TEST_DECODE_FAULTS"] = faults
    try:
        pool = DecodePool(1, settings(**overrides))
        pool.decode(make_image(tmp_path / "warm.png"))
    finally:
        del os.environ["INBOXD_TEST_DECODE_FAULTS"]
    return pool


def refuse_fork(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise BlockingIOError(11, "Resource temporarily unavailable")  # fork: EAGAIN
    monkeypatch.setattr(subprocess, "Popen", refuse)


def still_works(pool: DecodePool, tmp_path: Path) -> None:
    good = make_image(tmp_path / "good-after.png", size=(300, 200))
    for _ in range(pool.workers + 1):  # every worker, the replaced one included
        result = pool.decode(good)
        assert result.error is None and result.image is not None
        assert result.image.pixels.shape == (224, 224, 3)


def test_a_good_file_decodes_with_its_sha256(pool: DecodePool, tmp_path: Path) -> None:
    path = make_image(tmp_path / "photo.jpg", size=(640, 480))
    result = pool.decode(path)
    assert result.error is None and result.image is not None
    assert (result.image.width, result.image.height, result.image.format) == (640, 480, "JPEG")
    import hashlib
    assert result.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert result.size_bytes == path.stat().st_size
    assert pool.decode(path, expected_sha256=result.sha256).duplicate, "known: not decoded"


@pytest.mark.parametrize("size", [(320, 240), (960, 720)])
def test_a_file_decodes_the_same_whether_one_read_took_it_or_not(
        pool: DecodePool, tmp_path: Path, size: tuple[int, int]) -> None:
    """Up to HASH_CHUNK_BYTES a worker decodes the bytes it hashed; past it, it reads the file
    again: either way the crop is the one its bytes give."""
    noise = np.random.default_rng(7).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    path = tmp_path / "noise.png"  # noise does not compress: 230 KB and 2 MB
    Image.fromarray(noise).save(path)
    assert (path.stat().st_size > HASH_CHUNK_BYTES) == (size[0] > 320)
    result = pool.decode(path)
    assert result.error is None and result.image is not None
    assert result.size_bytes == path.stat().st_size
    expected = decode_image(path.read_bytes(), SPEC, 1 << 30).pixels
    assert np.array_equal(result.image.pixels, expected)


def test_a_file_still_open_for_writing_is_reported_with_its_identity(
        pool: DecodePool, tmp_path: Path) -> None:
    """The worker asks on the file it has just read whether a writer still holds it: the
    daemon gives such a file back to settle (a writer that paused past settle_ms)."""
    path = make_image(tmp_path / "open.png")
    st = path.stat()
    with open(path, "ab") as writer:
        held = pool.decode(path)
        writer.write(b"")  # still open while the worker read it
    assert held.error is None and held.held_for_writing
    assert held.still_being_written((st.st_ino, st.st_size, st.st_mtime_ns))
    done = pool.decode(path)
    assert done.identity == (st.st_ino, st.st_size, st.st_mtime_ns)
    assert not done.held_for_writing
    assert not done.still_being_written(done.identity)
    assert done.still_being_written((st.st_ino, st.st_size - 1, st.st_mtime_ns)), "changed"
    assert pool.decode(path, expected_sha256=done.sha256).identity == done.identity


def test_a_broken_lease_does_not_kill_a_worker(pool: DecodePool, tmp_path: Path) -> None:
    """Opening the file for writing while the worker holds its read lease breaks the lease,
    and the kernel signals the holder with SIGIO, which kills a process by default."""
    pool.decode(make_image(tmp_path / "warm.png"))
    pids = pool.worker_pids()
    for pid in pids:
        os.kill(pid, signal.SIGIO)
    time.sleep(0.2)
    assert all(alive(pid) for pid in pids)
    assert pool.decode(make_image(tmp_path / "after.png")).error is None
    assert pool.worker_pids() == pids


def test_workers_run_this_checkout_without_torch(pool: DecodePool) -> None:
    pool.decode(__file__)  # any request: the workers are ready after it
    import inboxd
    for process in list(pool._all):
        if process.ready is None:
            continue
        assert process.ready["heavy_modules"] == [], "a decode worker must not import torch"
        assert process.ready["inboxd_path"] == inboxd.__file__
        assert process.ready["limit_error"] is None, "the memory limit is in force"


@pytest.mark.parametrize("kind", ["runtime", "notimpl", "attribute", "struct", "memory"])
def test_any_exception_from_a_decoder_fails_only_that_file(
        pool: DecodePool, tmp_path: Path, kind: str) -> None:
    result = pool.decode(make_image(tmp_path / f"{kind}.png"))
    assert isinstance(result.error, PermanentError), result
    expected = "more memory than" if kind == "memory" else "the decoder failed on this file"
    assert expected in str(result.error)
    assert result.sha256 is not None, "what was learnt before the failure is kept"
    still_works(pool, tmp_path)


def test_real_files_that_raise_unexpected_types_fail_alone(pool: DecodePool,
                                                           tmp_path: Path) -> None:
    path = bombs.write(tmp_path / "texture.jpg", bombs.TYPE_ERROR_TIFF.read_bytes())
    result = pool.decode(path)
    assert isinstance(result.error, PermanentError)
    assert "the decoder failed on this file: TypeError" in str(result.error)
    dds = pool.decode(bombs.write(tmp_path / "dds.jpg", bombs.dds_unknown_fourcc()))
    assert "in a format inboxd takes" in str(dds.error)  # never parsed
    still_works(pool, tmp_path)


@pytest.mark.parametrize("kind", ["abort", "segv", "exits"])
def test_a_crashing_decoder_fails_that_file_and_is_replaced(
        pool: DecodePool, tmp_path: Path, kind: str) -> None:
    replaced = pool.replaced
    result = pool.decode(make_image(tmp_path / f"{kind}.png"))
    assert isinstance(result.error, PermanentError), result
    assert "the decoder crashed on this file" in str(result.error)
    assert {"abort": "SIGABRT", "segv": "SIGSEGV", "exits": "exit status 3"}[kind] in str(
        result.error)
    assert pool.replaced == replaced + 1
    still_works(pool, tmp_path)


def test_a_hang_is_cut_at_decode_timeout_s(pool: DecodePool, tmp_path: Path) -> None:
    started = time.monotonic()
    result = pool.decode(make_image(tmp_path / "hang.png"))
    assert 3 <= time.monotonic() - started < 10
    # Transient the first time: the pipeline fails the file when it times out again.
    assert isinstance(result.error, DecodeTimedOut)
    assert "longer than preprocess.decode_timeout_s = 3 s" in str(result.error)
    still_works(pool, tmp_path)


def test_a_worker_spinning_on_the_cpu_is_cut_at_decode_timeout_s(tmp_path: Path) -> None:
    pool = faulty_pool(tmp_path, "spin=spin", decode_timeout_s=2)
    try:
        started = time.monotonic()
        result = pool.decode(make_image(tmp_path / "spin.png"))
        assert 2 <= time.monotonic() - started < 10
        assert isinstance(result.error, DecodeTimedOut), result
        still_works(pool, tmp_path)
    finally:
        pool.close()


def test_a_worker_stopped_from_outside_is_replaced_and_its_file_not_blamed(
        tmp_path: Path) -> None:
    """Stopped (SIGSTOP, a debugger) its time does not count: no time-out; once stopped for
    decode_timeout_s it is replaced, and the file gets a transient error (tried again)."""
    pool = faulty_pool(tmp_path, "slow:1.5=slow", decode_timeout_s=2)
    try:
        pool.decode(make_image(tmp_path / "warm.png"))
        (pid,) = pool.worker_pids()
        stopper = subprocess.Popen([sys.executable, "-c", f"import os, time; time.sleep(0.5); "
                                    f"os.kill({pid}, 19)"])  # SIGSTOP, mid-decode
        started = time.monotonic()
        result = pool.decode(make_image(tmp_path / "slow.png"))
        stopper.wait(10)
        assert time.monotonic() - started >= 2.5, "the stopped time did not count"
        assert type(result.error) is TransientError, result
        assert "stopped from outside" in str(result.error)
        assert pid not in pool.worker_pids()
        still_works(pool, tmp_path)
    finally:
        pool.close()


def test_a_runaway_allocation_stops_at_the_memory_limit(balloon_pool: DecodePool,
                                                        tmp_path: Path) -> None:
    result = balloon_pool.decode(make_image(tmp_path / "balloon.png"))
    assert isinstance(result.error, PermanentError)
    assert "more memory than preprocess.decode_memory_mb = 512" in str(result.error)
    assert result.peak_rss_bytes < 1024 * MiB
    still_works(balloon_pool, tmp_path)


def test_a_worker_killed_while_idle_costs_no_file(pool: DecodePool, tmp_path: Path) -> None:
    pool.decode(make_image(tmp_path / "warm.png"))
    for pid in pool.worker_pids():
        os.kill(pid, signal.SIGKILL)
    still_works(pool, tmp_path)


def test_a_worker_killed_from_outside_mid_file_is_a_transient_error(tmp_path: Path) -> None:
    pool = faulty_pool(tmp_path, "hang=hang", decode_timeout_s=30)
    try:
        pid = pool.worker_pids()[0]
        killer = subprocess.Popen([sys.executable, "-c", f"import os, time; time.sleep(1); "
                                   f"os.kill({pid}, 9)"])  # the OOM killer, say
        result = pool.decode(make_image(tmp_path / "hang.png"))
        killer.wait(10)
        assert isinstance(result.error, TransientError), result
        assert "killed from outside" in str(result.error)
    finally:
        pool.close()


def test_a_file_over_max_file_mb_is_refused_before_it_is_read(pool: DecodePool,
                                                              tmp_path: Path) -> None:
    huge = bombs.sparse_file(tmp_path / "huge.jpg", bombs.jpeg_bytes(), 3 << 30)  # 3 GiB
    started = time.monotonic()
    result = pool.decode(huge)
    assert time.monotonic() - started < 2, "refused on fstat, not after reading 3 GiB"
    assert isinstance(result.error, PermanentError)
    assert "more than preprocess.max_file_mb = 256 MiB" in str(result.error)
    assert result.sha256 is None


@pytest.mark.parametrize("mode", ["exact", "fast"])
@pytest.mark.parametrize("height", [8000, 40000])
def test_an_extreme_aspect_ratio_decodes_in_bounded_memory(tmp_path: Path, height: int,
                                                           mode: ResizeMode) -> None:
    """1×8000 used to cost 2.1 GB (the strip resized to 256×2,048,000), 1×40000 a MemoryError."""
    pool = DecodePool(1, settings(replace(SPEC, resize_mode=mode)))
    try:
        result = pool.decode(bombs.write(tmp_path / "strip.png", bombs.png_strip(1, height)))
        assert result.error is None and result.image is not None, result
        assert result.image.pixels.shape == (224, 224, 3)
        assert result.peak_rss_bytes < 200 * MiB
    finally:
        pool.close()


def test_the_resize_mode_reaches_the_workers(tmp_path: Path) -> None:
    """A worker decodes with the spec's resize_mode: a 12-MP JPEG's fast crop is what
    ``decode_image`` makes in fast mode here, and not the exact one."""
    data = bombs.jpeg_bytes((4000, 3000))
    path = bombs.write(tmp_path / "photo.jpg", data)
    fast_spec = replace(SPEC, resize_mode="fast")
    fast = decode_image(data, fast_spec, 89_478_485).pixels
    exact = decode_image(data, SPEC, 89_478_485).pixels
    assert not np.array_equal(fast, exact), "the photo does not tell the modes apart"
    pool = DecodePool(1, settings(fast_spec))
    try:
        result = pool.decode(path)
        assert result.image is not None, result
        assert np.array_equal(result.image.pixels, fast)
        assert (result.image.width, result.image.height) == (4000, 3000)
    finally:
        pool.close()


def test_no_worker_outlives_a_killed_parent(tmp_path: Path) -> None:
    """PR_SET_PDEATHSIG: a daemon killed with SIGKILL, even mid-decode, takes its workers."""
    script = textwrap.dedent(f"""
        import os, sys
        os.environ["INBOXD_TEST_DECODE_FAULTS"] = "hang=hang"
        from tests.decode.test_pool import settings
        from inboxd.decode.pool import DecodePool
        pool = DecodePool(2, settings())
        pool.decode({str(make_image(tmp_path / "warm.png"))!r})
        print(*pool.worker_pids(), flush=True)
        pool.decode({str(make_image(tmp_path / "hang.png"))!r})  # never returns
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                              cwd=Path(__file__).resolve().parents[2])
    assert parent.stdout is not None
    pids = [int(p) for p in parent.stdout.readline().split()]
    assert len(pids) == 2
    time.sleep(0.5)  # let the second request reach its worker
    parent.kill()
    parent.wait(10)
    wait_until(lambda: not any(alive(pid) for pid in pids), 10, "the workers to die")


def test_a_worker_that_cannot_be_replaced_is_a_transient_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pool = faulty_pool(tmp_path, "exit=exits")
    try:
        refuse_fork(monkeypatch)
        # The worker dies on this file, and none can replace it: the file keeps its own
        # reason (the crash is its doing), the next one finds no worker.
        crashed = pool.decode(make_image(tmp_path / "exits.png"))
        assert "the decoder crashed on this file" in str(crashed.error)
        with pytest.raises(TransientError, match="cannot start a decode worker"):
            pool.decode(make_image(tmp_path / "next.png"))
        monkeypatch.undo()
        still_works(pool, tmp_path)  # the next file starts a worker again
    finally:
        pool.close()


def test_close_ends_every_worker() -> None:
    pool = DecodePool(2, settings())
    pool.start()
    pids = pool.worker_pids()
    pool.close()
    assert not any(alive(pid) for pid in pids)
    with pytest.raises(TransientError, match="shutting down"):
        pool.decode(__file__)


@pytest.mark.timeout(120)
def test_workers_that_cannot_start_leave_their_slots_to_try_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A start that fails (fork refused) used to leave the pool with fewer workers than
    threads waiting on them — a silent stall — or put a dead worker's pipes back in use."""
    pool = DecodePool(2, settings())
    try:
        refuse_fork(monkeypatch)
        pool.start()  # no worker at all: both slots wait to try again
        with pytest.raises(TransientError, match="cannot start a decode worker"):
            pool.decode(make_image(tmp_path / "first.png"))
        monkeypatch.undo()
        still_works(pool, tmp_path)
        assert len(pool.worker_pids()) == 2
    finally:
        pool.close()


def test_one_request_of_many_files_costs_only_the_bad_ones(balloon_pool: DecodePool,
                                                           tmp_path: Path) -> None:
    """A crash, an exit and a memory recycle in the middle of one request: each costs only the
    file it was on, and the files after it are decoded by the replacement."""
    names = ["a.png", "segv.png", "b.png", "exits.png", "c.png", "balloon.png", "d.png"]
    files = [make_image(tmp_path / name, size=(120 + i, 90)) for i, name in enumerate(names)]
    replaced = balloon_pool.replaced
    results = balloon_pool.decode_many([(path, None) for path in files])
    assert len(results) == len(files)
    for name, result in zip(names, results, strict=True):
        bad = name in ("segv.png", "exits.png", "balloon.png")
        assert (result.error is not None) == bad, (name, result)
        if not bad:
            assert result.image is not None and result.image.width == 120 + names.index(name)
    assert "SIGSEGV" in str(results[1].error) and "exit status 3" in str(results[3].error)
    assert "more memory than" in str(results[5].error)
    assert balloon_pool.replaced == replaced + 3
    still_works(balloon_pool, tmp_path)


def test_a_hang_inside_a_request_is_cut_and_the_rest_decoded(pool: DecodePool,
                                                             tmp_path: Path) -> None:
    files = [make_image(tmp_path / name) for name in ("first.png", "hang.png", "last.png")]
    results = pool.decode_many([(path, None) for path in files])
    assert results[0].error is None and results[2].error is None
    assert "longer than preprocess.decode_timeout_s = 3 s" in str(results[1].error)


def test_a_request_to_workers_killed_while_idle_costs_no_file(pool: DecodePool,
                                                              tmp_path: Path) -> None:
    files = [make_image(tmp_path / f"idle{i}.png") for i in range(5)]
    pool.decode(files[0])
    for pid in pool.worker_pids():
        os.kill(pid, signal.SIGKILL)
    results = pool.decode_many([(path, None) for path in files])
    assert all(result.error is None for result in results), results


def test_a_replacement_that_cannot_start_mid_request_keeps_the_outcomes_already_known(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A crash, then no worker can replace the dead one: the files answered before it keep
    their outcomes (a decoded crop, a bad file's reason), only those not answered yet are tried
    again later. The whole request used to raise, so a good file was decoded again and a bad
    one went back to the retry list instead of failing with its reason."""
    pool = faulty_pool(tmp_path, "exit=exits,raise:RuntimeError=runtime")
    try:
        refuse_fork(monkeypatch)
        names = ["good.png", "runtime.png", "exits.png", "after.png"]
        results = pool.decode_many([(make_image(tmp_path / n), None) for n in names])
        assert results[0].error is None and results[0].image is not None, results[0]
        assert isinstance(results[1].error, PermanentError)
        assert "RuntimeError" in str(results[1].error)
        # The crash is that file's own doing: its reason stands though nothing replaces the
        # worker; only the file after it, never started, is tried again later.
        assert "the decoder crashed on this file" in str(results[2].error)
        assert isinstance(results[3].error, TransientError), results[3]
        assert "cannot start a decode worker" in str(results[3].error)
        monkeypatch.undo()
        still_works(pool, tmp_path)
    finally:
        pool.close()


def test_a_request_of_64_paths_near_path_max_fits_the_worker_s_header_limit(
        pool: DecodePool, tmp_path: Path) -> None:
    """files_per_request's maximum (64) of paths as long as the kernel takes (4095 bytes):
    the request's JSON (hex-encoded paths) must stay under the worker's header limit, or the
    worker would die on every such request and its files be retried for ever."""
    deep = tmp_path  # folders of up to 250 bytes, then names of 250-251 (NAME_MAX is 255)
    while (room := 4095 - 1 - 250 - len(os.fsencode(deep))) > 1:
        deep = deep / ("d" * min(250, room - 1))
    deep.mkdir(parents=True)
    files = []
    for n in range(64):
        name = f"{n:02d}-".ljust(4095 - len(os.fsencode(deep)) - 1 - 4, "n") + ".png"
        files.append(make_image(deep / name, size=(40 + n, 30)))
    assert min(len(os.fsencode(f)) for f in files) == 4095
    results = pool.decode_many([(f, None) for f in files])
    assert [r.image.width if r.image else r.error for r in results] == [40 + n for n in range(64)]


def test_a_recycle_on_the_last_file_of_a_request_leaves_a_working_slot(
        balloon_pool: DecodePool, tmp_path: Path) -> None:
    files = [make_image(tmp_path / n) for n in ("one.png", "two.png", "balloon.png")]
    replaced = balloon_pool.replaced
    results = balloon_pool.decode_many([(f, None) for f in files])
    assert results[0].image is not None and results[1].image is not None
    assert "more memory than" in str(results[2].error)
    assert balloon_pool.replaced == replaced + 1
    still_works(balloon_pool, tmp_path)


def test_a_close_between_the_check_and_the_wait_for_a_worker_ends_the_call() -> None:
    """decode() checks that the pool is open, then waits for a free worker; a close() in
    between took every idle worker away, and the call waited for ever (holding up the
    interpreter's exit). The close is forced into that window."""
    import queue
    import threading
    pool = DecodePool(1, settings())
    pool.start()

    class CloseFirst(queue.SimpleQueue):  # type: ignore[type-arg]
        def get(self, block: bool = True, timeout: float | None = None) -> object:
            pool.close()
            return super().get(block, timeout)

    slots = CloseFirst()
    while not pool._idle.empty():
        slots.put(pool._idle.get())
    pool._idle = slots
    raised: list[BaseException] = []

    def call() -> None:
        try:
            pool.decode(__file__)
        except TransientError as exc:
            raised.append(exc)

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    caller.join(20)
    assert not caller.is_alive(), "the call still waits for a worker"
    assert "shutting down" in str(raised[0])
