"""``output: detect``: boxes in the displayed photo's own pixels, whatever its orientation, shape
or size; class-wise NMS; a torchvision detector equal to its own direct call; start-up checks.

The YOLO-layout detector is an ONNX graph whose output is known (``tests/detectors.py``), so the
expected boxes follow from the photo's displayed size alone.
"""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from inboxd.config import ConfigError, ModelConfig
from inboxd.decode.pillow import decode_image
from inboxd.exit_codes import EX_CONFIG
from inboxd.models.detect.geometry import Detections
from inboxd.models.detect_model import Detector
from inboxd.models.loading import load_model
from PIL import Image

from tests import detectors
from tests.conftest import write_config

MAX_PIXELS = 89_478_485


@pytest.fixture(scope="module")
def yolo_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return detectors.yolo_onnx(tmp_path_factory.mktemp("yolo") / "yolo.onnx")


@pytest.fixture(scope="module")
def labels_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("labels") / "labels.txt"
    path.write_text("\n".join(detectors.LABELS) + "\n")
    return path


def detector_config(model_file: Path, labels: Path, **detect: object) -> ModelConfig:
    """An ``.onnx`` detector's block, or a ``.pt2`` one's (``export:``, kept on the CPU: the
    tests compare its boxes with the ONNX detector's)."""
    source: dict[str, object] = ({"export": model_file, "device": "cpu"}
                                 if model_file.suffix == ".pt2" else {"onnx": model_file})
    return ModelConfig(**source, output="detect", labels=labels,
                       detect={"score_threshold": detectors.SCORE_THRESHOLD, **detect})


@pytest.fixture(scope="module")
def yolo(yolo_path: Path, labels_path: Path) -> Detector:
    model = load_model(detector_config(yolo_path, labels_path))
    assert isinstance(model, Detector)
    return model


def photo_bytes(size: tuple[int, int], orientation: int = 1, fmt: str = "JPEG") -> bytes:
    """A photo *stored* at ``size`` with an EXIF orientation."""
    rng = np.random.default_rng(size[0] * 7 + size[1])
    small = Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8))
    image = small.resize(size, Image.Resampling.BILINEAR)
    exif = Image.Exif()
    exif[0x0112] = orientation
    out = io.BytesIO()
    image.save(out, format=fmt, exif=exif.tobytes())
    return out.getvalue()


def detect_one(model: Detector, data: bytes) -> tuple[list[dict[str, object]], int, int]:
    image = decode_image(data, model.spec, MAX_PIXELS)
    [found] = model.predict([image.pixels])
    assert isinstance(found, Detections)
    return found.in_photo(image.width, image.height), image.width, image.height


@pytest.mark.parametrize("orientation", [1, 3, 6, 8])
def test_boxes_are_in_the_displayed_photo_s_pixels_for_each_exif_orientation(
        yolo: Detector, orientation: int) -> None:
    """Stored 1200×800; with orientation 6 or 8 the photo is shown 800×1200, and the boxes are
    in those pixels: the letterbox of the turned photo undone."""
    found, width, height = detect_one(yolo, photo_bytes((1200, 800), orientation))
    assert (width, height) == ((800, 1200) if orientation in (6, 8) else (1200, 800))
    assert found == detectors.expected_boxes(width, height)


@pytest.mark.parametrize("size", [(1600, 900), (900, 1600), (23, 11), (6000, 4000), (640, 7)],
                         ids=["landscape", "portrait", "tiny", "huge", "strip"])
def test_boxes_are_in_the_displayed_photo_s_pixels_for_each_shape(
        yolo: Detector, size: tuple[int, int]) -> None:
    found, width, height = detect_one(yolo, photo_bytes(size, fmt="PNG" if min(size) < 16
                                                        else "JPEG"))
    assert (width, height) == size
    assert found == detectors.expected_boxes(*size)
    for detection in found:
        x0, y0, x1, y1 = detection["box"]  # type: ignore[misc]
        assert 0 <= x0 <= x1 <= width and 0 <= y0 <= y1 <= height


def test_nms_drops_a_near_duplicate_and_keeps_another_class_on_the_same_box(
        yolo: Detector) -> None:
    found, _, _ = detect_one(yolo, photo_bytes((640, 640)))
    cats = [d for d in found if d["label"] == "cat"]
    dogs = [d for d in found if d["label"] == "dog"]
    assert [d["score"] for d in cats] == [0.9]  # the 0.8 one, 1 px off, was suppressed
    assert sorted(d["score"] for d in dogs) == [0.6, 0.7]
    assert cats[0]["box"] == dogs[[d["score"] for d in dogs].index(0.6)]["box"]


