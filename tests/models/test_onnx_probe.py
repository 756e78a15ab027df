"""The memory a bring-your-own ``.onnx`` may take in its probe: the machine's MemAvailable,
and below it the memory cgroup's room (v1 and v2), read from a fake /proc and cgroup tree; and
the probe itself, a real ONNX Runtime child, on graphs whose memory or answer follows the pixel
values and on ordinary ones that must pass."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from inboxd.config import ConfigError, ModelConfig
from inboxd.models.onnx_probe import memory_headroom_bytes, probe_in_child

GIB = 1 << 30


def fake_proc(root: Path, available_kib: int, cgroup_line: str) -> Path:
    proc = root / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemTotal: 99999999 kB\nMemAvailable: {available_kib} kB\n")
    (proc / "self" / "cgroup").write_text(cgroup_line + "\n")
    return proc


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_the_cgroup_limit_bounds_the_headroom_with_its_file_cache_counted_free(
        tmp_path: Path, version: str) -> None:
    cgroups = tmp_path / "cgroup"
    if version == "v1":
        proc = fake_proc(tmp_path, 16 * GIB // 1024, "4:memory:/inboxd.service")
        folder = cgroups / "memory" / "inboxd.service"
        folder.mkdir(parents=True)
        (folder / "memory.limit_in_bytes").write_text(str(8 * GIB))
        (folder / "memory.usage_in_bytes").write_text(str(7 * GIB))
        (folder / "memory.stat").write_text(f"cache 5\ntotal_inactive_file {GIB}\n")
    else:
        proc = fake_proc(tmp_path, 16 * GIB // 1024, "0::/system.slice/inboxd.service")
        folder = cgroups / "system.slice" / "inboxd.service"
        folder.mkdir(parents=True)
        (folder / "memory.max").write_text(f"{8 * GIB}\n")
        (folder / "memory.current").write_text(str(7 * GIB))
        (folder / "memory.stat").write_text(f"anon 5\ninactive_file {GIB}\n")
    assert memory_headroom_bytes(proc, cgroups) == 2 * GIB  # 8 - 7 + 1 reclaimable


def test_without_a_limit_or_a_readable_cgroup_the_machine_s_figure_stands(
        tmp_path: Path) -> None:
    cgroups = tmp_path / "cgroup"
    proc = fake_proc(tmp_path, 3 * GIB // 1024, "0::/user.slice")
    (cgroups / "user.slice").mkdir(parents=True)
    (cgroups / "user.slice" / "memory.max").write_text("max\n")
    assert memory_headroom_bytes(proc, cgroups) == 3 * GIB
    proc = fake_proc(tmp_path / "b", 3 * GIB // 1024, "0::/nowhere")
    assert memory_headroom_bytes(proc, cgroups) == 3 * GIB


# -- pixel values: a graph that sizes a tensor or its answer from them ----------------------

GRID = 8  # candidate cells per side of the value-counted detector / classifier


def counted_cells_onnx(path: Path, detect: bool) -> Path:
    """A graph whose answer has K columns, K = the most cells of an 8×8 grid (each image's
    channel mean, average-pooled) brighter than 0.5 in any image of the batch: 0 for a blank
    batch, 64 for a bright one. As a detector with NMS inside (boxes N×K×4, scores N×K, labels
    N×K) that is an ordinary box count; as a classifier (N×K logits) a shape that follows the
    pixels."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    side = 64
    cells = GRID * GRID
    boxes = np.array([[x * 8, y * 8, x * 8 + 8, y * 8 + 8] for y in range(GRID)
                      for x in range(GRID)], dtype=np.float32)
    nodes = [
        helper.make_node("ReduceMean", ["images"], ["luma"], axes=[1], keepdims=1),
        helper.make_node("AveragePool", ["luma"], ["pooled"], kernel_shape=[8, 8],
                         strides=[8, 8]),
        helper.make_node("Flatten", ["pooled"], ["scores_all"], axis=1),  # N×64
        helper.make_node("Greater", ["scores_all", "half"], ["bright"]),
        helper.make_node("Cast", ["bright"], ["bright_i"], to=TensorProto.INT64),
        helper.make_node("ReduceSum", ["bright_i", "axis1"], ["per_image"], keepdims=0),
        helper.make_node("ReduceMax", ["per_image"], ["k0"], keepdims=1),
        helper.make_node("Reshape", ["k0", "one"], ["k"]),
        helper.make_node("TopK", ["scores_all", "k"], ["scores", "indices"], axis=1),
    ]
    initializers = [numpy_helper.from_array(np.array(0.5, dtype=np.float32), "half"),
                    numpy_helper.from_array(np.array([1], dtype=np.int64), "axis1"),
                    numpy_helper.from_array(np.array([1], dtype=np.int64), "one")]
    if detect:
        nodes += [helper.make_node("Gather", ["cell_boxes", "indices"], ["boxes"], axis=0),
                  helper.make_node("Mul", ["indices", "zero"], ["labels"])]
        initializers += [numpy_helper.from_array(boxes, "cell_boxes"),
                         numpy_helper.from_array(np.array(0, dtype=np.int64), "zero")]
        outputs = [helper.make_tensor_value_info("boxes", TensorProto.FLOAT, ["N", "K", 4]),
                   helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["N", "K"]),
                   helper.make_tensor_value_info("labels", TensorProto.INT64, ["N", "K"])]
    else:
        outputs = [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["N", "K"])]
    assert cells == len(boxes)
    graph = helper.make_graph(
        nodes, "counted_cells",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, ["N", 3, side, side])],
        outputs, initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


