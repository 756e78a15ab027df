"""A daemon that serves ONNX Runtime from a valid cached artifact never loads torch.

torch is several hundred MB of resident libraries; a daemon that does not run it must not carry
it. The guarantee is checked where it can break: the import graph of the serving path (a module
that imports torch at its top, added by any change, fails the first test) and the real daemon
process after it served a photo (its modules and its mapped libraries).
"""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from inboxd.config import ModelConfig
from inboxd.models.device import usable_cores
from inboxd.models.onnx_model import OnnxModel, calls_and_threads, load_cached

from tests.conftest import REPO, drop, line_fields, read_json, wait_until, write_config

# Every module a daemon serving the built-in model on the CPU imports at start-up.
SERVING_PATH = ("inboxd.cli", "inboxd.service.runner", "inboxd.service.once",
                "inboxd.pipeline.wiring", "inboxd.models.engines.choice",
                "inboxd.models.onnx_model", "inboxd.models.runtime_record",
                "inboxd.decode.worker_child")


def test_the_serving_path_imports_no_torch() -> None:
    """A module-level ``import torch`` anywhere on the way (a new model kind, a type hint)
    would load it into every daemon: torch must be imported only where it runs."""
    check = (f"import sys\nimport {', '.join(SERVING_PATH)}\n"
             "loaded = sorted(m for m in sys.modules if m.split('.')[0] in "
             "('torch', 'torchvision'))\nprint(loaded[:5])\nsys.exit(1 if loaded else 0)\n")
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True,
                          cwd=REPO, timeout=120, check=False)
    assert done.returncode == 0, f"torch imported by the serving path: {done.stdout}{done.stderr}"


def test_without_an_artifact_torch_serves_and_says_why(tmp_path: Path) -> None:
    model, why = load_cached(ModelConfig(device="cpu", cache_dir=tmp_path))
    assert model is None and "not built yet" in why
    model, why = load_cached(ModelConfig(device="cpu", runtime="torch", cache_dir=tmp_path))
    assert model is None and "torch" in why


@pytest.mark.daemon
@pytest.mark.timeout(900)  # one real export first: 15 s on a quiet core, minutes on a busy one
@pytest.mark.slow  # a costly run: `make test`, not the fast tier
def test_a_daemon_serving_a_cached_artifact_has_no_torch(tmp_path: Path, daemon_factory) -> None:
    cache = tmp_path / "cache"
    config = write_config(tmp_path, model={"cache_dir": str(cache), "device": "cpu"})
    first = daemon_factory(config)
    started = line_fields(first.wait_for("started", 180)[0])
    assert started["RUNTIME_STATE"] == "building", started  # no artifact yet: torch serves
    first.wait_for("runtime", 600)  # exported, checked, swapped in
    assert first.stop() == 0

    daemon = daemon_factory(config)
    started = line_fields(daemon.wait_for("started", 180)[0])
    assert started["RUNTIME"] == "onnxruntime", started
    assert started["RUNTIME_ARTIFACT"] == "cached, served without torch", started
    assert started["TORCH_VERSION"] == "not loaded", started
    # A batch per core side by side where the default in_flight_batches allows it.
    assert started["RUNTIME_CALLS"] == str(calls_and_threads(usable_cores(), 4)[0]), started
    daemon.wait_for("ready")
    from support.photos import photo_paths

    drop(photo_paths()["chelsea"], tmp_path / "inbox", "cat.png")
    result_path = tmp_path / "results" / "cat.png.json"
    wait_until(result_path.exists, 60, "the result JSON")
    result = read_json(result_path)
    assert result["runtime"] == "onnxruntime"
    assert 281 <= result["top_k"][0]["index"] <= 285, result["top_k"][0]
    maps = Path(f"/proc/{daemon.proc.pid}/maps").read_text()
    assert "libtorch" not in maps, [line for line in maps.splitlines() if "torch" in line][:3]
    # Nor the onnx package: its import (ml_dtypes) would double such a start (onnx_wire).
    assert "onnx_cpp2py_export" not in maps and "ml_dtypes" not in maps
    assert daemon.stop() == 0

    # One batch out at a time: one call across every core, not a single-threaded one.
    one_call = write_config(tmp_path, model={"cache_dir": str(cache), "device": "cpu"},
                            capacity={"in_flight_batches": 1})
    daemon = daemon_factory(one_call)
    started = line_fields(daemon.wait_for("started", 180)[0])
    assert started["RUNTIME_ARTIFACT"] == "cached, served without torch", started
    assert started["RUNTIME_CALLS"] == "1", started
    assert daemon.stop() == 0


def test_a_host_runs_a_single_threaded_batch_per_core_where_the_bound_sends_one() -> None:
    """With the default capacity.in_flight_batches (4), a batch per core side by side on hosts
    of up to 4 cores, one batch across them all on more; one core, one call; and one call
    across every core for a caller that sends fewer calls than there are cores (a
    capacity.in_flight_batches of 1, a search query), not a single-threaded one."""
    assert calls_and_threads(2, 4) == (2, 1) and calls_and_threads(4, 4) == (4, 1)
    assert calls_and_threads(1, 4) == (1, 1) and calls_and_threads(16, 4) == (1, 16)
    assert calls_and_threads(2, 1) == (1, 2) and calls_and_threads(4, 3) == (1, 4)
    assert calls_and_threads(8, 8) == (8, 1)


@pytest.mark.slow  # a costly run: `make test`, not the fast tier
def test_the_cached_model_gives_the_torch_model_s_answers(tmp_path: Path) -> None:
    """The numpy batch path (normalise, softmax, top-k) against the torch model on one
    artifact: same labels in the same order, scores within float rounding."""
    from inboxd.models.fast_path import FastPath
    from inboxd.models.loading import load_model

    from support.photos import photo_paths

    config = ModelConfig(device="cpu", cache_dir=tmp_path)
    reference = load_model(config.model_copy(update={"runtime": "torch"}))
    fast = FastPath(load_model(config), config)
    fast.start()
    fast.join(900)
    cached, why = load_cached(config, calls_sent=4)
    assert isinstance(cached, OnnxModel), why
    from PIL import Image

    crops = [np.asarray(Image.open(path).convert("RGB").resize((224, 224)))
             for path in list(photo_paths().values())[:4]]
    # A batch per core side by side, each call single-threaded, on a small host: the engine's
    # threads are the session's parallelism (the started record says how many).
    calls, threads = calls_and_threads(usable_cores(), 4)
    assert cached.concurrent_calls == calls == cached.fields["RUNTIME_CALLS"]
    assert cached.session.get_session_options().intra_op_num_threads == threads
    alone = [p.top_k for p in cached.predict(crops)]
    with ThreadPoolExecutor(2) as side_by_side:
        together = list(side_by_side.map(cached.predict, [crops] * 6))
    assert all([p.top_k for p in answers] == alone for answers in together), (
        "calls side by side answer as one alone")
    for color in ("rgb", "bgr", "gray"):
        cached.color = color  # type: ignore[assignment]
        reference.color = color  # type: ignore[assignment]
        for mine, theirs in zip(cached.predict(crops), reference.predict(crops), strict=True):
            assert [e["index"] for e in mine.top_k] == [e["index"] for e in theirs.top_k]
            for a, b in zip(mine.top_k, theirs.top_k, strict=True):
                assert abs(a["score"] - b["score"]) <= 1e-4