def test_max_detections_bounds_each_photo_best_first(yolo_path: Path, labels_path: Path) -> None:
    model = load_model(detector_config(yolo_path, labels_path, max_detections=2))
    assert isinstance(model, Detector)
    found, _, _ = detect_one(model, photo_bytes((640, 480)))
    assert [d["score"] for d in found] == [0.9, 0.7]


def assert_expected_boxes(models: Sequence[Detector], datas: Sequence[bytes]) -> None:
    """Each model finds, in each photo, the boxes ``tests/detectors.py`` drew, in the photo's
    own pixels."""
    for model in models:
        images = [decode_image(d, model.spec, MAX_PIXELS) for d in datas]
        for image, found in zip(images, model.predict([i.pixels for i in images]),
                                strict=True):
            assert isinstance(found, Detections)
            assert found.in_photo(image.width, image.height) == detectors.expected_boxes(
                image.width, image.height)


def test_a_batch_of_mixed_shapes_gives_each_photo_its_own_boxes(yolo: Detector) -> None:
    assert_expected_boxes((yolo,), [photo_bytes((1600, 900)), photo_bytes((900, 1600)),
                                    photo_bytes((1200, 800), 6)])


def test_a_fixed_batch_export_and_the_packed_boxes_layout_give_the_same_boxes(
        tmp_path: Path, labels_path: Path) -> None:
    """An Ultralytics export is batch-1 by default: batches are run one image at a time. An
    export with NMS inside (one N×K×6 output) is told apart by its shape."""
    fixed = load_model(detector_config(detectors.yolo_onnx(tmp_path / "b1.onnx", 1),
                                       labels_path))
    packed = load_model(detector_config(detectors.yolo_onnx(tmp_path / "nms.onnx",
                                                            packed=True), labels_path))
    assert isinstance(fixed, Detector) and isinstance(packed, Detector)
    assert fixed.layout is not None and fixed.layout.layout == "yolo"
    assert packed.layout is not None and packed.layout.layout == "boxes"
    assert_expected_boxes((fixed, packed), [photo_bytes((1600, 900)), photo_bytes((700, 1000))])


# -- a torch.export program (.pt2) ------------------------------------------------------------


@pytest.fixture(scope="module")
def pt2_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return detectors.yolo_pt2(tmp_path_factory.mktemp("pt2") / "yolo.pt2")


@pytest.fixture(scope="module")
def pt2(pt2_path: Path, labels_path: Path) -> Detector:
    model = load_model(detector_config(pt2_path, labels_path))
    assert isinstance(model, Detector)
    return model


@pytest.mark.parametrize(("size", "orientation"), [
    ((1200, 800), 1), ((1200, 800), 3), ((1200, 800), 6), ((1200, 800), 8),
    ((1600, 900), 1), ((900, 1600), 1)],
    ids=["orientation1", "orientation3", "orientation6", "orientation8", "landscape",
         "portrait"])
def test_a_pt2_detector_gives_the_onnx_detector_s_boxes(
        pt2: Detector, yolo: Detector, size: tuple[int, int], orientation: int) -> None:
    """The same constant detector as a torch.export program: the same letterbox, layout and
    NMS, so exactly the ONNX detector's boxes, in the displayed photo's pixels."""
    assert pt2.family == "export" and pt2.layout is not None and pt2.layout.layout == "yolo"
    data = photo_bytes(size, orientation)
    found, width, height = detect_one(pt2, data)
    assert (width, height) == (size[::-1] if orientation in (6, 8) else size)
    assert found == detect_one(yolo, data)[0] == detectors.expected_boxes(width, height)


def test_a_pt2_detector_returning_boxes_scores_and_labels_gives_the_same_boxes(
        tmp_path: Path, labels_path: Path, pt2: Detector) -> None:
    """A program with NMS inside returning a dict: its keys tell scores from labels; a batch
    of mixed shapes gives each photo its own boxes."""
    program = detectors.yolo_pt2(tmp_path / "nms.pt2", layout="boxes")
    boxes = load_model(detector_config(program, labels_path))
    assert isinstance(boxes, Detector)
    assert boxes.layout is not None and boxes.layout.layout == "boxes"
    assert_expected_boxes((boxes, pt2), [photo_bytes((1600, 900)), photo_bytes((700, 1000), 6),
                                         photo_bytes((23, 11))])


