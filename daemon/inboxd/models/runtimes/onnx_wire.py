"""What a cached artifact's check needs from an ONNX file, read from its protobuf wire format:
its metadata, and whether any tensor in it lives in an external file.

Without the ``onnx`` package: importing it costs a second of CPU at every start of a daemon that
serves the cached artifact (its ``ml_dtypes`` dependency), which is half of such a start, for
two facts that sit in a few fields. Only the fields named below are decoded; everything else,
the tensors' bytes included, is stepped over by its length. Any malformed byte raises
``MalformedOnnx``: the caller refuses the file, which is then exported again.
"""

from __future__ import annotations

from collections.abc import Iterator

# Field numbers from onnx.proto (onnx/onnx-ml.proto, IR version 10).
MODEL_GRAPH, MODEL_METADATA, MODEL_FUNCTIONS = 7, 14, 25
ENTRY_KEY, ENTRY_VALUE = 1, 2
GRAPH_NODES, GRAPH_INITIALIZERS, GRAPH_SPARSE_INITIALIZERS = 1, 5, 15
FUNCTION_NODES = 7
NODE_ATTRIBUTES = 5
ATTRIBUTE_TENSOR, ATTRIBUTE_GRAPH, ATTRIBUTE_TENSORS, ATTRIBUTE_GRAPHS = 5, 6, 10, 11
ATTRIBUTE_SPARSE_TENSOR, ATTRIBUTE_SPARSE_TENSORS = 22, 23
SPARSE_VALUES, SPARSE_INDICES = 1, 2
TENSOR_EXTERNAL_DATA, TENSOR_DATA_LOCATION = 13, 14
DATA_LOCATION_EXTERNAL = 1

VARINT, FIXED64, LENGTH_DELIMITED, FIXED32 = 0, 1, 2, 5
# Subgraphs (an If's branches, a Loop's body) nest; an honest export nests a few levels.
MAX_DEPTH = 32


class MalformedOnnx(ValueError):
    """The bytes are not a well-formed ONNX protobuf."""


def metadata(data: bytes) -> dict[str, str]:
    """The model's ``metadata_props`` as a dict (a key given twice: the last one, as onnx's
    own reading would keep it)."""
    found: dict[str, str] = {}
    view = memoryview(data)
    for number, wire, start, end in _fields(view, 0, len(view)):
        if number == MODEL_METADATA and wire == LENGTH_DELIMITED:
            key = value = ""
            for entry, entry_wire, at, stop in _fields(view, start, end):
                if entry_wire == LENGTH_DELIMITED and entry in (ENTRY_KEY, ENTRY_VALUE):
                    text = _text(view[at:stop])
                    key, value = (text, value) if entry == ENTRY_KEY else (key, text)
            found[key] = value
    return found


def has_external_data(data: bytes) -> bool:
    """Whether any tensor, anywhere ONNX Runtime looks for one (initializers, sparse ones,
    node attributes, subgraphs, functions), says its bytes are in another file."""
    view = memoryview(data)
    for number, wire, start, end in _fields(view, 0, len(view)):
        if wire != LENGTH_DELIMITED:
            continue
        if number == MODEL_GRAPH and _graph_external(view, start, end, 0):
            return True
        if number == MODEL_FUNCTIONS and _nodes_external(view, start, end, FUNCTION_NODES, 0):
            return True
    return False


def _graph_external(view: memoryview, start: int, end: int, depth: int) -> bool:
    if depth > MAX_DEPTH:
        raise MalformedOnnx(f"subgraphs nested deeper than {MAX_DEPTH}")
    for number, wire, at, stop in _fields(view, start, end):
        if wire != LENGTH_DELIMITED:
            continue
        if number == GRAPH_INITIALIZERS and _tensor_external(view, at, stop):
            return True
        if number == GRAPH_SPARSE_INITIALIZERS and _sparse_external(view, at, stop):
            return True
        if number == GRAPH_NODES and _node_external(view, at, stop, depth):
            return True
    return False


def _nodes_external(view: memoryview, start: int, end: int, field: int, depth: int) -> bool:
    return any(number == field and wire == LENGTH_DELIMITED
               and _node_external(view, at, stop, depth)
               for number, wire, at, stop in _fields(view, start, end))


def _node_external(view: memoryview, start: int, end: int, depth: int) -> bool:
    for number, wire, at, stop in _fields(view, start, end):
        if number != NODE_ATTRIBUTES or wire != LENGTH_DELIMITED:
            continue
        for attribute, attribute_wire, a, b in _fields(view, at, stop):
            if attribute_wire != LENGTH_DELIMITED:
                continue
            if attribute in (ATTRIBUTE_TENSOR, ATTRIBUTE_TENSORS) and _tensor_external(view, a, b):
                return True
            if (attribute in (ATTRIBUTE_SPARSE_TENSOR, ATTRIBUTE_SPARSE_TENSORS)
                    and _sparse_external(view, a, b)):
                return True
            if (attribute in (ATTRIBUTE_GRAPH, ATTRIBUTE_GRAPHS)
                    and _graph_external(view, a, b, depth + 1)):
                return True
    return False


def _sparse_external(view: memoryview, start: int, end: int) -> bool:
    return any(number in (SPARSE_VALUES, SPARSE_INDICES) and wire == LENGTH_DELIMITED
               and _tensor_external(view, at, stop)
               for number, wire, at, stop in _fields(view, start, end))


def _tensor_external(view: memoryview, start: int, end: int) -> bool:
    for number, wire, at, _ in _fields(view, start, end):
        if number == TENSOR_EXTERNAL_DATA and wire == LENGTH_DELIMITED:
            return True  # an external_data entry at all: ONNX Runtime would follow it
        if (number == TENSOR_DATA_LOCATION and wire == VARINT
                and _varint(view, at)[0] == DATA_LOCATION_EXTERNAL):
            return True
    return False


def _fields(view: memoryview, start: int, end: int) -> Iterator[tuple[int, int, int, int]]:
    """Each field of the message in ``view[start:end]``: (number, wire type, where its value
    starts, where it ends). A varint's value starts at ``start`` of its bytes."""
    at = start
    while at < end:
        tag, at = _varint(view, at)
        number, wire = tag >> 3, tag & 7
        if number == 0:
            raise MalformedOnnx("a field numbered 0")
        if wire == VARINT:
            _, stop = _varint(view, at)
        elif wire == FIXED64:
            stop = at + 8
        elif wire == FIXED32:
            stop = at + 4
        elif wire == LENGTH_DELIMITED:
            length, at = _varint(view, at)
            stop = at + length
        else:  # groups (3, 4) are not in ONNX; 6 and 7 are not wire types
            raise MalformedOnnx(f"wire type {wire}")
        if stop > end:
            raise MalformedOnnx("a field runs past its message")
        yield number, wire, at, stop
        at = stop


def _varint(view: memoryview, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if at >= len(view) or shift > 63:
            raise MalformedOnnx("a truncated or overlong varint")
        byte = view[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7


def _text(raw: memoryview) -> str:
    try:
        return bytes(raw).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MalformedOnnx("a string that is not UTF-8") from exc
