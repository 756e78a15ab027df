"""Bring your own model: torchvision architectures with local weights, torch.export programs,
classify and embed outputs, per-model preprocessing, and every bad model config as exit 78.

The models are made by the tests (seeded, untrained, ``weights=None``: nothing is downloaded)
and run through the real pipeline on real photos; each output is compared with the same network
called directly on the same decoded pixels. The built-in model's logits are checked against
timm's TF EfficientNet-Lite0 in ``test_efficientnet_lite.py``, not repeated here.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import pytest
import torch
import torchvision
import yaml
from inboxd import cli
from inboxd.config import ConfigError, ModelConfig, parse_config
from inboxd.decode.pillow import decode_image
from inboxd.decode.spec import TORCHVISION_INPUT, PreprocessSpec
from inboxd.exit_codes import EX_CONFIG
from inboxd.models.efficientnet_lite import EMBEDDING_DIM, load_efficientnet_lite0
from inboxd.models.loading import load_model, strip_classifier
from inboxd.models.model import Color, Model
from inboxd.models.preflight import read_labels
from inboxd.models.sources import Source, last_linear
from PIL import Image
from torch import nn

from support.photos import photo_paths
from tests.byo_models import (
    NUM_CLASSES,
    TOLERANCE,
    call,
    export,
    reference_input,
    resnet18,
    result,
    run_pipeline,
    scores_by_index,
    softmax,
    vector,
)
from tests.conftest import REPO, make_image, run_interleaved, write_config

PHOTOS = ("chelsea", "rocket", "camera")  # PNG and JPEG, RGB and greyscale, three sizes


@pytest.fixture(scope="module")
def photos() -> dict[str, Path]:
    found = photo_paths()
    assert set(PHOTOS) <= set(found), sorted(found)
    return {name: found[name] for name in PHOTOS}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The seeded resnet18's state_dict, its labels, and programs exported from it."""
    root = tmp_path_factory.mktemp("models")
    network = resnet18()
    torch.save(network.state_dict(), root / "resnet18.pth")
    (root / "labels.json").write_text(json.dumps([f"class {i}" for i in range(NUM_CLASSES)]))
    (root / "labels9.txt").write_text("\n".join(f"c{i}" for i in range(9)) + "\n")
    export(network, root / "resnet18.pt2", max_batch=16)
    return {"dir": root, "weights": root / "resnet18.pth", "labels": root / "labels.json",
            "labels9": root / "labels9.txt", "program": root / "resnet18.pt2"}


def torchvision_section(files: dict[str, Path], **extra: Any) -> dict[str, Any]:
    return {"torchvision": "resnet18", "weights": str(files["weights"]),
            "labels": str(files["labels"]), "device": "cpu", **extra}


