"""The decode pool against workers that break the multi-file protocol (a scripted stand-in,
``tests/decode/scripted_worker.py``): more replies than files, fewer, a receipt that is
garbage, one legitimately slow file after another. Whatever a worker sends, no file gets
another file's result, and each misbehaviour costs at most the file it happened on."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from inboxd.decode.pool import DecodePool
from inboxd.decode.replies import DecodeTimedOut
from inboxd.item import TransientError

from tests.decode.scripted_worker import MODE_ENV
from tests.decode.test_pool import settings

SCRIPT = Path(__file__).with_name("scripted_worker.py")
ROOT = Path(__file__).resolve().parents[2]


def scripted_pool(monkeypatch: pytest.MonkeyPatch, mode: str, workers: int = 1,
                  timeout_s: float = 20.0) -> DecodePool:
    real_popen = subprocess.Popen

    def popen(args: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        assert args[1:] == ["-m", "inboxd.decode.worker_child"], args
        env = {**kwargs.pop("env"), MODE_ENV: mode}
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
        return real_popen([sys.executable, str(SCRIPT)], env=env, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", popen)
    return DecodePool(workers, settings(decode_timeout_s=timeout_s))


@pytest.fixture
def paths(tmp_path: Path) -> list[Path]:
    return [tmp_path / f"f{i}.png" for i in range(4)]


def own(results: list[Any], paths: list[Path]) -> list[bool]:
    """Which results carry their own file's mark (the scripted worker's sha256)."""
    return [r.error is None and r.sha256 == os.fsencode(p).hex()
            for r, p in zip(results, paths, strict=True)]


@pytest.fixture
def closing() -> Iterator[list[DecodePool]]:
    pools: list[DecodePool] = []
    yield pools
    for pool in pools:
        pool.close()


@pytest.mark.parametrize("mode", ["extra_ack", "extra_reply"])
def test_a_frame_more_than_asked_for_never_shifts_results_onto_other_files(
        monkeypatch: pytest.MonkeyPatch, paths: list[Path], closing: list[DecodePool],
        mode: str) -> None:
    """The stray frame waits in the reader's buffer (or the pipe) for the next request: read
    as that request's receipt or first reply, it would give every file the one before it."""
    pool = scripted_pool(monkeypatch, mode)
    closing.append(pool)
    first = pool.decode_many([(p, None) for p in paths])
    assert all(own(first, paths)), first
    second = pool.decode_many([(p, None) for p in paths])
    for result, path in zip(second, paths, strict=True):
        # A file may fail (the worker broke the protocol), never wear another file's result.
        assert result.error is not None or result.sha256 == os.fsencode(path).hex(), second
    assert own(second, paths).count(False) <= 1, f"more than one file paid: {second}"
    third = pool.decode_many([(p, None) for p in paths])
    assert all(own(third, paths)), "the misbehaving worker was replaced"


def test_a_reply_that_never_comes_costs_only_that_file(
        monkeypatch: pytest.MonkeyPatch, paths: list[Path], closing: list[DecodePool]) -> None:
    pool = scripted_pool(monkeypatch, "fewer", timeout_s=1.0)
    closing.append(pool)
    results = pool.decode_many([(p, None) for p in paths])
    assert own(results, paths) == [True, True, True, False]
    assert isinstance(results[3].error, DecodeTimedOut)  # transient the first time
    assert "decode_timeout_s" in str(results[3].error)


@pytest.mark.parametrize("mode", ["garbage_ack", "ack_not_true"])
def test_a_garbage_receipt_costs_no_file_its_own_result(
        monkeypatch: pytest.MonkeyPatch, paths: list[Path], closing: list[DecodePool],
        mode: str) -> None:
    """A receipt that is not one: the worker is replaced, the files tried once more, then
    every file is tried again later (a TransientError, never a PermanentError)."""
    pool = scripted_pool(monkeypatch, mode)
    closing.append(pool)
    with pytest.raises(TransientError):
        pool.decode_many([(p, None) for p in paths])
    assert pool.replaced >= 2


def test_decode_timeout_s_is_per_file_not_per_request(
        monkeypatch: pytest.MonkeyPatch, paths: list[Path], closing: list[DecodePool]) -> None:
    """Four files of 0.6 s each under a 1 s limit: 2.4 s for the request, none over."""
    pool = scripted_pool(monkeypatch, "slow:0.6", timeout_s=1.0)
    closing.append(pool)
    pool.decode_many([(paths[0], None)])  # started and ready
    started = time.monotonic()
    results = pool.decode_many([(p, None) for p in paths])
    assert time.monotonic() - started > 2.0
    assert all(own(results, paths)), results


def test_the_same_path_twice_in_one_request_is_answered_twice_in_order(
        monkeypatch: pytest.MonkeyPatch, paths: list[Path], closing: list[DecodePool]) -> None:
    pool = scripted_pool(monkeypatch, "")
    closing.append(pool)
    twice = [paths[0], paths[1], paths[0]]
    assert all(own(pool.decode_many([(p, None) for p in twice]), twice))


@pytest.mark.parametrize("mode", ["infinity", "small_crop", "short_identity"])
def test_a_reply_with_impossible_values_fails_only_its_file(
        monkeypatch: pytest.MonkeyPatch, paths: list[Path], closing: list[DecodePool],
        mode: str) -> None:
    """JSON's ``Infinity`` where a number goes (``int()`` raises OverflowError, which escaped
    the pool and crashed the decoding stage), and a crop that is not ``crop``×``crop``×3 (it
    would fail the whole batch on the model, costing the other files in it), and a file
    identity too short to unpack (IndexError, which the pool did not catch)."""
    pool = scripted_pool(monkeypatch, mode)
    closing.append(pool)
    results = pool.decode_many([(p, None) for p in paths])
    assert own(results, paths) == [True, False, True, True], results
    assert "malformed reply" in str(results[1].error)
