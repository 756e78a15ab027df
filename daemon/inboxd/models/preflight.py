"""The files a model config names, checked without importing torch.

``inboxd check-config`` runs these checks too (they take milliseconds, while importing torch
takes seconds), so a wrong path or a short labels file is caught before any deploy; the checks
that need torch (shapes, the device) run when the model is loaded (``inboxd.models.loading``).
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

from inboxd.config import ConfigError, ModelConfig

SOURCE = "model"


def problem(message: str) -> ConfigError:
    return ConfigError(SOURCE, [message])


def unreadable(key: str, path: Path, what: str) -> str | None:
    """Why ``path`` cannot be read as a file, or None when it can."""
    try:
        with open(path, "rb") as handle:
            handle.read(1)
    except IsADirectoryError:
        return f"{key}: {path} is a folder, not {what}"
    except OSError as exc:
        hint = " (inboxd never downloads model files: put it there first)" if (
            isinstance(exc, FileNotFoundError)) else ""
        return f"{key}: cannot read {path}: {exc.strerror or exc}{hint}"
    return None


def read_labels(path: Path) -> list[str]:
    """Class names in class-index order: a JSON list of strings, a JSON object
    ``{"0": "cat", ...}``, or plain text with one label per line (blank lines are skipped)."""
    why = unreadable("labels", path, "a labels file")
    if why is not None:
        raise problem(why)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise problem(f"labels: {path} is not UTF-8 text ({exc.reason})") from exc
    stripped = text.strip()
    if stripped.startswith(("[", "{")):
        labels = _json_labels(path, stripped)
    else:
        labels = [line.strip() for line in text.splitlines() if line.strip()]
    if not labels:
        raise problem(f"labels: {path} has no labels in it")
    return labels


def _json_labels(path: Path, text: str) -> list[str]:
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise problem(f"labels: {path} starts like JSON but is not valid JSON: {exc}") from exc
    if isinstance(data, dict) and all(isinstance(v, str) for v in data.values()):
        # {"0": "cat", "1": "dog"} as in Hugging Face's id2label: keys must be 0..n-1.
        keys = sorted(data, key=lambda k: int(k) if k.isdigit() else -1)
        if keys != [str(i) for i in range(len(data))]:
            raise problem(f"labels: the keys of the JSON object in {path} must be 0..n-1")
        return [data[k] for k in keys]
    if isinstance(data, list) and all(isinstance(v, str) for v in data):
        return list(data)
    raise problem(f"labels: {path} must hold a JSON list of strings (or an object "
                  '{"0": "name", ...}), or one label per line')


def label_count_problem(labels: list[str], path: Path, outputs: int, what: str) -> str | None:
    if len(labels) == outputs:
        return None
    return (f"labels: {path} has {len(labels)} labels but {what} has {outputs} outputs: "
            "the file needs one label per class, in class-index order")


def preflight(config: ModelConfig) -> list[str]:
    """Every problem with the model's files that can be seen without torch."""
    problems: list[str] = []
    if config.weights is not None:
        problems.append(unreadable("weights", config.weights, "a state_dict file") or "")
    if config.export is not None:
        why = unreadable("export", config.export, "a .pt2 program")
        if why is None and not zipfile.is_zipfile(config.export):
            why = (f"export: {config.export} is not a torch.export program "
                   "(a .pt2 file written by torch.export.save)")
        problems.append(why or "")
    if config.onnx is not None:
        problems.append(unreadable("onnx", config.onnx, "an ONNX model") or "")
    if config.labels is not None:
        try:
            labels = read_labels(config.labels)
        except ConfigError as exc:
            problems.extend(exc.problems)
        else:
            if config.num_classes is not None:
                what = f"num_classes: {config.num_classes}"
                problems.append(label_count_problem(labels, config.labels, config.num_classes,
                                                    f"the model ({what})") or "")
    # Prefixed as config keys: check-config reports them under the file's name.
    return [f"model.{p}" for p in problems if p]
