"""A daemon's YAML for a test or a benchmark run: every folder under one root."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
SHIPPED_CONFIG = REPO / "config" / "inboxd.yaml"


def shipped_config() -> dict[str, Any]:
    """The shipped config/inboxd.yaml as a dict: what ``make run`` runs, so what a benchmark
    measures."""
    loaded: dict[str, Any] = yaml.safe_load(SHIPPED_CONFIG.read_text()) or {}
    return loaded


def write_config(root: Path, base: dict[str, Any] | None = None,
                 sections: dict[str, Any] | None = None, name: str = "inboxd.yaml") -> Path:
    """``root/name``: ``base`` (None: nothing, the model's defaults), its inbox, results, done
    and failed folders under ``root``, then ``sections`` (a mapping merges into the section
    of that name, key by key; None removes the key, e.g. ``model=None`` beside ``models=``;
    anything else replaces it). Every inbox folder is made, as a user makes it before the
    daemon starts (one that does not exist is a configuration error)."""
    config = copy.deepcopy(base or {})
    config.setdefault("inbox", {})["paths"] = [str(root / "inbox")]
    config.update(results_dir=str(root / "results"), done_dir=str(root / "done"),
                  failed_dir=str(root / "failed"))
    for key, value in (sections or {}).items():
        if value is None:
            config.pop(key, None)
        elif isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key] = {**config[key], **value}
        else:
            config[key] = value
    for inbox in map(Path, config.get("inbox", {}).get("paths", [])):
        if not inbox.exists():  # (a test may give a file there, to see it refused)
            inbox.mkdir(parents=True)
    path = root / name
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path