# -- config ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "expected"), [
    ("model:\n  name: efficientnet_lite0\n  weights: w.pth\n",
     "line 3: model.weights: Value error, weights only applies to torchvision: models"),
    ("model:\n  torchvision: resnet18\n  top_k: 3\n",
     "line 1: model: Value error, torchvision: needs weights: PATH"),
    ("model:\n  torchvision: resnet18\n  export: a.pt2\n",
     "line 3: model.export: Value error, export is a model of its own"),
    ("model:\n  export: a.pt2\n  num_classes: 3\n",
     "line 3: model.num_classes: Value error, num_classes only applies to torchvision"),
    ("model:\n  labels: l.txt\n", "line 2: model.labels: Value error, the built-in model uses"),
    ("model:\n  device: cpu\n  precision: fp16\n",
     "line 3: model.precision: Value error, fp16 needs a CUDA GPU"),
    ("model:\n  input:\n    mean: [123.7, 116.3, 103.5]\n",
     "line 3: model.input.mean: Value error, mean is on the 0-1 scale"),
    ("model:\n  input:\n    resize: 200\n    crop: 224\n",
     "line 2: model.input: Value error, crop (224) must not be larger than resize (200)"),
    ("model:\n  input:\n    colour: rgb\n", "line 3: model.input.colour: Extra inputs"),
    ("model:\n  output: vectors\n",
     "line 2: model.output: Input should be 'classify', 'embed' or 'detect'"),
])
def test_model_config_errors_name_their_yaml_line(text: str, expected: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(text, "x.yaml")
    assert any(expected in p for p in caught.value.problems), caught.value.problems


def test_model_paths_resolve_against_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    config = parse_config("model:\n  torchvision: resnet18\n  weights: m/w.pth\n", "x").model
    assert config.weights == tmp_path / "m" / "w.pth"
    assert config.kind == "torchvision"
    assert ModelConfig().kind == "builtin"  # `name: efficientnet_lite0` or nothing


def test_labels_files_in_every_accepted_form(tmp_path: Path) -> None:
    text = tmp_path / "l.txt"
    text.write_text("cat\n\n  dog \nrabbit")
    listed = tmp_path / "l.json"
    listed.write_text('["cat", "dog", "rabbit"]')
    mapped = tmp_path / "m.json"
    mapped.write_text('{"1": "dog", "0": "cat", "2": "rabbit"}')
    for path in (text, listed, mapped):
        assert read_labels(path) == ["cat", "dog", "rabbit"], path
    gapped = tmp_path / "g.json"
    gapped.write_text('{"0": "cat", "2": "rabbit"}')
    with pytest.raises(ConfigError, match=r"must be 0\.\.n-1"):
        read_labels(gapped)


# -- torchvision + state_dict, through the pipeline ----------------------------------------


def test_torchvision_classifier_through_the_pipeline_matches_the_network_called_directly(
    tmp_path: Path, files: dict[str, Path], photos: dict[str, Path]
) -> None:
    model_section = torchvision_section(files, top_k=NUM_CLASSES)
    _, model = run_pipeline(tmp_path, photos, model_section,
                            batch={"max_size": 2, "max_delay_ms": 50})
    assert model.spec == TORCHVISION_INPUT  # torchvision's defaults when input: is unset
    reference = resnet18()
    reference.load_state_dict(torch.load(files["weights"], weights_only=True))
    for name, path in photos.items():
        document = result(tmp_path, name, path)
        assert document["model"] == "resnet18"
        expected = softmax(call(reference, reference_input(path, model.spec)))
        got = scores_by_index(document, NUM_CLASSES)
        assert np.abs(got - expected).max() <= TOLERANCE, name
        assert document["top_k"][0]["label"] == f"class {int(expected.argmax())}"


def test_torchvision_defaults_are_torchvisions_own_transforms(photos: dict[str, Path]) -> None:
    """inboxd's decode with the torchvision defaults gives the tensor torchvision's
    ImageClassification-style transforms give (both resize with Pillow)."""
    from torchvision import transforms

    recipe = transforms.Compose([
        transforms.Resize(256, interpolation=transforms.InterpolationMode.BILINEAR),
        transforms.CenterCrop(224), transforms.ToTensor(),
        transforms.Normalize(TORCHVISION_INPUT.mean, TORCHVISION_INPUT.std),
    ])
    for name, path in photos.items():
        with Image.open(path) as image:
            expected = recipe(image.convert("RGB")).unsqueeze(0)
        got = reference_input(path, TORCHVISION_INPUT)
        assert float((got - expected).abs().max()) < 1e-5, name


def test_embed_writes_the_pooled_features_as_npy(
    tmp_path: Path, files: dict[str, Path], photos: dict[str, Path]
) -> None:
    # torchvision's own pixels: the fast path's crop-window resize is the same to rounding,
    # and rounding moves features by more than TOLERANCE (the decode is not what is tested).
    run_pipeline(tmp_path, photos, torchvision_section(files, output="embed"),
                 preprocess={"resize": "exact"})
    reference = resnet18()
    reference.load_state_dict(torch.load(files["weights"], weights_only=True))
    backbone = nn.Sequential(*list(reference.children())[:-1], nn.Flatten())  # all but fc
    for name, path in photos.items():
        got = vector(tmp_path, name, path)
        expected = call(backbone, reference_input(path, TORCHVISION_INPUT))
        assert got.dtype == np.float32 and got.shape == (512,)
        np.testing.assert_allclose(got, expected, rtol=TOLERANCE, atol=TOLERANCE)
        embedding = result(tmp_path, name, path)["embedding"]
        assert embedding == {"file": f"{name}{path.suffix}.npy", "dim": 512,
                             "norm": pytest.approx(float(np.linalg.norm(got)), abs=1e-5),
                             "dtype": "float32"}
        assert "top_k" not in result(tmp_path, name, path)
    assert not list((tmp_path / "results").glob(".tmp/*/*")), "no temp file left behind"


@pytest.mark.slow  # a costly run: `make test`, not the fast tier
def test_builtin_embed_is_the_efficientnet_features(photos: dict[str, Path]) -> None:
    """(The pipeline writes the built-in's vectors in the README example test.)"""
    model = load_model(ModelConfig(output="embed", device="cpu"))
    network = load_efficientnet_lite0()
    paths = list(photos.values())
    got = model.embed([decode_image(p.read_bytes(), model.spec, 10**8).pixels for p in paths])
    for path, embedding in zip(paths, got, strict=True):
        with torch.inference_mode():
            expected = network.features(reference_input(path, model.spec)).numpy()[0]
        assert embedding.dim == EMBEDDING_DIM
        np.testing.assert_allclose(embedding.vector, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", [
    "resnet18", "mobilenet_v3_small", "efficientnet_b0", "convnext_tiny", "vit_b_16", "swin_t",
    "densenet121", "inception_v3",
])
def test_embed_finds_the_pooled_features_across_families(name: str) -> None:
    """On the meta device (shapes only, no memory, no time): replacing the last Linear layer
    leaves a network whose output is that layer's input, for each family."""
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        network = torchvision.models.get_model(name, weights=None, num_classes=7).eval()
        head = last_linear(network)
        assert head is not None
        dim = strip_classifier(Source(name, network, TORCHVISION_INPUT, "", 7))
        size = 299 if name == "inception_v3" else 224
        assert tuple(network(torch.empty(2, 3, size, size)).shape) == (2, dim)


