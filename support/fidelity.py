"""The fidelity contract, measured: a decode-and-predict path against the exact fp32 path.

The reference is the exact path: ``preprocess.resize: exact`` (torchvision's pixels) and the
built-in model in eager fp32. Each path is a decode (file bytes → the crop) and a ``predict``
(crops → softmax scores), so a model runtime is one more path with the exact decode and its own
``predict``. Per path, over the corpus variants it applies to (``support/corpus.py``): top-1
agreement with the reference, and |Δ top-1 score| — how far the path moves the score of the
class the reference put first — as median, p95 and max. The contract a default must hold:
agreement >= 99% and median |Δ| <= 0.01. ``tests/decode/test_fast_fidelity.py`` asserts it;
``bench/fidelity.py`` prints the table, with the candidates the defaults were chosen from.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from inboxd.config import ModelConfig
from inboxd.decode import pillow
from inboxd.decode.spec import PreprocessSpec
from inboxd.models.model import Model

from support.corpus import Variant

Crop = np.ndarray
Predict = Callable[[Sequence[Crop]], torch.Tensor]  # crops -> N×classes softmax scores
Decode = Callable[[bytes], Crop]
MAX_PIXELS = 89_478_485
MIN_TOP1_AGREEMENT = 0.99
MAX_MEDIAN_TOP1_DELTA = 0.01
BATCH = 32


@dataclass(frozen=True)
class FidelityPath:
    name: str
    decode: Decode
    predict: Predict
    applies: Callable[[Variant], bool] = lambda variant: True


@dataclass(frozen=True, slots=True)
class Agreement:
    name: str
    n: int
    top1_agreement: float  # 0..1, over every variant (raw)
    decisive: int  # variants whose reference top-1 leads its runner-up by DECISIVE_MARGIN
    decisive_agreement: float  # 0..1, over those: what the contract counts
    median_delta: float
    p95_delta: float
    max_delta: float
    changed: int  # variants whose scores moved at all (the rest got the reference's pixels)
    flips: tuple[str, ...] = ()  # "file: reference top-1 → this path's (margin)"

    def holds(self) -> bool:
        return (self.decisive_agreement >= MIN_TOP1_AGREEMENT
                and self.median_delta <= MAX_MEDIAN_TOP1_DELTA)

    def row(self, source: str = "") -> str:
        verdict = "holds" if self.holds() else "MISSES"
        where = f"{source} | " if source else ""
        return (f"| {where}{self.name} | {self.n} | {self.changed} | "
                f"{100 * self.decisive_agreement:.1f} of {self.decisive} | "
                f"{100 * self.top1_agreement:.1f} | {len(self.flips)} | "
                f"{self.median_delta:.4f} | {self.p95_delta:.4f} | {self.max_delta:.4f} | "
                f"{verdict} |")


HEADER = ("| source | path | n | changed | decisive top-1 agreement % | raw top-1 agreement % | "
          "flips | median abs(Δ top-1) | p95 | max | contract |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|")
# A reference top-1 that leads its runner-up by less than this is a near-tie, not a decision:
# a flip between two classes the exact path itself cannot tell apart is no change of answer.
DECISIVE_MARGIN = 0.02
ORIGINS = ("upscaled", "real")


def eager_fp32_predict() -> Predict:
    """The built-in model as the daemon loads it, in eager fp32 on the CPU: the reference."""
    from inboxd.models.loading import load_network

    return softmax_predict(load_network(ModelConfig(device="cpu", precision="fp32")))


def softmax_predict(model: Model) -> Predict:
    def predict(crops: Sequence[Crop]) -> torch.Tensor:
        out = [torch.softmax(model.outputs(list(crops[i:i + BATCH])), dim=1)
               for i in range(0, len(crops), BATCH)]
        return torch.cat(out)

    return predict


def model_spec() -> PreprocessSpec:
    from inboxd.models import efficientnet_lite as lite

    return PreprocessSpec(resize=lite.RESIZE_SHORTER_SIDE, crop=lite.CROP_SIZE,
                          interpolation=lite.RESIZE_INTERPOLATION, mean=lite.MEAN, std=lite.STD)


def mode_decode(spec: PreprocessSpec, mode: Literal["fast", "exact"]) -> Decode:
    """What a decode worker does with ``preprocess.resize: <mode>``."""
    moded = replace(spec, resize_mode=mode)
    return lambda data: pillow.decode_image(data, moded, MAX_PIXELS).pixels


def is_jpeg(variant: Variant) -> bool:
    return variant.fmt == "JPEG"


def default_decode_paths(spec: PreprocessSpec, predict: Predict) -> list[FidelityPath]:
    """Every decode path ``preprocess.resize: fast`` (the default) takes, by format: JPEG
    drafts then reduces; the other formats only reduce."""
    fast = mode_decode(spec, "fast")
    gap = pillow.RESIZINGS["fast"]
    return [
        FidelityPath(f"decode fast, JPEG (draft ≥{gap.draft_margin:g}×, reducing_gap "
                     f"{gap.reducing_gap:g})", fast, predict, is_jpeg),
        FidelityPath(f"decode fast, HEIC/WebP/PNG (reducing_gap {gap.reducing_gap:g})", fast,
                     predict, lambda v: not is_jpeg(v)),
        FidelityPath("decode fast, all formats", fast, predict),
    ]


def compare(name: str, reference: torch.Tensor, scores: torch.Tensor,
            files: Sequence[str] = ()) -> Agreement:
    ref_top2 = reference.topk(2, dim=1)
    ref_top1 = ref_top2.indices[:, 0]
    margin = ref_top2.values[:, 0] - ref_top2.values[:, 1]
    top1 = scores.argmax(dim=1)
    same = top1 == ref_top1
    decisive = margin >= DECISIVE_MARGIN
    rows = torch.arange(len(ref_top1))
    delta = (scores[rows, ref_top1] - reference[rows, ref_top1]).abs().numpy()
    changed = int((scores != reference).any(dim=1).sum())
    names = list(files) or [str(i) for i in range(len(ref_top1))]
    flips = tuple(f"{names[i]}: {int(ref_top1[i])} → {int(top1[i])} (lead "
                  f"{float(margin[i]):.3f})" for i in range(len(ref_top1)) if not same[i])
    decisive_n = int(decisive.sum())
    decisive_agree = float(same[decisive].float().mean()) if decisive_n else 1.0
    return Agreement(name, len(delta), float(same.float().mean()), decisive_n, decisive_agree,
                     float(np.median(delta)), float(np.percentile(delta, 95)),
                     float(delta.max()), changed, flips)


class Corpus:
    """The corpora's bytes and the reference scores, computed once for every row."""

    def __init__(self, parts: Sequence[tuple[Path, Sequence[Variant]]], spec: PreprocessSpec,
                 predict: Predict) -> None:
        self.variants = [v for _, variants in parts for v in variants]
        self.datas = [(folder / v.file).read_bytes() for folder, variants in parts
                      for v in variants]
        reference = mode_decode(spec, "exact")
        self.reference = predict([reference(d) for d in self.datas])

    def measure(self, path: FidelityPath, origin: str | None = None) -> Agreement:
        """``path`` on the variants it applies to, of one ``origin`` (or every one)."""
        return dict(self.by_origin(path, [origin]))[origin]

    def by_origin(self, path: FidelityPath, origins: Sequence[str | None]
                  ) -> list[tuple[str | None, Agreement]]:
        """``path`` decoded and run once, compared per origin (None: all of them); an origin
        the path applies to none of is left out."""
        chosen = [i for i, v in enumerate(self.variants)
                  if path.applies(v) and any(o in (None, v.origin) for o in origins)]
        if not chosen:
            return []
        scores = path.predict([path.decode(self.datas[i]) for i in chosen])
        out = []
        for origin in origins:
            rows = [n for n, i in enumerate(chosen) if origin in (None, self.variants[i].origin)]
            if not rows:
                continue
            picked = [chosen[n] for n in rows]
            out.append((origin, compare(path.name, self.reference[picked], scores[rows],
                                        [self.variants[i].file for i in picked])))
        return out

    def origins(self) -> list[str]:
        return [o for o in ORIGINS if any(v.origin == o for v in self.variants)]
