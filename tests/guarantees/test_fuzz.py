"""The decoder fuzzer: seeded mutations of real images (tests/guarantees/fuzzing.py) through the
real decode path, the worker pool with the shipped limits. Every case ends as a decoded crop or
a file-level error with a reason; the pool never dies; worker memory stays under its limit.

CI runs a fixed seed and a bounded count (``INBOXD_FUZZ_CASES``, default 5,000: ~20 s on a busy
2-core machine); ``make fuzz`` runs 20,000 and keeps every crasher (a worker death, a timeout,
an exception type the worker had to catch for Pillow) in ``INBOXD_FUZZ_SAVE``. Kept crashers live
in tests/guarantees/crashers/ and are replayed here and in test_decode_isolation.py.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from inboxd.config import PreprocessConfig
from inboxd.decode.pool import DecodePool
from inboxd.decode.replies import DecodeResult
from inboxd.decode.worker_process import WorkerSettings
from inboxd.item import PermanentError

from tests.conftest import make_image, read_json, write_config
from tests.decode.test_pool import SPEC
from tests.guarantees.fuzzing import case, seeds

SEED = int(os.environ.get("INBOXD_FUZZ_SEED", "20261201"))
CASES = int(os.environ.get("INBOXD_FUZZ_CASES", "5000"))
SAVE = os.environ.get("INBOXD_FUZZ_SAVE")
CRASHERS = Path(__file__).parent / "crashers"
TIMEOUT_S = 10.0  # a fuzz case this slow is a finding; the shipped 30 s would stall CI
# What a reason says happened. The first three are findings worth keeping as regression files;
# hitting the memory limit is the limit working (a header that asks for a lot, legitimately).
CATEGORIES = (("the decoder crashed", "crash"), ("longer than preprocess.decode_timeout_s",
              "timeout"), ("the decoder failed on this file", "unexpected exception"),
              ("more memory than preprocess.decode_memory_mb", "memory limit"))


def real_pool(workers: int = 2) -> DecodePool:
    """The shipped limits and resize mode (preprocess defaults) and the built-in model's resize
    and crop."""
    pre = PreprocessConfig()
    spec = dataclasses.replace(SPEC, resize_mode=pre.resize)
    return DecodePool(workers, WorkerSettings(spec, pre.max_image_pixels, pre.max_file_mb << 20,
                                              pre.decode_memory_mb << 20, TIMEOUT_S))


def category(result: DecodeResult) -> str:
    if result.error is None:
        assert result.image is not None and result.image.pixels.shape == (224, 224, 3)
        return "decoded"
    reason = str(result.error)
    assert reason, "every failure says why"
    for prefix, name in CATEGORIES:
        if prefix in reason:
            return name
    return "refused" if isinstance(result.error, PermanentError) else "transient"


def test_seeded_mutations_each_end_as_an_image_or_a_reason(tmp_path: Path) -> None:
    pool = real_pool()
    outcomes: Counter[str] = Counter()
    peak_rss_bytes = 0
    found: list[tuple[str, str, bytes]] = []

    def one(n: int) -> tuple[str, bytes, DecodeResult]:
        name, data = case(SEED, n)
        path = tmp_path / name
        path.write_bytes(data)
        try:
            return name, data, pool.decode(path)  # raising here would be the pool dying
        finally:
            path.unlink()

    started = time.monotonic()
    try:
        with ThreadPoolExecutor(pool.workers) as threads:
            for name, data, result in threads.map(one, range(CASES)):
                kind = category(result)
                outcomes[kind] += 1
                peak_rss_bytes = max(peak_rss_bytes, result.peak_rss_bytes)
                if kind in ("crash", "timeout", "unexpected exception"):
                    found.append((kind, name, data))
    finally:
        pool.close()
    elapsed_s = time.monotonic() - started
    print(f"\nfuzz seed={SEED} cases={CASES} in {elapsed_s:.1f} s ({CASES / elapsed_s:.0f}/s), "
          f"{len(seeds())} seed images: {dict(sorted(outcomes.items()))}, worker peak RSS "
          f"{peak_rss_bytes / 2**20:.0f} MiB, workers replaced {pool.replaced}")
    for kind, name, _ in found:
        print(f"  {kind}: {name}")
    if SAVE:  # new finds only: the same bytes kept under another name are not added again
        Path(SAVE).mkdir(parents=True, exist_ok=True)
        kept = {p.read_bytes() for p in Path(SAVE).iterdir() if p.is_file()}
        for kind, name, data in found:
            if data not in kept:
                Path(SAVE, f"{kind.replace(' ', '-')}-seed{SEED}-{name}").write_bytes(data)
    assert sum(outcomes.values()) == CASES
    assert outcomes["decoded"] > CASES // 10, "the mutations must leave some images decodable"
    assert peak_rss_bytes < (PreprocessConfig().decode_memory_mb + 256) << 20


def test_kept_crashers_fail_alone_and_the_pool_carries_on(tmp_path: Path) -> None:
    pool = real_pool(workers=1)
    try:
        for crasher in sorted(CRASHERS.iterdir()):
            result = pool.decode(crasher)
            assert isinstance(result.error, PermanentError), crasher.name
            assert str(result.error), crasher.name
        good = pool.decode(make_image(tmp_path / "good.png", size=(300, 200)))
        assert good.image is not None
    finally:
        pool.close()


@pytest.mark.daemon
@pytest.mark.slow
def test_fuzzed_files_in_the_real_daemon_each_get_one_outcome(tmp_path: Path) -> None:
    config = write_config(tmp_path, inbox={"include": ["*"], "settle_ms": 0},
                          preprocess={"decode_timeout_s": TIMEOUT_S})
    names = []
    for n in range(150):
        name, data = case(SEED + 1, n)
        (tmp_path / "inbox" / name).write_bytes(data)
        names.append(name)
    done = subprocess.run([sys.executable, "-m", "inboxd", "once", "-c", str(config)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert done.returncode in (0, 1), done.stderr  # never 70: no stage crashed
    for name in names:
        result = (tmp_path / "results" / f"{name}.json").exists()
        failed = (tmp_path / "failed" / f"{name}.error.json")
        assert result != failed.exists(), f"{name}: exactly one outcome"
        if failed.exists():
            assert read_json(failed)["reason"]
    assert not [p for p in (tmp_path / "inbox").iterdir() if p.is_file()], "nothing left behind"
