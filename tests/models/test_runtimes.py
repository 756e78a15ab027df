"""The fast CPU runtime: the choice (auto), the cached ONNX export, the background build and the
swap between batches, and the ``.onnx`` model source.

The exporter process and ONNX Runtime are the real ones; faked only at their boundaries: the
CPU's flags (a fake /proc/cpuinfo root), a GPU's compute capability, the version strings and
CPU identity the cache key is made of, and the exporter call where a build must fail.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from inboxd.config import ConfigError, ModelConfig
from inboxd.decode.pillow import decode_image
from inboxd.models import loading
from inboxd.models.fast_path import FastPath
from inboxd.models.loading import load_model
from inboxd.models.model import Classification, Model
from inboxd.models.onnx_export import ExportFailed, export_in_child
from inboxd.models.runtimes import onnx as onnx_runtime
from inboxd.models.runtimes import onnx_wire, serving_key
from inboxd.models.runtimes.agreement import SCORE_TOLERANCE, probe_images
from inboxd.models.runtimes.choice import choose, cpu_flags, native_bf16
from inboxd.models.runtimes.onnx_artifact import SERVING_METADATA

from support.photos import photo_paths
from tests.conftest import SHARED_MODEL_CACHE, shared_model_artifact

CPUINFO = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx2 avx512f {extra}\n"


def fake_root(tmp_path: Path, extra: str) -> Path:
    (tmp_path / "proc").mkdir(parents=True, exist_ok=True)
    (tmp_path / "proc" / "cpuinfo").write_text(CPUINFO.format(extra=extra))
    return tmp_path


def crops(model: Model) -> dict[str, np.ndarray]:
    return {name: decode_image(path.read_bytes(), model.spec, 89_478_485).pixels
            for name, path in photo_paths().items()}


def top1(predictions: list[Classification]) -> list[tuple[str, float]]:
    return [(p.top_k[0]["label"], float(p.top_k[0]["score"])) for p in predictions]


class Records(logging.Handler):
    """The inboxd records of one event, as the journal would get them."""

    def __init__(self, event: str) -> None:
        super().__init__()
        self.event = event
        self.seen: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "inboxd_event", None) == self.event:
            self.seen.append(record)

    def fields(self, index: int = -1) -> dict[str, Any]:
        found: dict[str, Any] = self.seen[index].inboxd_fields  # type: ignore[attr-defined]
        return found


@pytest.fixture
def runtime_records() -> Any:
    handler = Records("runtime")
    logger = logging.getLogger("inboxd")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


def builtin(cache_dir: Path, **keys: Any) -> tuple[Model, ModelConfig]:
    config = ModelConfig(device="cpu", cache_dir=cache_dir, **keys)
    return load_model(config), config


# -- the choice ---------------------------------------------------------------------------


def test_cpu_flags_are_read_from_cpuinfo_under_the_root_given(tmp_path: Path) -> None:
    root = fake_root(tmp_path, "avx512_bf16 amx_tile")
    assert {"avx512f", "avx512_bf16"} <= cpu_flags(root)
    assert native_bf16(cpu_flags(root)) == ["avx512_bf16"]
    assert cpu_flags(tmp_path / "nowhere") == frozenset()


@pytest.mark.parametrize("extra, native", [("avx512_bf16", True), ("amx_bf16", True),
                                           ("avx512_vnni", False)])
def test_precision_auto_on_the_cpu_with_and_without_native_bf16(
        tmp_path: Path, extra: str, native: bool) -> None:
    flags = cpu_flags(fake_root(tmp_path, extra))
    default = choose(ModelConfig(), "cpu", flags=flags, cpu_capability="AVX512")
    # onnxruntime fp32 either way: fast without bf16, and it agrees with torch fp32.
    assert (default.runtime, default.precision) == ("onnxruntime", "fp32")
    assert ("bf16 native" if native else "bf16 not native") in default.reason
    eager = choose(ModelConfig(runtime="torch"), "cpu", flags=flags, cpu_capability="AVX512")
    assert (eager.runtime, eager.precision) == ("torch", "bf16" if native else "fp32")
    assert eager.precision_by_auto


def test_explicit_yaml_wins_over_auto() -> None:
    flags = frozenset({"avx512_bf16"})
    chosen = choose(ModelConfig(precision="fp32", runtime="torch"), "cpu", flags=flags,
                    cpu_capability="AVX512")
    assert (chosen.runtime, chosen.precision, chosen.precision_by_auto) == ("torch", "fp32",
                                                                             False)
    bf16 = choose(ModelConfig(precision="bf16"), "cpu", flags=frozenset(), cpu_capability="x")
    assert (bf16.runtime, bf16.precision) == ("torch", "bf16")  # autocast: torch's
    compiled = choose(ModelConfig(compile=True), "cpu", flags=flags, cpu_capability="x")
    assert compiled.runtime == "torch"
    with pytest.raises(ConfigError, match="runtime: onnxruntime runs the exported network"):
        choose(ModelConfig(runtime="onnxruntime", precision="bf16"), "cpu", flags=flags,
               cpu_capability="x")


@pytest.mark.parametrize("capability, precision", [((9, 0), "bf16"), ((8, 0), "bf16"),
                                                   ((7, 5), "fp16"), ((7, 0), "fp16"),
                                                   ((6, 1), "fp32")])
def test_precision_auto_on_a_gpu_follows_its_compute_capability(
        capability: tuple[int, int], precision: str) -> None:
    """Faked at the capability boundary: no GPU here, so the choice is unmeasured on one."""
    chosen = choose(ModelConfig(), "cuda", flags=frozenset(), cpu_capability="x",
                    gpu_capability=capability)
    assert (chosen.runtime, chosen.precision) == ("torch", precision)
    assert f"compute capability {capability[0]}.{capability[1]}" in chosen.reason
    explicit = choose(ModelConfig(precision="fp32"), "cuda", flags=frozenset(),
                      cpu_capability="x", gpu_capability=capability)
    assert explicit.precision == "fp32"
    with pytest.raises(ConfigError, match="onnxruntime runs on the CPU only"):
        choose(ModelConfig(runtime="onnxruntime"), "cuda", flags=frozenset(),
               cpu_capability="x", gpu_capability=capability)


def test_fp16_stays_invalid_on_the_cpu(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="fp16 needs a CUDA GPU"):
        load_model(ModelConfig(precision="fp16", cache_dir=tmp_path))


@pytest.mark.slow  # the bf16 probe batch, emulated on a CPU without native bf16
def test_precision_auto_with_torch_tries_bf16_only_on_native_bf16(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With native bf16 the candidate is bf16, kept only if the probe batch agrees with fp32
    (the built-in model's bf16 misses the tolerance on it); without, fp32 and no attempt."""
    for extra, native in (("avx512_bf16", True), ("sse4_2", False)):
        root = fake_root(tmp_path / extra, extra)
        monkeypatch.setattr(loading, "cpu_flags", lambda root=root: cpu_flags(root))
        model, _ = builtin(tmp_path, runtime="torch")
        reason = model.choice.reason
        assert model.runtime == "torch"
        if native:
            assert "bf16 autocast (native on this CPU)" in reason
            assert "probe images" in reason  # the agreement was measured, and is reported
            agreed = "does not agree" not in reason
            assert model.precision == model.choice.precision == ("bf16" if agreed else "fp32")
        else:
            assert "bf16 would be emulated" in reason and "probe" not in reason
            assert model.precision == "fp32"


