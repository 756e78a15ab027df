"""The three places a network comes from: the built-in, torchvision + a state_dict, a .pt2.

Each builder returns the network in eval mode on the CPU with what is known about it before it
runs once; a file that cannot work is a ``ConfigError`` naming the key, the file and the fix.
Nothing here ever downloads: torchvision architectures are built with ``weights=None``.
"""

from __future__ import annotations

import contextlib
import difflib
import os
import re
import warnings
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sympy
import torch
from torch import nn

from inboxd.config import ModelConfig
from inboxd.decode.spec import TORCHVISION_INPUT, PreprocessSpec
from inboxd.models.builtin_weights import BUILTIN_NAME, builtin_description
from inboxd.models.preflight import problem

IMAGENET_CLASSES = 1000
_SHOWN = 3  # mismatching keys named in an error, per kind of mismatch


@dataclass
class Source:
    name: str  # the "model" field of every result
    network: nn.Module  # eval mode (a .pt2 program is always in the mode it was exported in)
    defaults: PreprocessSpec  # what the input keys default to
    description: str
    classes: int | None  # known before running: the built-in and torchvision models
    max_batch: int | None = None  # a .pt2 program's bound on its batch dimension
    input_size: tuple[int, int] | None = None  # a .pt2 program's fixed height × width
    input_dtype: torch.dtype = torch.float32  # what a .pt2 program was exported to take
    output_names: list[str] = field(default_factory=list)  # a .pt2 program's, where it names them


def builtin() -> Source:
    from inboxd.models import efficientnet_lite as lite

    try:
        path = lite.builtin_weights_path()
    except lite.BuiltinWeightsError as exc:
        raise problem(str(exc)) from exc
    spec = PreprocessSpec(resize=lite.RESIZE_SHORTER_SIDE, crop=lite.CROP_SIZE,
                          interpolation=lite.RESIZE_INTERPOLATION, mean=lite.MEAN, std=lite.STD)
    network = lite.fold_batchnorm(lite.load_efficientnet_lite0(path))
    return Source(BUILTIN_NAME, network, spec, builtin_description(path), lite.NUM_CLASSES)


# -- torchvision + a state_dict -------------------------------------------------------------


def torchvision_model(config: ModelConfig, label_count: int | None) -> Source:
    import torchvision

    assert config.torchvision is not None and config.weights is not None
    name = config.torchvision
    classifiers = torchvision.models.list_models(module=torchvision.models)
    if name not in classifiers:
        raise problem(_unknown_architecture(name, classifiers, torchvision.models.list_models()))
    state = load_state_dict(config.weights)
    classes = config.num_classes or label_count or IMAGENET_CLASSES
    with warnings.catch_warnings():
        # Some builders warn that weights=None initialises randomly: the state_dict replaces it.
        warnings.simplefilter("ignore")
        network = torchvision.models.get_model(name, weights=None, num_classes=classes)
    mismatch = state_dict_mismatch(network, state)
    if mismatch:
        raise problem(f"weights: {config.weights} does not fit torchvision {name} with "
                      f"num_classes {classes}: {mismatch}")
    network.load_state_dict(state, strict=True)
    return Source(name, network.eval(), TORCHVISION_INPUT,
                  f"torchvision {name}, weights {config.weights}", classes)


def _unknown_architecture(name: str, classifiers: list[str], everything: list[str]) -> str:
    if name in everything:
        return (f"torchvision: {name} is not an image classifier (it is a detection, "
                "segmentation, video or optical-flow model); inboxd runs classifiers and "
                "embedders; for anything else, export a program that returns one tensor")
    close = difflib.get_close_matches(name, classifiers, n=3)
    hint = f"did you mean {' or '.join(close)}? " if close else ""
    return (f"torchvision: unknown architecture {name!r}; {hint}`inboxd models --torchvision` "
            f"lists all {len(classifiers)}")


