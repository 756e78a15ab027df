"""What a model wants its input to look like (set by the model, applied by the decoder)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

# fast: JPEGs decoded by libjpeg at a reduced scale (DCT scaling) and resized through Pillow's
# reducing_gap, within the fidelity contract (bench/fidelity.py); exact: torchvision's pixels;
# fastest (opt-in, outside the contract): DCT scaling right down to the target, as libvips'
# shrink-on-load does.
ResizeMode = Literal["fast", "exact", "fastest"]
RESIZE_MODES: tuple[ResizeMode, ...] = ("fast", "exact", "fastest")
# center_crop: the shorter side resized, a centred square cut out (classifiers, embedders).
# fit: the whole photo scaled to fit a square, aspect ratio kept, nothing cut and nothing padded
# (detectors, OCR): what a model that says *where* things are needs, since a crop would lose
# the edges and the model side pads each batch to its input (the letterbox) on its device.
# fit_within: as fit, but only ever smaller: a photo already inside the square keeps its pixels
# (OCR: its detector sizes its own input from the photo's, and an enlarged photo reads otherwise).
InputKind = Literal["center_crop", "fit", "fit_within"]
INPUT_KINDS: tuple[InputKind, ...] = ("center_crop", "fit", "fit_within")


def resize_mode(value: object) -> ResizeMode:
    """``value`` as a ResizeMode (a worker reads it from the daemon's request pipe)."""
    for mode in RESIZE_MODES:
        if value == mode:
            return mode
    raise ValueError(f"resize mode {value!r} is none of {', '.join(RESIZE_MODES)}")


def input_kind(value: object) -> InputKind:
    for kind in INPUT_KINDS:
        if value == kind:
            return kind
    raise ValueError(f"input kind {value!r} is none of {INPUT_KINDS}")


@dataclass(frozen=True, slots=True)
class PreprocessSpec:
    """How a model wants its input. ``center_crop``: resize the shorter side to ``resize``,
    then center-crop a ``crop``² square. ``fit``: scale the photo so that it fits ``crop``²
    with its aspect ratio kept (the longer side becomes ``crop``, up or down, as Ultralytics'
    letterbox does before it pads); ``resize`` equals ``crop`` then."""

    resize: int
    crop: int
    interpolation: str
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    # Set by the daemon's preprocess.resize, not by the model: a model describes its input,
    # and either mode gives that input. "exact" here, so a bare spec means torchvision's pixels.
    resize_mode: ResizeMode = "exact"
    kind: InputKind = "center_crop"

    @classmethod
    def fit(cls, size: int, interpolation: str, mean: tuple[float, float, float],
            std: tuple[float, float, float], resize_mode: ResizeMode = "exact"
            ) -> PreprocessSpec:
        return cls(size, size, interpolation, mean, std, resize_mode, "fit")

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> PreprocessSpec:
        """The spec ``dataclasses.asdict`` gave (a decode worker reads it from its pipe)."""
        mean, std = fields["mean"], fields["std"]
        return cls(int(fields["resize"]), int(fields["crop"]), str(fields["interpolation"]),
                   (float(mean[0]), float(mean[1]), float(mean[2])),
                   (float(std[0]), float(std[1]), float(std[2])),
                   resize_mode(fields["resize_mode"]), input_kind(fields.get("kind",
                                                                            "center_crop")))

    @property
    def max_output_bytes(self) -> int:
        """The most uint8 RGB bytes one decoded image of this spec holds."""
        return self.crop * self.crop * 3

    def output_size(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) of what a ``width``×``height`` (displayed) photo becomes."""
        if self.kind == "center_crop":
            return self.crop, self.crop
        if self.kind == "fit_within" and max(width, height) <= self.crop:
            return width, height
        return fit_size(width, height, self.crop)

    def accepts_shape(self, shape: tuple[int, ...]) -> bool:
        """Whether ``shape`` (H×W×3) can be this spec's output: a decoder's reply is checked
        against it, since the model side batches what it gets."""
        if len(shape) != 3 or shape[2] != 3:
            return False
        if self.kind == "center_crop":
            return shape[0] == shape[1] == self.crop
        return 1 <= shape[0] <= self.crop and 1 <= shape[1] <= self.crop \
            and (self.kind == "fit_within" or max(shape[0], shape[1]) == self.crop)

    def draft_scale(self, width: int, height: int, margin: float) -> float:
        """The scale (≤ 1) a JPEG may be decoded at by DCT scaling: ``margin`` times what the
        resize needs, so the antialiased resize after it still sees enough pixels."""
        if self.kind == "center_crop":
            return min(1.0, margin * self.resize / min(width, height))
        return min(1.0, margin * self.crop / max(width, height))


def fit_size(width: int, height: int, side: int) -> tuple[int, int]:
    """Ultralytics' letterbox arithmetic without the padding: the gain that makes the photo fit
    ``side``² and the rounded size at it (at least one pixel each way)."""
    gain = min(side / width, side / height)
    return max(1, min(side, round(width * gain))), max(1, min(side, round(height * gain)))


# torchvision's weights conventions for its classifiers (``ImageClassification`` transforms):
# what a bring-your-own classifier or embedder is fed where ``input:`` leaves a key unset.
TORCHVISION_INPUT = PreprocessSpec(
    resize=256, crop=224, interpolation="bilinear",
    mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225),
)
# 0-1 input, no per-channel normalisation: what Ultralytics models and torchvision's detectors
# (whose own transform normalises) take.
UNIT_SCALE = ((0.0, 0.0, 0.0), (1.0, 1.0, 1.0))
# The letterbox side of a detector whose graph and ``input.size`` leave it open: Ultralytics'
# export default.
DEFAULT_DETECT_SIDE = 640
# Every model is loaded and then run once on a batch of this many before it serves (loading,
# detect_model), and the ONNX probe runs that size too: said here, where no torch is imported.
PROBE_BATCH = 2