# -- the cache ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real export (the exporter process) of the built-in model, shared by the tests that
    only read the artifact: the one every test's daemons serve (``shared_model_artifact``, made
    by the same FastPath and exporter), copied into a cache of this module's own."""
    shared_model_artifact()
    cache_dir = tmp_path_factory.mktemp("cache")
    model, config = builtin(cache_dir)
    path = FastPath(model, config).path
    path.parent.mkdir(parents=True)
    shutil.copyfile(SHARED_MODEL_CACHE / "onnx" / path.name, path)
    return path


@pytest.mark.slow  # a second real export (the fast tier keeps the fixture's, swapped in too)
def test_the_swap_keeps_every_photo_within_the_contract(tmp_path: Path, exported: Path,
                                                        runtime_records: Records) -> None:
    """Built in the background, swapped in on the next batch: the same top-1 on every photo,
    its score within the contract."""
    cache_dir = tmp_path / "cache"
    model, config = builtin(cache_dir)
    fast = FastPath(model, config)
    fast.start()
    assert fast.state == "building"
    images = crops(model)
    before = top1(model.classify(list(images.values())))
    assert model.runtime == "torch"
    fast.join(900)
    fast.swap_if_built()
    assert (model.runtime, model.precision, fast.state) == ("onnxruntime", "fp32", "serving")
    after = top1(model.classify(list(images.values())))
    for name, (label, score), (fast_label, fast_score) in zip(images, before, after,
                                                              strict=True):
        assert fast_label == label, name
        assert abs(fast_score - score) <= SCORE_TOLERANCE, name
    assert len(runtime_records.seen) == 1
    assert runtime_records.fields()["RUNTIME_ARTIFACT"] == "exported"
    assert same_export(fast.path, exported)