def load_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """A plain state_dict, read with ``weights_only=True``: a file that could run code when
    unpickled is refused, whatever else it holds."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(4)
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError as exc:
        raise problem(f"weights: cannot read {path}: no such file (inboxd never downloads "
                      "weights: save them there with torch.save(model.state_dict(), PATH))"
                      ) from exc
    except OSError as exc:
        raise problem(f"weights: cannot read {path}: {exc.strerror or exc}") from exc
    except Exception as exc:
        raise problem(_unloadable(path, head, exc)) from exc
    if isinstance(loaded, dict) and loaded and all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in loaded.items()
    ):
        return loaded
    raise problem(f"weights: {path} is not a state_dict (a dict of tensors){_inside(loaded)}")


def _unloadable(path: Path, head: bytes, exc: Exception) -> str:
    # torch.save writes a zip archive (a pickle before torch 1.6); anything else is not one.
    if not head.startswith((b"PK", b"\x80")):
        return f"weights: {path} is not a file torch.save wrote"
    found = re.search(r"GLOBAL (\S+) was not an allowed global", str(exc))
    if found is not None:
        return (f"weights: {path} holds a pickled {found[1]}, and loading it would need "
                "torch.load(weights_only=False), which can run arbitrary code, so inboxd "
                "refuses it. A whole model saved with torch.save(model) is such a file: save "
                "only its tensors with torch.save(model.state_dict(), PATH)")
    return (f"weights: {path} cannot be read by torch.load(weights_only=True): "
            f"{type(exc).__name__}: {str(exc)[:200]}")


def _inside(loaded: Any) -> str:
    """Where the state_dict sits in a training checkpoint, as a hint."""
    if isinstance(loaded, dict):
        for key, value in loaded.items():
            if isinstance(value, dict) and value and all(
                isinstance(v, torch.Tensor) for v in value.values()
            ):
                return (f"; it looks like a training checkpoint with the weights under "
                        f"{key!r}: save those alone with torch.save(checkpoint[{key!r}], PATH)")
        return f"; its keys are {', '.join(map(str, list(loaded)[:5]))}"
    return f"; it holds a {type(loaded).__name__}"


def state_dict_mismatch(network: nn.Module, state: dict[str, torch.Tensor]) -> str:
    """What keeps ``state`` from loading strictly into ``network``, with a hint; "" if nothing.

    ``load_state_dict`` would say it too, but as one long RuntimeError listing every key; the
    first few keys and the likely cause are what a person fixing a config needs.
    """
    expected = network.state_dict()
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    shapes = [f"{k} is {list(state[k].shape)} in the file but {list(v.shape)} in the model"
              for k, v in expected.items() if k in state and state[k].shape != v.shape]
    parts = []
    if shapes:
        parts.append(f"shape mismatch: {_first(shapes)}")
    if missing:
        parts.append(f"missing keys: {_first(missing)}")
    if unexpected:
        parts.append(f"unexpected keys: {_first(unexpected)}")
    if not parts:
        return ""
    return "; ".join(parts) + _mismatch_hint(network, state, unexpected)


def _first(items: list[str]) -> str:
    more = f" (and {len(items) - _SHOWN} more)" if len(items) > _SHOWN else ""
    return ", ".join(items[:_SHOWN]) + more


def _mismatch_hint(network: nn.Module, state: dict[str, torch.Tensor],
                   unexpected: list[str]) -> str:
    if unexpected and all(k.startswith("module.") for k in unexpected):
        return (". The keys start with 'module.' (saved from DataParallel/DDP): save "
                "model.module.state_dict() instead")
    head = last_linear(network)
    if head is not None:
        key = f"{head[0]}.weight"
        if key in state and state[key].ndim == 2 and state[key].shape[0] != head[1].out_features:
            return f". The file has {state[key].shape[0]} classes: set num_classes to that"
    return ". Are these weights for this architecture?"


def last_linear(network: nn.Module) -> tuple[str, nn.Linear] | None:
    """The classifier: the last ``nn.Linear`` registered, which in every torchvision classifier
    and the built-in is the final layer (checked when the model is probed)."""
    linears = [(n, m) for n, m in network.named_modules() if isinstance(m, nn.Linear)]
    return linears[-1] if linears else None


# -- a torch.export program -----------------------------------------------------------------

# Archive members that torch.export.load unpickles with plain pickle whatever we ask: custom and
# opaque script objects. Vision models never need them, so an archive with them is refused.
_PICKLED_MEMBERS = ("/data/constants/custom_obj_", "/data/constants/opaque_obj_")


def export_program(config: ModelConfig, device: torch.device) -> Source:
    assert config.export is not None
    path = config.export
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except FileNotFoundError as exc:
        raise problem(f"export: cannot read {path}: no such file") from exc
    except (OSError, zipfile.BadZipFile) as exc:
        raise problem(f"export: {path} is not a torch.export program (a .pt2 file written by "
                      f"torch.export.save): {exc}") from exc
    if any(marker in name for name in names for marker in _PICKLED_MEMBERS):
        raise problem(f"export: {path} carries pickled Python objects (custom or opaque "
                      "objects), which could run code when loaded; export a plain tensor program")
    try:
        with _weights_only_loads():
            program = torch.export.load(path)
    except Exception as exc:
        raise problem(f"export: cannot load {path} with torch {torch.__version__}: "
                      f"{type(exc).__name__}: {str(exc)[:300]} (a .pt2 must come from "
                      "torch.export.save, ideally with the same torch version)") from exc
    max_batch, input_size, input_dtype = _input_signature(program, path)
    if device.type != "cpu":
        from torch.export.passes import move_to_device_pass

        # Tensors the graph creates itself carry the device they were exported on.
        program = move_to_device_pass(program, device)
    return Source(path.name, program.module(), TORCHVISION_INPUT,
                  f"torch.export program {path}", None, max_batch, input_size, input_dtype,
                  _output_names(program))


@contextlib.contextmanager
def _weights_only_loads() -> Iterator[None]:
    """Make every ``torch.load`` inside ``torch.export.load`` use ``weights_only=True``, even
    where it passes False (it does for tensor subclasses and its legacy format)."""
    key = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"
    before = os.environ.get(key)
    os.environ[key] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ[key]
        else:
            os.environ[key] = before


def _input_signature(program: Any, path: Path
                     ) -> tuple[int | None, tuple[int, int] | None, torch.dtype]:
    """The batch bound, fixed height × width and dtype, from the program's one input: N×3×H×W
    with a dynamic N."""
    inputs = [node for node in program.graph.nodes
              if node.op == "placeholder" and node.name in program.graph_signature.user_inputs]
    value = inputs[0].meta.get("val") if len(inputs) == 1 else None
    if value is None or not isinstance(value, torch.Tensor):
        raise problem(f"export: {path} must take exactly one tensor input (a N×3×H×W batch), "
                      f"it takes {len(inputs)} inputs")
    shape = tuple(value.shape)
    if len(shape) != 4 or shape[1] != 3:
        raise problem(f"export: {path} takes a {list(shape)} input; inboxd feeds N×3×H×W")
    if isinstance(shape[0], int):
        raise problem(
            f"export: {path} was exported for a fixed batch of {shape[0]}; inboxd sends batches "
            "of varying size: export with dynamic_shapes={'x': {0: torch.export.Dim('batch')}}"
        )
    bound = program.range_constraints.get(shape[0].node.expr)
    upper = getattr(bound, "upper", None)
    # An unbounded Dim's upper end is torch's own int_oo, which is no sympy Integer.
    max_batch = int(upper) if isinstance(upper, (int, sympy.Integer)) else None
    height, width = shape[2], shape[3]
    fixed = (height, width) if isinstance(height, int) and isinstance(width, int) else None
    return max_batch, fixed, value.dtype


def _output_names(program: Any) -> list[str]:
    """The keys of a program that returns a dict (a detector's ``boxes``, ``scores``,
    ``labels``); none for one that returns a tensor or a tuple."""
    spec = program.call_spec.out_spec
    if spec is not None and spec.type is dict:
        return [str(key) for key in spec.context]
    return []

