"""The artifact check's wire-format reader (``models/runtimes/onnx_wire.py``) against the onnx
package's own reading, and on the files it must refuse."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from inboxd.models.runtimes import onnx_wire
from inboxd.models.runtimes.onnx_artifact import ArtifactRefused, check_self_contained
from onnx import TensorProto, helper, numpy_helper

from tests.conftest import SHARED_MODEL_CACHE, shared_model_artifact


def model(initializer: TensorProto | None = None, node_tensor: TensorProto | None = None,
          metadata: dict[str, str] | None = None, subgraph: bool = False) -> bytes:
    """y = x + c, c an initializer or a Constant node's tensor (in an If's branch with
    ``subgraph``)."""
    tensor = numpy_helper.from_array(np.ones(3, np.float32), "c")
    nodes = []
    initializers = []
    if node_tensor is not None:
        constant = helper.make_node("Constant", [], ["c"], value=node_tensor)
        if subgraph:
            branch = helper.make_graph([constant], "branch", [], [
                helper.make_tensor_value_info("c", TensorProto.FLOAT, [3])])
            nodes.append(helper.make_node("If", ["cond"], ["c"], then_branch=branch,
                                          else_branch=branch))
        else:
            nodes.append(constant)
    else:
        initializers.append(initializer if initializer is not None else tensor)
    nodes.append(helper.make_node("Add", ["x", "c"], ["y"]))
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])]
    if subgraph:
        inputs.append(helper.make_tensor_value_info("cond", TensorProto.BOOL, []))
    graph = helper.make_graph(nodes, "g", inputs,
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])],
                              initializers)
    proto = helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 17)])
    for key, value in (metadata or {}).items():
        entry = proto.metadata_props.add()
        entry.key, entry.value = key, value
    return proto.SerializeToString()


def external(name: str = "c") -> TensorProto:
    tensor = numpy_helper.from_array(np.ones(3, np.float32), name)
    tensor.ClearField("raw_data")
    tensor.data_location = TensorProto.EXTERNAL
    entry = tensor.external_data.add()
    entry.key, entry.value = "location", "../../etc/shadow"
    return tensor


def test_the_real_artifacts_read_as_onnx_reads_them() -> None:
    """The built-in model's, and whatever other exports the tests left in the shared cache."""
    shared_model_artifact()
    paths = sorted((SHARED_MODEL_CACHE / "onnx").glob("*.onnx"))
    assert any(p.name.startswith("efficientnet_lite0-") for p in paths), paths
    for path in paths:
        data = path.read_bytes()
        expected = {e.key: e.value for e in onnx.load_from_string(data).metadata_props}
        assert expected, path  # at least the cache key
        assert onnx_wire.metadata(data) == expected, path
        assert not onnx_wire.has_external_data(data), path


@pytest.mark.parametrize("where", ["initializer", "node attribute", "subgraph"])
def test_a_tensor_in_an_external_file_is_refused_wherever_it_sits(where: str) -> None:
    data = (model(initializer=external(), metadata={"k": "v"}) if where == "initializer"
            else model(node_tensor=external("value"), metadata={"k": "v"},
                       subgraph=where == "subgraph"))
    assert onnx_wire.has_external_data(data)
    with pytest.raises(ArtifactRefused, match="external data"):
        check_self_contained(data, "v", "k")
    assert not onnx_wire.has_external_data(model(metadata={"k": "v"}))
    assert check_self_contained(model(metadata={"k": "v"}), "v", "k") == {"k": "v"}


def test_the_key_is_looked_up_in_the_metadata() -> None:
    data = model(metadata={"inboxd.cache_key": "abc", "other": "é ✓"})
    assert onnx_wire.metadata(data) == {"inboxd.cache_key": "abc", "other": "é ✓"}
    with pytest.raises(ArtifactRefused, match="built for other"):
        check_self_contained(data, "abd")
    with pytest.raises(ArtifactRefused, match="no inboxd cache key"):
        check_self_contained(model(), "abc")


@pytest.mark.parametrize("damage", ["truncated", "garbage", "overlong varint", "group",
                                    "bad utf-8"])
def test_malformed_bytes_are_refused_not_crashed_on(damage: str) -> None:
    data = model(metadata={"inboxd.cache_key": "abc"})
    broken = {
        "truncated": data[: len(data) - 7],
        "garbage": b"\x00garbage" * 100,
        "overlong varint": b"\x08" + b"\xff" * 11,
        "group": b"\x0b\x0c",
        "bad utf-8": b"\x72\x08\x0a\x02\xff\xfe\x12\x02ok",
    }[damage]
    with pytest.raises(ArtifactRefused, match="not a readable ONNX model"):
        check_self_contained(broken, "abc")


def test_the_test_s_own_model_is_one_onnx_runtime_runs() -> None:
    """The test's own model is valid ONNX (else the refusals above would prove little)."""
    import onnxruntime as ort

    session = ort.InferenceSession(model(metadata={"k": "v"}))
    out = session.run(["y"], {"x": np.zeros(3, np.float32)})[0]
    assert out.tolist() == [1.0, 1.0, 1.0]
    assert session.get_modelmeta().custom_metadata_map == {"k": "v"}