def same_export(a: Path, b: Path) -> bool:
    """Two artifacts hold the same graph and the same metadata, save the probe's measured score
    difference: torch and ONNX Runtime agree to within float rounding, and where the last bits
    fall differs from one run to the next."""
    import json

    import onnx

    def comparable(path: Path) -> tuple[bytes, dict[str, Any]]:
        data = path.read_bytes()
        metadata: dict[str, Any] = dict(onnx_wire.metadata(data))
        serving = metadata.get(SERVING_METADATA)
        if serving is not None:
            fields = json.loads(serving)
            for measured in ("probe", "probe_fields"):
                fields.pop(measured, None)
            metadata[SERVING_METADATA] = fields
        return onnx.load_from_string(data).graph.SerializeToString(), metadata

    return comparable(a) == comparable(b)


@pytest.mark.slow  # a costly run: `make test`, not the fast tier
def test_a_cached_artifact_is_loaded_without_a_second_export(exported: Path) -> None:
    before = os.stat(exported)

    def no_export(*_: Any) -> None:
        raise AssertionError("exported again")

    model, config = builtin(exported.parent.parent)
    fast = FastPath(model, config, exporter=no_export)
    assert fast.path == exported
    fast.start()
    assert model.runtime == "torch"  # start-up waits for nothing
    fast.join(60)
    fast.swap_if_built()
    assert fast.state == "serving", fast.fields
    assert fast.fields["RUNTIME_ARTIFACT"] == "cached"
    assert model.runtime == "onnxruntime"
    after = os.stat(exported)
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def other_weights(model: Model) -> None:
    with torch.no_grad():
        next(model.network.parameters()).add_(1e-3)


@pytest.mark.parametrize("change", ["weights", "versions", "capability", "inboxd upgrade"])
def test_an_artifact_with_another_key_is_rebuilt_not_loaded(
        tmp_path: Path, exported: Path, change: str, monkeypatch: pytest.MonkeyPatch) -> None:
    cache_dir = tmp_path / "cache"
    (cache_dir / "onnx").mkdir(parents=True)
    model, config = builtin(cache_dir)
    fast = FastPath(model, config)
    (cache_dir / "onnx" / fast.path.name).write_bytes(exported.read_bytes())
    if change == "weights":
        other_weights(model)
    elif change == "versions":
        real = onnx_runtime.versions()
        monkeypatch.setattr(onnx_runtime, "versions", lambda: {**real, "torch": "2.99.0"})
    elif change == "capability":
        monkeypatch.setattr(onnx_runtime, "cpu_identity",
                            lambda: {"cpu_capability": "DEFAULT", "cpu_flags_sha256": "0"})
    else:  # the torch key still matches; the code behind the torch-free key does not
        monkeypatch.setattr(serving_key, "_NETWORK_CODE",
                            (*serving_key._NETWORK_CODE, "model.py"))
    exports: list[str] = []

    def exporter(_config: ModelConfig, path: Path, key: str) -> None:
        exports.append(key)
        raise ExportFailed("stopped here by the test")

    fast = FastPath(model, config, exporter=exporter)
    fast.start()
    fast.join(60)
    fast.swap_if_built()
    assert model.runtime == "torch"
    assert fast.fields["RUNTIME_REBUILD_REASON"] == (
        "its torch-free key is another inboxd's or another set of packages' (an upgrade)"
        if change == "inboxd upgrade" else "built for other weights, versions, input size or CPU")
    assert exports == [fast.key]
    assert fast.state == "failed"