def test_colour_modes_convert_on_the_device_as_pillow_would() -> None:
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (6, 5, 3), dtype=np.uint8)
    spec = TORCHVISION_INPUT
    inputs = {}
    colors: tuple[Color, ...] = ("rgb", "bgr", "gray")
    for color in colors:
        model = Model("identity", nn.Identity(), spec, None, torch.device("cpu"), "fp32", 1,
                      output="embed", color=color)
        inputs[color] = model.to_input([pixels])[0]
    std = torch.tensor(spec.std).view(3, 1, 1) * 255
    mean = torch.tensor(spec.mean).view(3, 1, 1) * 255
    raw = {color: (x * std + mean).round() for color, x in inputs.items()}
    assert torch.equal(raw["bgr"], raw["rgb"].flip(0))
    luma = np.asarray(Image.fromarray(pixels).convert("L"), dtype=np.float32)
    for channel in raw["gray"]:
        assert torch.equal(channel, torch.from_numpy(luma))


def test_cpu_batches_reuse_their_host_buffers_and_give_the_same_bits() -> None:
    """On the CPU a batch is stacked and normalised into buffers each thread keeps
    (``models/host_buffers.py`` says why): the outputs are those of fresh tensors, bit for bit, for
    every colour mode and batch size, the buffers are not made again for a smaller batch, and
    two threads taking turns every microsecond each keep their own."""
    spec = PreprocessSpec(16, 16, "bilinear", TORCHVISION_INPUT.mean, TORCHVISION_INPUT.std)
    torch.manual_seed(0)
    network = nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten()).eval()
    rng = np.random.default_rng(1)

    def batch(count: int) -> list[npt.NDArray[np.uint8]]:
        return [rng.integers(0, 256, (16, 16, 3), dtype=np.uint8) for _ in range(count)]

    def fresh(model: Model, images: list[npt.NDArray[np.uint8]]) -> torch.Tensor:
        with torch.inference_mode():
            return network(model.to_input(images))

    colors: tuple[Color, ...] = ("rgb", "bgr", "gray")
    for color in colors:
        model = Model("conv", network, spec, None, torch.device("cpu"), "fp32", 1,
                      output="embed", color=color)
        for count in (3, 64, 5, 64, 1):
            images = batch(count)
            assert torch.equal(model.outputs(images), fresh(model, images)), (color, count)
        staged = model._staging.inputs
        assert staged is not None and model.outputs(batch(7)) is not None
        assert model._staging.inputs is staged  # reused, not made again

    model = Model("conv", network, spec, None, torch.device("cpu"), "fp32", 1, output="embed")
    work = [[batch(count) for count in (64, 9, 33) * 10] for _ in range(2)]
    expected = [[fresh(model, images) for images in thread] for thread in work]
    wrong: list[str] = []

    def run(index: int) -> None:
        try:
            for images, want in zip(work[index], expected[index], strict=True):
                if not torch.equal(model.outputs(images), want):
                    wrong.append(f"thread {index}: other outputs")
        except Exception as exc:  # a buffer resized under the other thread's feet
            wrong.append(f"thread {index}: {exc!r}")

    run_interleaved([lambda: run(0), lambda: run(1)])
    assert not wrong, wrong[:3]