def test_a_pt2_detector_runs_at_the_precision_it_was_exported_with(
        tmp_path: Path, labels_path: Path) -> None:
    """Exported in fp16, it is fed fp16 (its convolution takes nothing else): the same boxes,
    scores to fp16's precision."""
    program = detectors.yolo_pt2(tmp_path / "half.pt2", dtype=torch.float16)
    half = load_model(detector_config(program, labels_path))
    assert isinstance(half, Detector) and half.input_dtype == torch.float16
    found, width, height = detect_one(half, photo_bytes((1200, 800), 6))
    expected = detectors.expected_boxes(width, height)
    assert [d["box"] for d in found] == [d["box"] for d in expected]
    assert [d["label"] for d in found] == [d["label"] for d in expected]
    assert np.allclose([d["score"] for d in found], [d["score"] for d in expected], atol=1e-3)


def test_a_pt2_detector_of_any_input_size_is_fed_input_size(tmp_path: Path,
                                                            labels_path: Path) -> None:
    """A program exported with a dynamic height and width: the letterbox's side is
    ``input.size`` (640 unset, Ultralytics' default)."""
    program = detectors.yolo_pt2(tmp_path / "any.pt2", any_size=True)
    unset = load_model(detector_config(program, labels_path))
    assert isinstance(unset, Detector) and unset.side == 640
    sized = load_model(ModelConfig(export=program, output="detect", labels=labels_path,
                                   device="cpu", input={"size": detectors.SIDE},
                                   detect={"score_threshold": detectors.SCORE_THRESHOLD}))
    assert isinstance(sized, Detector) and sized.side == detectors.SIDE
    found, width, height = detect_one(sized, photo_bytes((900, 1600), 8))
    assert found == detectors.expected_boxes(width, height)