@pytest.mark.parametrize("content", [b"", b"\x00garbage" * 1000, "truncated", "symlink"])
def test_a_corrupt_or_hostile_cache_file_is_rebuilt_and_never_crashes(
        tmp_path: Path, exported: Path, content: bytes | str) -> None:
    cache_dir = tmp_path / "cache"
    (cache_dir / "onnx").mkdir(parents=True)
    model, config = builtin(cache_dir)
    target = FastPath(model, config).path
    if content == "truncated":
        target.write_bytes(exported.read_bytes()[: exported.stat().st_size // 2])
    elif content == "symlink":
        target.symlink_to(exported)  # a valid artifact, but through a link: never followed
    else:
        assert isinstance(content, bytes)
        target.write_bytes(content)
    calls: list[Path] = []
    fast = FastPath(model, config, exporter=lambda _c, path, _k: calls.append(path))
    fast.start()
    fast.join(60)
    fast.swap_if_built()
    assert calls == [target]
    assert fast.state == "failed" and model.runtime == "torch"  # the fake wrote nothing
    assert fast.fields["RUNTIME_REBUILD_REASON"]


@pytest.mark.slow  # a costly run: `make test`, not the fast tier
def test_a_failing_build_logs_once_and_the_plain_model_keeps_serving(
        tmp_path: Path, runtime_records: Records) -> None:
    model, config = builtin(tmp_path / "cache")

    def exporter(*_: Any) -> None:
        raise ExportFailed("the exporter exited 1: torch._dynamo.exc.Unsupported: injected")

    fast = FastPath(model, config, exporter=exporter)
    fast.start()
    fast.join(60)
    images = list(crops(model).values())
    for _ in range(3):  # batches after the failure: nothing more is tried or logged
        fast.swap_if_built()
        assert len(model.classify(images)) == len(images)
    assert (fast.state, model.runtime) == ("failed", "torch")
    assert len(runtime_records.seen) == 1
    record = runtime_records.seen[0]
    assert record.levelno == logging.WARNING
    assert "injected" in runtime_records.fields()["RUNTIME_FAILURE"]


def test_a_runner_that_disagrees_is_not_swapped_in(tmp_path: Path, exported: Path,
                                                   runtime_records: Records,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """An artifact that loads and runs but computes something else (a hostile file with the
    right key, a broken runtime) is caught by the probe batch."""
    model, config = builtin(exported.parent.parent)
    forward = onnx_runtime.OnnxNetwork.forward
    monkeypatch.setattr(onnx_runtime.OnnxNetwork, "forward",
                        lambda self, batch: forward(self, batch.flip(1)))  # BGR for RGB
    fast = FastPath(model, config)
    fast.start()
    fast.join(60)
    fast.swap_if_built()
    assert (fast.state, model.runtime) == ("failed", "torch")
    assert "does not agree" in runtime_records.fields()["RUNTIME_FAILURE"]


@pytest.mark.slow  # a real export of a ResNet-18 program
def test_a_pt2_program_gets_the_same_fast_path(tmp_path: Path) -> None:
    """Bring-your-own: a torch.export program is exported by the real exporter process (which
    rebuilds it from the config), checked and swapped in like the built-in model."""
    from tests.byo_models import NUM_CLASSES, export, resnet18

    program = export(resnet18(), tmp_path / "net.pt2")
    labels = tmp_path / "labels.txt"
    labels.write_text("\n".join(f"class {i}" for i in range(NUM_CLASSES)))
    config = ModelConfig(export=program, labels=labels, cache_dir=tmp_path / "cache")
    model = load_model(config)
    images = list(crops(model).values())
    before = model.outputs(images)
    fast = FastPath(model, config)
    fast.start()
    fast.join(900)
    fast.swap_if_built()
    assert (fast.state, model.runtime) == ("serving", "onnxruntime"), fast.fields
    assert torch.allclose(model.outputs(images), before, atol=1e-4, rtol=1e-4)


@pytest.mark.slow  # a costly run: `make test`, not the fast tier
def test_the_exporter_process_reports_why_it_failed(tmp_path: Path) -> None:
    config = ModelConfig(device="cpu", cache_dir=tmp_path)
    with pytest.raises(ExportFailed, match="not the daemon's"):
        export_in_child(config, tmp_path / "x.onnx", "another key")
    assert not (tmp_path / "x.onnx").exists()


def test_probe_images_are_the_same_every_time() -> None:
    first, second = probe_images(32), probe_images(32)
    assert all(np.array_equal(a, b) for a, b in zip(first, second, strict=True))
    assert len({image.tobytes() for image in first}) == len(first)


# -- an .onnx model -----------------------------------------------------------------------


def onnx_file(network: torch.nn.Module, path: Path) -> Path:
    example = torch.randn(2, 3, 224, 224)
    shapes = ({0: torch.export.Dim("batch", min=1, max=64)},)
    program = torch.onnx.export(network, (example,), dynamo=True, dynamic_shapes=shapes,
                                verbose=False)
    assert program is not None
    program.save(str(path))
    return path


@pytest.mark.slow  # a costly run: `make test`, not the fast tier
def test_an_onnx_model_is_checked_and_runs_like_its_torch_network(tmp_path: Path) -> None:
    from tests.byo_models import NUM_CLASSES, resnet18

    network = resnet18()
    path = onnx_file(network, tmp_path / "net.onnx")
    labels = tmp_path / "labels.txt"
    labels.write_text("\n".join(f"class {i}" for i in range(NUM_CLASSES)))
    model = load_model(ModelConfig(onnx=path, labels=labels, cache_dir=tmp_path))
    assert (model.runtime, model.precision, model.info and model.info.kind) == (
        "onnxruntime", "fp32", "onnx")
    images = list(crops(model).values())
    got = model.outputs(images)
    inputs = model.to_input(images)
    with torch.inference_mode():
        want = network(inputs)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
    with pytest.raises(ConfigError, match="has 3 labels but the program has 10 outputs"):
        labels.write_text("a\nb\nc\n")
        load_model(ModelConfig(onnx=path, labels=labels, cache_dir=tmp_path))


def test_an_onnx_model_that_cannot_work_is_a_config_error(tmp_path: Path) -> None:
    from tests.byo_models import onnx_fixed_batch

    fixed = onnx_fixed_batch(tmp_path / "fixed.onnx", 2)
    with pytest.raises(ConfigError, match="exported for a fixed batch of 2"):
        load_model(ModelConfig(onnx=fixed, cache_dir=tmp_path))
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"not a model")
    with pytest.raises(ConfigError, match="cannot be loaded by onnxruntime"):
        load_model(ModelConfig(onnx=junk, cache_dir=tmp_path))
    with pytest.raises(ConfigError, match="no such file"):
        load_model(ModelConfig(onnx=tmp_path / "missing.onnx", cache_dir=tmp_path))
    with pytest.raises(ConfigError, match="onnx: models run in onnxruntime on the CPU"):
        loading.check_device(ModelConfig(onnx=fixed), torch.device("cuda"), "fp32")