# -- torch.export programs ------------------------------------------------------------------


# Batches of one (a model call per photo) only in the full suite: the full batch shows the same.
@pytest.mark.parametrize("max_size", [pytest.param(1, marks=pytest.mark.slow), len(PHOTOS)])
def test_export_program_matches_the_program_called_directly(
    tmp_path: Path, files: dict[str, Path], photos: dict[str, Path], max_size: int
) -> None:
    """Batches of exactly ``max_size``: a full batch closes at once, the long delay never
    splits one."""
    section = {"export": str(files["program"]), "labels": str(files["labels"]),
               "top_k": NUM_CLASSES, "device": "cpu"}
    pipeline, model = run_pipeline(tmp_path, photos, section,
                                   batch={"max_size": max_size, "max_delay_ms": 10_000})
    assert set(pipeline.batcher.sizes.samples) == {max_size}
    assert model.info is not None and model.info.max_batch == 16
    program = torch.export.load(files["program"]).module()
    for name, path in photos.items():
        expected = softmax(call(program, reference_input(path, model.spec)))
        got = scores_by_index(result(tmp_path, name, path), NUM_CLASSES)
        assert np.abs(got - expected).max() <= TOLERANCE, name
    # The program's batch bound (Dim max=16) against a larger batch.max_size: exit 78 at start.
    with pytest.raises(ConfigError, match=r"at most 16 images, but batch\.max_size is 32"):
        model.warm_up_sizes(32)


# -- bad model configs ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def bad_files(files: dict[str, Path]) -> dict[str, Path]:
    root = files["dir"]
    network = resnet18()
    torch.save(network, root / "whole-model.pth")  # pickled: needs weights_only=False
    torch.save({"epoch": 3, "state_dict": network.state_dict()}, root / "checkpoint.pth")
    torch.save({f"module.{k}": v for k, v in network.state_dict().items()}, root / "ddp.pth")
    static = torch.export.export(network, (torch.randn(1, 3, 224, 224),))  # no dynamic batch
    torch.export.save(static, root / "static.pt2")
    return {"whole": root / "whole-model.pth", "checkpoint": root / "checkpoint.pth",
            "ddp": root / "ddp.pth", "static": root / "static.pt2"}


