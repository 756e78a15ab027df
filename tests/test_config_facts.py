"""The configuration's facts are written in several places: the pydantic model (config.py, the
one that is obeyed), the shipped config/inboxd.yaml, and the README's key and capacity tables.
These tests hold the others to the model, so a default changed in one place only fails here
instead of misleading a reader."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from inboxd.config import Config

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "config" / "inboxd.yaml"
README = ROOT / "README.md"
DEFAULTS: dict[str, Any] = Config().model_dump(mode="json")
SECTIONS = {name for name, value in DEFAULTS.items() if isinstance(value, dict)}
# A commented-out key in the shipped YAML shows its default (one the device profile may change)
# or, where the default is unset, an example of a value.
COMMENTED_KEY = re.compile(r"^  # (\w+): ([^#]+?)\s*(#.*)?$")
SECTION_LINE = re.compile(r"^(\w+):")
# Where the YAML spells out what the model's unset default means.
SAME_AS_UNSET = {"model.name": "efficientnet_lite0"}  # no model named: the built-in


def _default(section: str | None, key: str) -> Any:
    """The default of ``section.key``; ``key`` may itself be dotted (``detect.max_detections``)."""
    scope = DEFAULTS if section is None else DEFAULTS[section]
    *parents, leaf = key.split(".")
    for parent in parents:
        assert isinstance(scope.get(parent), dict), f"{section}.{key}: no such key in config.py"
        scope = scope[parent]
    assert leaf in scope, f"{section or 'top level'}.{key}: no such key in config.py"
    return scope[leaf]


def _set_keys(tree: dict[str, Any], section: str | None = None) -> list[tuple[str, Any, Any]]:
    """(dotted key, shipped value, model default) for every key the YAML sets."""
    found = []
    for key, value in tree.items():
        if isinstance(value, dict) and section is None and key in SECTIONS:
            found += _set_keys(value, key)
            continue
        name = key if section is None else f"{section}.{key}"
        if isinstance(value, dict):  # a mapping value (model.input, model.ray): its keys
            default = _default(section, key) or {}
            found += [(f"{name}.{k}", v, default.get(k)) for k, v in value.items()]
        else:
            found.append((name, value, _default(section, key)))
    return found


def test_the_shipped_yaml_sets_the_models_defaults() -> None:
    shipped = yaml.safe_load(SHIPPED.read_text())
    keys = _set_keys(shipped)
    assert len(keys) > 25, f"the scan must see the whole file, found {len(keys)} keys"
    wrong = [f"{name}: {value!r} in the YAML, {default!r} in config.py"
             for name, value, default in keys
             if value != default and not (default is None and SAME_AS_UNSET.get(name) == value)]
    assert wrong == []


def test_the_shipped_yamls_commented_keys_show_the_defaults() -> None:
    section = None
    shown = []
    for line in SHIPPED.read_text().splitlines():
        if match := SECTION_LINE.match(line):
            section = match.group(1) if match.group(1) in SECTIONS else None
        elif (match := COMMENTED_KEY.match(line)) and section is not None:
            key, text = match.group(1), match.group(2)
            default = _default(section, key)
            if default is not None:  # None: unset by default, the line is an example
                shown.append((f"{section}.{key}", yaml.safe_load(text), default))
    assert len(shown) >= 5, f"found {len(shown)} commented defaults"
    wrong = [f"{name}: {value!r} in the YAML's comment, {default!r} in config.py"
             for name, value, default in shown if value != default]
    assert wrong == []


def _table_rows(heading: str) -> list[list[str]]:
    """The cells of the first table after ``heading`` in the README."""
    text = README.read_text()
    start = text.index(heading)
    rows = []
    for line in text[start:].splitlines():
        if line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip("|").split("|")])
        elif rows:
            break
    return rows[2:]  # past the header and its rule


def test_the_readmes_key_table_names_every_key_of_its_blocks() -> None:
    wrong = []
    rows = _table_rows("| block | what it sets |")
    assert len(rows) >= 6, f"found {len(rows)} rows"
    for block, keys in rows:
        sections = re.findall(r"`(\w+):`", block)
        named = set(re.findall(r"`(\w+)`", re.sub(r"\([^)]*\)", "", keys)))
        if len(sections) != 1 or not named:
            continue  # a row that points elsewhere ("the bounds above", Models)
        section = sections[0]
        wrong += [f"{section}.{k}: in the README, not in config.py" for k in named
                  if k not in DEFAULTS[section]]
        wrong += [f"{section}.{k}: in config.py, not in the README's row" for k in
                  DEFAULTS[section] if k not in named]
    assert wrong == []


def test_the_readmes_capacity_defaults_are_the_models() -> None:
    checked, wrong = 0, []
    for layer, key_cell, default_cell, _ in _table_rows("| layer | key | default (CPU) |"):
        keys = re.findall(r"`([\w.]+)`", key_cell)
        if not keys or "×" in key_cell:
            continue  # fixed, or a product of keys
        section, _, first = keys[0].partition(".")
        # "`capacity.preprocess_cache`, `_mb`": the second is the first's name with a suffix.
        names = [first] + [first + k if k.startswith("_") else k.partition(".")[2]
                           for k in keys[1:]]
        if [_default(section, name) for name in names] == [None]:
            # Unset by default (capacity.task_join): the cell says what that means.
            checked += 1
            if not default_cell.startswith("unset"):
                wrong.append(f"{section}.{first}: unset in config.py, {default_cell!r} in the "
                             "README")
            continue
        numbers = [int(n) for n in re.findall(r"\d+", re.sub(r"\([^)]*\)", "",
                                                              default_cell))]
        assert len(numbers) == len(names), f"{layer}: cannot read {default_cell!r}"
        for name, number in zip(names, numbers, strict=True):
            checked += 1
            if _default(section, name) != number:
                wrong.append(f"{section}.{name}: {number} in the README, "
                             f"{_default(section, name)} in config.py")
    assert checked >= 6, f"checked {checked} defaults"
    assert wrong == []