def test_a_detector_whose_box_count_follows_the_pixels_passes(tmp_path: Path) -> None:
    """NMS inside answers more boxes for a busy photo: the box axis may move (it is bounded
    by detect.max_detections after it), and the memory stays within the bound."""
    model = counted_cells_onnx(tmp_path / "detector.onnx", detect=True)
    probe_in_child(ModelConfig.model_validate({"onnx": str(model), "output": "detect"}),
                   [1, 2, 8])


def test_a_classifier_whose_answer_width_follows_the_pixels_is_refused(tmp_path: Path) -> None:
    model = counted_cells_onnx(tmp_path / "classifier.onnx", detect=False)
    with pytest.raises(ConfigError, match="output shape follows the pixel values") as refused:
        probe_in_child(ModelConfig.model_validate({"onnx": str(model)}), [1, 2])
    assert "a blank batch of 1 answered [[1, 0]]" in str(refused.value)
    assert "export it with shapes that do not depend on the input's values" in str(
        refused.value)


def test_ordinary_onnx_models_pass_the_value_probe(tmp_path: Path) -> None:
    """A classifier, the same network as an embedder, a YOLO and a boxes-layout detector with
    constant answers: nothing of theirs follows the pixel values."""
    from tests.byo_models import onnx_wrong_rows
    from tests.detectors import yolo_onnx

    classifier = onnx_wrong_rows(tmp_path / "classifier.onnx", set())
    probe_in_child(ModelConfig.model_validate({"onnx": str(classifier)}), [1, 2, 16])
    probe_in_child(ModelConfig.model_validate({"onnx": str(classifier), "output": "embed"}),
                   [1, 16])
    for packed in (False, True):
        detector = yolo_onnx(tmp_path / f"detector{packed}.onnx", packed=packed)
        probe_in_child(ModelConfig.model_validate({"onnx": str(detector), "output": "detect"}),
                       [1, 2, 8])


# The TorchScript exporter: seconds, where the dynamo one takes half a minute here.
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_torch_exported_classifier_passes_the_value_probe(tmp_path: Path) -> None:
    """A real network (convolutions, batch norm, pooling, a dynamic batch axis) as
    torch.onnx.export writes it: its memory is the same for any pixels."""
    import torch
    import torchvision

    torch.manual_seed(0)
    network = torchvision.models.mobilenet_v3_small(weights=None, num_classes=10).eval()
    path = tmp_path / "mobilenet.onnx"
    torch.onnx.export(network, (torch.zeros(2, 3, 224, 224),), str(path), dynamo=False,
                      input_names=["input"], output_names=["logits"],
                      dynamic_axes={"input": {0: "N"}, "logits": {0: "N"}})
    probe_in_child(ModelConfig.model_validate({"onnx": str(path)}), [1, 2, 16])


def test_memory_that_follows_the_pixels_is_refused_even_where_it_would_fit(
        tmp_path: Path) -> None:
    """~500 MB more for a bright batch: well inside this machine's memory, so only the bound
    over the blank batch's peak refuses it (a photo's values are not the probe's)."""
    from tests.byo_models import value_shaped_bomb

    # ImageNet normalisation: the brightest blue is (1 - 0.406) / 0.225 = 2.64; k = 11,600.
    model = value_shaped_bomb(tmp_path / "bomb.onnx", per_unit=4_400.0)
    with pytest.raises(ConfigError, match="memory follows the pixel values"):
        probe_in_child(ModelConfig.model_validate({"onnx": str(model)}), [1, 2])