BAD: dict[str, tuple[dict[str, Any], str]] = {
    "wrong shapes": ({"num_classes": 1000, "labels": None},
                     r"fc\.weight is \[10, 512\] in the file but \[1000, 512\] in the model.*"
                     r"The file has 10 classes: set num_classes"),
    "missing file": ({"weights": "/nonexistent/w.pth"},
                     r"cannot read /nonexistent/w\.pth: no such file \(inboxd never downloads"),
    "needs weights_only=False": ({"weights": "whole"},
                                 r"holds a pickled torchvision\.models\.resnet\.ResNet.*"
                                 r"torch\.save\(model\.state_dict\(\), PATH\)"),
    "training checkpoint": ({"weights": "checkpoint"},
                            r"training checkpoint with the weights under 'state_dict'"),
    "DataParallel keys": ({"weights": "ddp"}, r"save model\.module\.state_dict\(\) instead"),
    "unknown torchvision name": ({"torchvision": "resnet19"},
                                r"unknown architecture 'resnet19'; did you mean resnet18"),
    "labels count": ({"labels": "labels9", "num_classes": 10},
                     r"has 9 labels but the model \(num_classes: 10\) has 10 outputs"),
    "no labels for 10 classes": ({"labels": None, "num_classes": 10},
                                 r"the model has 10 classes: give labels: PATH"),
    "fixed-batch program": ({"export": "static", "torchvision": None, "weights": None},
                            r"exported for a fixed batch of 1.*torch\.export\.Dim"),
    "program input size": ({"export": "program", "torchvision": None, "weights": None,
                            "input": {"resize": 200, "crop": 192}},
                           r"takes 224×224 images but the crop is 192"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_model_config_is_a_clear_config_error(
    case: str, files: dict[str, Path], bad_files: dict[str, Path]
) -> None:
    changes, message = BAD[case]
    section: dict[str, Any] = torchvision_section(files)
    named = {**files, **bad_files}
    for key, value in changes.items():
        section[key] = str(named[value]) if isinstance(value, str) and value in named else value
    section = {k: v for k, v in section.items() if v is not None}
    with pytest.raises(ConfigError) as caught:
        load_model(parse_config(yaml.safe_dump({"model": section}), "x.yaml").model)
    assert re.search(message, str(caught.value)), str(caught.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="device auto resolves to the GPU here")
def test_fp16_with_device_auto_on_a_cpu_only_machine_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="fp16 needs a CUDA GPU and the device is the CPU"):
        load_model(ModelConfig(precision="fp16"))


def test_compile_without_a_cxx_compiler_on_the_cpu_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(ConfigError, match="needs a C\\+\\+ compiler"):
        load_model(ModelConfig(device="cpu", compile=True))


def test_bf16_runs_on_the_cpu(files: dict[str, Path], photos: dict[str, Path]) -> None:
    config = parse_config(yaml.safe_dump({"model": torchvision_section(
        files, precision="bf16", output="embed")}), "x").model
    model = load_model(config)
    pixels = [decode_image(photos["chelsea"].read_bytes(), model.spec, 10**8).pixels]
    fp32 = Model("fp32", resnet18_backbone(files), model.spec, None, torch.device("cpu"),
                 "fp32", 1, output="embed").outputs(pixels)
    bf16 = model.outputs(pixels)
    assert bf16.dtype == torch.float32
    cosine = torch.nn.functional.cosine_similarity(bf16, fp32)
    assert float(cosine.min()) > 0.99, cosine


def resnet18_backbone(files: dict[str, Path]) -> nn.Module:
    network = resnet18()
    network.load_state_dict(torch.load(files["weights"], weights_only=True))
    network.fc = nn.Identity()
    return network


# -- the command line -----------------------------------------------------------------------


def inboxd(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "inboxd", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=180,
                          # This checkout's daemon/ first: the shared venv's editable install
                          # may point at another one.
                          env={**os.environ,
                               "PYTHONPATH": os.pathsep.join([str(REPO / "daemon"), str(REPO)])})


@pytest.mark.daemon
def test_once_with_a_bad_model_exits_78_before_touching_any_file(
    tmp_path: Path, files: dict[str, Path]
) -> None:
    section = torchvision_section(files, weights=str(tmp_path / "missing.pth"))
    config = write_config(tmp_path, model=section)
    photo = make_image(tmp_path / "inbox" / "a.png")
    done = inboxd("once", "-c", str(config), cwd=tmp_path)
    assert done.returncode == EX_CONFIG, done.stderr
    assert f"cannot read {tmp_path / 'missing.pth'}: no such file" in done.stderr
    assert "inboxd never downloads" in done.stderr
    # Nothing claimed, moved or written: only the instance lock taken before loading.
    left = {p.name for p in (tmp_path / "inbox").rglob("*") if p.is_file()}
    assert left <= {"a.png", "default.lock"} and photo.exists()
    assert not (tmp_path / "results").exists() and not (tmp_path / "done").exists()



def test_check_config_catches_missing_model_files_without_torch(
    tmp_path: Path, files: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    section = torchvision_section(files, weights=str(tmp_path / "missing.pth"),
                                  labels=str(files["labels9"]), num_classes=10)
    assert cli.main(["check-config", "-c", str(write_config(tmp_path, model=section))]) == EX_CONFIG
    err = capsys.readouterr().err
    assert f"model.weights: cannot read {tmp_path / 'missing.pth'}" in err
    assert "model.labels: " in err and "has 9 labels but the model (num_classes: 10)" in err


def test_models_lists_the_builtin_and_what_the_config_loads(
    tmp_path: Path, files: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    config = write_config(tmp_path, model=torchvision_section(files, top_k=3))
    assert cli.main(["models", "-c", str(config)]) == 0
    out = capsys.readouterr().out
    assert "efficientnet_lite0" in out and "4,652,008" in out  # the built-in, 1000 classes
    assert f"resnet18: torchvision resnet18, weights {files['weights']}" in out
    assert "parameters: 11,181,642" in out  # resnet18 with a 10-class head
    assert "N×3×224×224 float32, RGB: shorter side resized to 256 (bilinear)" in out
    assert "classify: top 3 of 10 classes" in out


# -- the README's worked examples -----------------------------------------------------------


def readme_examples() -> dict[str, tuple[list[str], list[str]]]:
    """"## Example" sections of docs/models.md (README's "Your own model" points there): their
    Python and YAML blocks."""
    guide = (REPO / "docs" / "models.md").read_text()
    examples = {}
    for part in guide.split("\n## ")[1:]:
        title, _, body = part.partition("\n")
        if title.startswith("Example"):
            examples[title] = (re.findall(r"```python\n(.*?)```", body, re.S),
                               re.findall(r"```yaml\n(.*?)```", body, re.S))
    return examples


EXAMPLES = readme_examples()


@pytest.mark.slow
@pytest.mark.parametrize("title", list(EXAMPLES))
def test_readme_example_runs(title: str, tmp_path: Path, photos: dict[str, Path],
                             monkeypatch: pytest.MonkeyPatch) -> None:
    code, configs = EXAMPLES[title]
    assert configs, f"{title}: no YAML block"
    monkeypatch.chdir(tmp_path)
    for block in code:
        exec(compile(block, title, "exec"), {"__name__": "readme_example"})
    one = {"chelsea": photos["chelsea"]}
    for n, block in enumerate(configs):
        root = tmp_path / f"run{n}"
        given = yaml.safe_load(block)
        if "models" in given:  # several tasks: each task's section as a one-model result
            tasks = {task: {**b, "device": "cpu"} for task, b in given["models"].items()}
        else:
            tasks = {"": {**given["model"], "device": "cpu"}}
        if any(model.get("name") == "ocr" for model in tasks.values()):  # a photo with text
            from support.text_images import receipt_total

            one = {"total": receipt_total().save(tmp_path)}
        if "models" in given:
            run_pipeline(root, one, None, models=tasks)
        else:
            run_pipeline(root, one, tasks[""])
        for name, path in one.items():
            document = result(root, name, path)
            for task, model in tasks.items():
                section = document[task] if task else document
                if model.get("name") == "ocr":
                    assert section["ocr"]["full_text"] == "Total 348.20 EUR", document
                elif model.get("output") == "embed":
                    embedding = section["embedding"]
                    assert vector(root, name, path).shape == (embedding["dim"],)
                elif model.get("output") == "detect":
                    assert isinstance(section["detections"], list), section
                else:
                    assert section["top_k"], document


# -- on a GPU -------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_reduced_precision_on_the_gpu_agrees_with_fp32(
    precision: Literal["fp16", "bf16"], files: dict[str, Path], photos: dict[str, Path]
) -> None:
    if precision == "bf16" and not torch.cuda.is_bf16_supported(including_emulation=False):
        pytest.skip("this GPU has no native bf16")
    outputs = {}
    precisions: tuple[Literal["fp32", "fp16", "bf16"], ...] = ("fp32", precision)
    for p in precisions:
        config = ModelConfig(torchvision="resnet18", weights=files["weights"],
                             labels=files["labels"], device="cuda", precision=p, output="embed")
        model = load_model(config)
        pixels = [decode_image(f.read_bytes(), model.spec, 10**8).pixels
                  for f in photos.values()]
        outputs[p] = model.outputs(pixels).cpu()
    cosine = torch.nn.functional.cosine_similarity(outputs[precision], outputs["fp32"])
    assert float(cosine.min()) > 0.999, cosine


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("kind", ["torchvision", "export"])
def test_compiled_and_exported_on_the_gpu_agree_with_the_cpu(
    kind: str, files: dict[str, Path], photos: dict[str, Path]
) -> None:
    source: dict[str, Any] = (
        {"torchvision": "resnet18", "weights": files["weights"]} if kind == "torchvision"
        else {"export": files["program"]})
    cpu = load_model(ModelConfig(**source, labels=files["labels"], device="cpu"))
    cuda = load_model(ModelConfig(**source, labels=files["labels"], device="cuda",
                                  compile=kind == "torchvision"))
    cuda.warm_up(cuda.warm_up_sizes(8))
    pixels = [decode_image(f.read_bytes(), cpu.spec, 10**8).pixels for f in photos.values()]
    for batch in (pixels[:1], pixels):
        expected = cpu.outputs(batch)
        got = cuda.outputs(batch).cpu()
        # TF32 convolutions on the GPU: agreement to about 1e-3 of the logits' scale.
        assert float((got - expected).abs().max()) < 1e-2 * float(expected.abs().max())