def test_a_pt2_detector_is_checked_at_start_up_naming_the_key(
        tmp_path: Path, labels_path: Path, pt2_path: Path) -> None:
    neither = detectors.yolo_pt2(tmp_path / "neither.pt2", layout="neither")
    with pytest.raises(ConfigError, match=re.escape(
            f"export: {neither}: its outputs [[2, 7]] fit no detector layout")):
        load_model(detector_config(neither, labels_path))
    with pytest.raises(ConfigError, match=re.escape(
            f"input.size is 320 but export: {pt2_path} takes 64×64 images")):
        load_model(ModelConfig(export=pt2_path, output="detect", labels=labels_path,
                               input={"size": 320}))
    with pytest.raises(ConfigError, match="precision it was exported with"):
        load_model(ModelConfig(export=pt2_path, output="detect", labels=labels_path,
                               precision="bf16", device="cpu"))
    with pytest.raises(ValueError, match="runs in torch as it was exported: remove compile"):
        ModelConfig(export=pt2_path, output="detect", labels=labels_path, compile=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_pt2_detector_on_the_gpu_gives_the_cpu_boxes(pt2_path: Path, labels_path: Path,
                                                       pt2: Detector) -> None:
    """The program is moved to the GPU (move_to_device_pass: its own constants too) and the
    letterbox is cut there."""
    model = load_model(detector_config(pt2_path, labels_path).model_copy(update={"device": "cuda"}))
    assert isinstance(model, Detector) and model.device.type == "cuda"
    for size, orientation in (((1200, 800), 6), ((1600, 900), 1)):
        data = photo_bytes(size, orientation)
        assert detect_one(model, data) == detect_one(pt2, data)


@pytest.mark.slow  # a costly run: `make test`, not the fast tier
def test_a_pt2_whose_outputs_fit_no_layout_exits_78_naming_the_key_and_the_fix(
        tmp_path: Path, labels_path: Path) -> None:
    neither = detectors.yolo_pt2(tmp_path / "neither.pt2", layout="neither")
    config = write_config(tmp_path, model={"export": str(neither), "output": "detect",
                                           "labels": str(labels_path)})
    done = subprocess.run([sys.executable, "-m", "inboxd", "models", "-c", str(config)],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == EX_CONFIG, done.stderr
    said = done.stderr + done.stdout
    assert f"export: {neither}: its outputs [[2, 7]] fit no detector layout" in said, said
    assert "the YOLO layout is one N×(4+classes)×candidates output" in said, said


def test_start_up_refuses_what_cannot_work_naming_the_key(tmp_path: Path,
                                                          labels_path: Path) -> None:
    yolo_path = detectors.yolo_onnx(tmp_path / "yolo.onnx")
    three = tmp_path / "three.txt"
    three.write_text("a\nb\nc\n")
    with pytest.raises(ConfigError, match="3 names but the detector outputs 2 classes"):
        load_model(detector_config(yolo_path, three))
    with pytest.raises(ConfigError, match=r"input\.size is 320 but .* takes 64×64"):
        load_model(ModelConfig(onnx=yolo_path, output="detect", labels=labels_path,
                               input={"size": 320}))
    with pytest.raises(ConfigError, match=r"set model\.detect\.layout"):
        # A 6×6 output: six candidates of two classes, or six detections: it could be either.
        square = detectors.yolo_onnx(tmp_path / "square.onnx", packed=True)
        import onnx

        graph = onnx.load(square)
        rows = np.zeros((1, 6, 6), dtype=np.float32)
        graph.graph.initializer[-1].CopyFrom(onnx.numpy_helper.from_array(rows, "rows"))
        graph.graph.output[0].type.tensor_type.shape.dim[1].dim_value = 6
        onnx.save(graph, square)
        load_model(detector_config(square, labels_path))
    with pytest.raises(ConfigError, match=r"detect\.layout is boxes"):
        load_model(detector_config(yolo_path, labels_path, layout="boxes"))


def test_an_onnx_detector_asked_for_a_gpu_without_onnxruntime_s_cuda_runs_on_the_cpu_saying_so(
        yolo_path: Path, labels_path: Path, yolo: Detector,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU is the boundary faked here (``pick_device`` answers cuda); the onnxruntime is
    the installed CPU package, which has no CUDA provider: the detector runs on the CPU, the
    started record's fields say why, and its boxes are the CPU detector's."""
    import onnxruntime as ort
    from inboxd.models import detect_model

    assert "CUDAExecutionProvider" not in ort.get_available_providers()
    monkeypatch.setattr(detect_model, "pick_device", lambda requested: torch.device("cuda"))
    model = load_model(detector_config(yolo_path, labels_path).model_copy(
        update={"device": "cuda"}))
    assert isinstance(model, Detector)
    assert model.device.type == "cpu"
    assert "no CUDA provider" in model.fields["MODEL_NOTE"], model.fields
    assert "CPUExecutionProvider" in model.fields["RUNTIME_REASON"], model.fields
    data = photo_bytes((640, 480))
    assert detect_one(model, data) == detect_one(yolo, data)
    assert "MODEL_NOTE" not in yolo.fields  # asked for the CPU: nothing to explain


@pytest.mark.slow  # a costly run: `make test`, not the fast tier
def test_a_detector_that_cannot_work_exits_78_naming_the_fix(tmp_path: Path) -> None:
    yolo_path = detectors.yolo_onnx(tmp_path / "yolo.onnx")
    config = write_config(tmp_path, model={"onnx": str(yolo_path), "output": "detect"})
    done = subprocess.run([sys.executable, "-m", "inboxd", "models", "-c", str(config)],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == EX_CONFIG, done.stderr
    assert "labels: give labels: PATH" in done.stderr + done.stdout


@pytest.mark.daemon
@pytest.mark.slow  # a costly run: `make test`, not the fast tier
@pytest.mark.parametrize("source", ["onnx", "export"])
def test_inboxd_once_writes_detections_in_the_displayed_photo_s_pixels(
        tmp_path: Path, yolo_path: Path, pt2_path: Path, labels_path: Path,
        source: str) -> None:
    """From the YAML, for the ONNX detector and the same detector as a .pt2 program."""
    network = yolo_path if source == "onnx" else pt2_path
    config = write_config(tmp_path, model={source: str(network), "output": "detect",
                                           "labels": str(labels_path),
                                           "detect": {"score_threshold": 0.25}})
    photos = {"turned.jpg": ((1200, 800), 6), "wide.jpg": ((1600, 900), 1),
              "tiny.png": ((23, 11), 1), "upside.jpg": ((1000, 1400), 3)}
    for name, (size, orientation) in photos.items():
        (tmp_path / "inbox" / name).write_bytes(
            photo_bytes(size, orientation, "PNG" if name.endswith("png") else "JPEG"))
    done = subprocess.run([sys.executable, "-m", "inboxd", "once", "-c", str(config)],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr
    for name, (size, orientation) in photos.items():
        result = json.loads((tmp_path / "results" / f"{name}.json").read_text())
        shown = size[::-1] if orientation in (6, 8) else size
        assert (result["image"]["width"], result["image"]["height"]) == shown
        assert result["detections"] == detectors.expected_boxes(*shown), name
        assert "top_k" not in result


# -- torchvision ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ssdlite_weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Random-init weights (seeded), saved as a user would save trained ones. BatchNorm's
    running statistics are measured on random images first: left at their init, every layer
    shrinks the signal ~100× and the boxes come out the same whatever the photo, so a test
    comparing them could not see a wrong input."""
    import torchvision

    torch.manual_seed(0)
    network = torchvision.models.get_model("ssdlite320_mobilenet_v3_large", weights=None,
                                           weights_backbone=None, num_classes=91)
    for module in network.modules():
        if isinstance(module, torch.nn.BatchNorm2d):
            module.momentum = None  # a plain average over the batches seen
            module.reset_running_stats()
    network.train()
    with torch.no_grad():
        batch = network.transform([torch.rand(3, 320, 320) for _ in range(8)])[0].tensors
        network.head(list(network.backbone(batch).values()))
    path = tmp_path_factory.mktemp("ssdlite") / "ssdlite.pth"
    torch.save(network.state_dict(), path)
    return path


THRESHOLD = 0.03  # what the calibrated random network's best boxes score a little above


@pytest.mark.slow
def test_a_torchvision_detector_through_inboxd_equals_its_direct_call(
        ssdlite_weights: Path) -> None:
    import torchvision

    config = ModelConfig(torchvision="ssdlite320_mobilenet_v3_large", weights=ssdlite_weights,
                         output="detect", device="cpu",
                         detect={"score_threshold": THRESHOLD, "max_detections": 50})
    model = load_model(config)
    assert isinstance(model, Detector) and model.spec.kind == "fit" and model.spec.crop == 320
    reference = torchvision.models.get_model("ssdlite320_mobilenet_v3_large", weights=None,
                                             weights_backbone=None, num_classes=91)
    reference.load_state_dict(torch.load(ssdlite_weights, weights_only=True))
    reference.eval()
    images = [decode_image(photo_bytes(size, orientation), model.spec, MAX_PIXELS)
              for size, orientation in (((1600, 900), 1), ((1200, 800), 6))]
    ours = model.predict([image.pixels for image in images])
    with torch.inference_mode():
        direct = reference([torch.from_numpy(image.pixels).permute(2, 0, 1).float() / 255
                            for image in images])
    compared = 0
    for image, found, call in zip(images, ours, direct, strict=True):
        assert isinstance(found, Detections)
        keep = call["scores"] > THRESHOLD
        scores, order = call["scores"][keep].sort(descending=True, stable=True)
        boxes, labels = call["boxes"][keep][order][:50], call["labels"][keep][order][:50]
        assert len(found.boxes) == min(50, int(keep.sum())) > 0
        assert found.indices == labels.tolist()
        assert np.allclose(found.scores, scores[:50].numpy(), atol=1e-5)
        assert np.allclose(found.boxes, boxes.numpy(), atol=1e-3)
        # and in the photo's pixels: the fitted image's scaled by the photo's own size
        shown = found.in_photo(image.width, image.height)
        fit_w = image.pixels.shape[1]
        x0 = min(max(float(boxes[0, 0]) * image.width / fit_w, 0.0), image.width)
        assert shown[0]["box"][0] == round(x0, 2)
        compared += len(found.boxes)
    assert compared > 0


@pytest.mark.slow
def test_a_torchvision_detector_s_weights_must_fit_strictly(ssdlite_weights: Path,
                                                             tmp_path: Path) -> None:
    state = torch.load(ssdlite_weights, weights_only=True)
    state.pop(next(iter(state)))
    broken = tmp_path / "broken.pth"
    torch.save(state, broken)
    with pytest.raises(ConfigError, match="missing keys"):
        load_model(ModelConfig(torchvision="ssdlite320_mobilenet_v3_large", weights=broken,
                               output="detect", device="cpu"))
    with pytest.raises(ConfigError, match="is not a detection architecture"):
        load_model(ModelConfig(torchvision="resnet18", weights=ssdlite_weights,
                               output="detect", device="cpu"))


def test_the_docs_yaml_shape_round_trips(tmp_path: Path) -> None:
    """``detect:`` keys are checked by the config schema (a typo is an error)."""
    with pytest.raises(ValueError):
        ModelConfig.model_validate(yaml.safe_load(
            "onnx: /x.onnx\noutput: detect\ndetect: {max_detection: 5}"))
