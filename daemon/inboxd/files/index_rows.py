"""What the index holds of one result: its document read into rows, per task section.

A result holds one section per task (DESIGN.md, "Tasks"): today's single ``model:`` result is
one section at the document's top level (``top_k`` or ``embedding``); with ``models:`` each task
has its section under its own name (and a ``tasks``/``models`` mapping of sections is read the
same way). Whatever a section says is read by what it holds, not by which model made it:
``top_k`` (labels with scores), ``detections`` (labelled boxes in the displayed photo's pixels),
``full_text``/``lines`` (OCR) and ``embedding`` (a vector, filed beside the JSON).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

# The one task of a single ``model:`` block.
SINGLE_TASK = "model"
SECTION_KEYS = ("top_k", "detections", "full_text", "lines", "embedding", "ocr")
# Mappings of task name → section, where a multi-task result may keep them.
TASK_CONTAINERS = ("tasks", "models")
# Top-level fields of every result that are never a task's section.
DOCUMENT_FIELDS = frozenset({"source", "filed_as", "sha256", "size_bytes", "source_identity",
                             "model", "model_sha256", "device", "runtime", "precision", "image",
                             "timings_ms", "attempts", "instance", "completed_at",
                             "inboxd_version", "embedding", *TASK_CONTAINERS})

VectorReader = Callable[[str], "npt.NDArray[np.float32] | None"]


@dataclass(frozen=True, slots=True)
class Label:
    task: str
    label: str
    score: float
    kind: str  # "class" (top-k) or "detection" (the best box of that label)


@dataclass(frozen=True, slots=True)
class Detection:
    task: str
    label: str
    score: float
    box: tuple[float, float, float, float]  # x0, y0, x1, y1 in the displayed photo's pixels


@dataclass(slots=True)
class IndexRow:
    name: str  # results/<name>.json
    sha256: str
    source: str  # the inbox key
    photo: str | None  # where the photo is now (done/…, the inbox); None: deleted
    model: str
    model_sha256: str | None
    instance: str
    size_bytes: int | None
    width: int | None
    height: int | None
    completed_at: str
    labels: list[Label] = field(default_factory=list)
    detections: list[Detection] = field(default_factory=list)
    texts: list[tuple[str, str]] = field(default_factory=list)  # (task, text)
    embeddings: list[tuple[str, npt.NDArray[np.float32]]] = field(default_factory=list)


def sections(document: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(task name, section) for every task section in a result document."""
    if any(key in document for key in SECTION_KEYS):
        yield SINGLE_TASK, document
    for container in TASK_CONTAINERS:
        tasks = document.get(container)
        if isinstance(tasks, dict):
            for task, section in tasks.items():
                if isinstance(section, dict):
                    yield str(task), section
    for key, value in document.items():
        if (key not in DOCUMENT_FIELDS and isinstance(value, dict)
                and any(item in value for item in SECTION_KEYS)):
            yield key, value


def row_of(name: str, document: dict[str, Any], photo: str | None,
           vector_of: VectorReader) -> IndexRow:
    """``document`` (filed as ``name``) as the index's row. ``vector_of(file)`` reads an
    embedding's vector by the file name its section gives (None: not there)."""
    image = document.get("image") if isinstance(document.get("image"), dict) else {}
    assert isinstance(image, dict)
    row = IndexRow(
        name=name, sha256=str(document.get("sha256") or ""),
        source=str(document.get("source") or name), photo=photo,
        model=str(document.get("model") or ""),
        model_sha256=_str_or_none(document.get("model_sha256")),
        instance=str(document.get("instance") or ""),
        size_bytes=_int_or_none(document.get("size_bytes")),
        width=_int_or_none(image.get("width")), height=_int_or_none(image.get("height")),
        completed_at=str(document.get("completed_at") or ""))
    for task, section in sections(document):
        _read_section(row, task, section, vector_of)
    return row


def _read_section(row: IndexRow, task: str, section: dict[str, Any],
                  vector_of: VectorReader) -> None:
    for entry in _dicts(section.get("top_k")):
        if isinstance(entry.get("label"), str) and _is_number(entry.get("score")):
            row.labels.append(Label(task, entry["label"], float(entry["score"]), "class"))
    best: dict[str, float] = {}
    for entry in _dicts(section.get("detections")):
        box, label, score = entry.get("box"), entry.get("label"), entry.get("score")
        if (isinstance(label, str) and isinstance(score, int | float) and isinstance(box, list)
                and len(box) == 4 and all(_is_number(v) for v in box)):
            row.detections.append(Detection(task, label, float(score),
                                            (float(box[0]), float(box[1]),
                                             float(box[2]), float(box[3]))))
            best[label] = max(best.get(label, 0.0), float(score))
    # A detected thing is found by its label too, at its best box's score.
    row.labels.extend(Label(task, label, score, "detection") for label, score in best.items())
    text = ocr_text(section)
    if text.strip():
        row.texts.append((task, text))
    embedding = section.get("embedding")
    if isinstance(embedding, dict) and isinstance(embedding.get("file"), str):
        vector = vector_of(embedding["file"])
        if vector is not None:
            row.embeddings.append((task, np.ascontiguousarray(vector, dtype=np.float32)))


def ocr_text(section: dict[str, Any]) -> str:
    """A section's text read in the photo: OCR's ``full_text`` (in its ``ocr`` part, or the
    section's own), else its lines joined."""
    reading = section.get("ocr") if isinstance(section.get("ocr"), dict) else section
    assert isinstance(reading, dict)
    text = reading.get("full_text")
    if isinstance(text, str):
        return text
    return "\n".join(str(line["text"]) for line in _dicts(reading.get("lines"))
                     if isinstance(line.get("text"), str))


def npy_reader(json_file: str) -> VectorReader:
    """Reads an embedding's ``.npy`` named relative to the folder of ``json_file``."""
    folder = os.path.dirname(json_file)

    def read(file: str) -> npt.NDArray[np.float32] | None:
        if os.path.basename(file) != file:
            return None  # a result only ever names a file beside it
        try:
            loaded = np.load(os.path.join(folder, file), allow_pickle=False)
        except (OSError, ValueError):
            return None
        return np.asarray(loaded, dtype=np.float32).reshape(-1)

    return read


def top_outcome(document: dict[str, Any], words: int = 6) -> str:
    """A few words of what the model saw, for the ``completed`` line: the top label and its
    score, the number of detections, or the first words of text."""
    said = []
    for task, section in sections(document):
        prefix = "" if task == SINGLE_TASK else f"{task}: "
        top = list(_dicts(section.get("top_k")))
        if top and isinstance(top[0].get("label"), str) and _is_number(top[0].get("score")):
            said.append(f"{prefix}{top[0]['label']} {float(top[0]['score']):.2f}")
        elif isinstance(section.get("detections"), list):
            said.append(f"{prefix}{len(section['detections'])} detections")
        elif isinstance(section.get("full_text"), str) or isinstance(section.get("ocr"), dict):
            first = " ".join(ocr_text(section).split()[:words])
            said.append(f"{prefix}text {first!r}" if first else f"{prefix}no text")
        elif isinstance(section.get("embedding"), dict):
            said.append(f"{prefix}embedding dim {section['embedding'].get('dim')}")
    return "; ".join(said)


def _dicts(value: Any) -> Iterator[dict[str, Any]]:
    if isinstance(value, list):
        yield from (entry for entry in value if isinstance(entry, dict))


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _int_or_none(value: Any) -> int | None:
    return int(value) if _is_number(value) else None


def _str_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None
