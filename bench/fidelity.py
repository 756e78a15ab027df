"""The fidelity contract, measured: every fast path against the exact fp32 path on the corpus.

The reference is the exact path: ``preprocess.resize: exact`` (torchvision's pixels) and the
built-in model in eager fp32. Each row is one path: a decode (file bytes → the crop) and a
``predict`` (crops → softmax scores), so a model runtime is one more row with the exact decode
and its own ``predict``. Per row, over the corpus variants it applies to (``support/corpus.py``):
top-1 agreement with the reference, and |Δ top-1 score| — how far the path moves the score of
the class the reference put first — as median, p95 and max. The contract a default must hold:
agreement >= 99% and median |Δ| <= 0.01 (``tests/decode/test_fast_fidelity.py`` asserts it).

``--sweep`` adds the candidates the fast decode was chosen from (draft margin × reducing_gap)
with their decode time per 12-MP JPEG (``bench/photos.py``'s, one thread, candidates in turns).

    python -m bench.fidelity [--sweep] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
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

from support import corpus
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
    top1_agreement: float  # 0..1
    median_delta: float
    p95_delta: float
    max_delta: float
    changed: int  # variants whose scores moved at all (the rest got the reference's pixels)

    def holds(self) -> bool:
        return (self.top1_agreement >= MIN_TOP1_AGREEMENT
                and self.median_delta <= MAX_MEDIAN_TOP1_DELTA)

    def row(self) -> str:
        verdict = "holds" if self.holds() else "MISSES"
        return (f"| {self.name} | {self.n} | {self.changed} | {100 * self.top1_agreement:.1f} | "
                f"{self.median_delta:.4f} | {self.p95_delta:.4f} | {self.max_delta:.4f} | "
                f"{verdict} |")


HEADER = ("| path | n | changed | top-1 agreement % | median abs(Δ top-1) | p95 | max | "
          "contract |\n|---|---|---|---|---|---|---|---|")


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


def onnxruntime_predict() -> Predict:
    """The built-in model as the daemon serves it by default on the CPU: exported to ONNX (as
    ``models/onnx_export.py`` does, here in this process) and run by ONNX Runtime, fp32."""
    from inboxd.models.loading import load_network
    from inboxd.models.runtimes import onnx as onnx_runtime

    model = load_network(ModelConfig(device="cpu", precision="fp32"))
    data = onnx_runtime.export_bytes(model.network.cpu().eval(), model.spec.crop, None,
                                     "bench.fidelity")
    model.use(onnx_runtime.from_bytes(data, 2))
    return softmax_predict(model)


def model_spec() -> PreprocessSpec:
    from inboxd.models import efficientnet_lite as lite

    return PreprocessSpec(resize=lite.RESIZE_SHORTER_SIDE, crop=lite.CROP_SIZE,
                          interpolation=lite.RESIZE_INTERPOLATION, mean=lite.MEAN, std=lite.STD)


def resized_decode(spec: PreprocessSpec, resizing: pillow.Resizing) -> Decode:
    return lambda data: pillow.decode_resized(data, spec, MAX_PIXELS, resizing).pixels


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


def sweep_paths(spec: PreprocessSpec, predict: Predict) -> list[FidelityPath]:
    """The candidates for the fast JPEG decode (margin 8 without a gap is ``exact``)."""
    return [FidelityPath(f"JPEG draft ≥{margin:g}×, reducing_gap {gap}",
                         resized_decode(spec, pillow.Resizing(margin, gap)), predict, is_jpeg)
            for margin in (1, 2, 4) for gap in (None, 2.0, 3.0)]


def compare(name: str, reference: torch.Tensor, scores: torch.Tensor) -> Agreement:
    ref_top1 = reference.argmax(dim=1)
    agree = float((scores.argmax(dim=1) == ref_top1).float().mean())
    rows = torch.arange(len(ref_top1))
    delta = (scores[rows, ref_top1] - reference[rows, ref_top1]).abs().numpy()
    changed = int((scores != reference).any(dim=1).sum())
    return Agreement(name, len(delta), agree, float(np.median(delta)),
                     float(np.percentile(delta, 95)), float(delta.max()), changed)


class Corpus:
    """The corpus's bytes and the reference scores, computed once for every row."""

    def __init__(self, folder: Path, variants: Sequence[Variant], spec: PreprocessSpec,
                 predict: Predict) -> None:
        self.variants = list(variants)
        self.datas = [(folder / v.file).read_bytes() for v in self.variants]
        reference = mode_decode(spec, "exact")
        self.reference = predict([reference(d) for d in self.datas])

    def measure(self, path: FidelityPath) -> Agreement:
        chosen = [i for i, v in enumerate(self.variants) if path.applies(v)]
        scores = path.predict([path.decode(self.datas[i]) for i in chosen])
        return compare(path.name, self.reference[chosen], scores)


def ms_per_photo(decodes: dict[str, Decode], datas: Sequence[bytes],
                 repeats: int) -> dict[str, float]:
    """Median over rounds of the mean ms per photo; every decode takes one turn per round."""
    rounds: dict[str, list[float]] = {name: [] for name in decodes}
    for _ in range(repeats):
        for name, decode in decodes.items():
            started = time.perf_counter()
            for data in datas:
                decode(data)
            rounds[name].append((time.perf_counter() - started) * 1000 / len(datas))
    return {name: statistics.median(times) for name, times in rounds.items()}


def twelve_mp_jpegs() -> list[bytes]:
    from bench.photos import build_corpus

    photos = build_corpus(Path("bench/out/photos"), sizes=["12MP"], formats=["jpg"])
    return [p.path.read_bytes() for p in photos]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true",
                        help="also the draft margin × reducing_gap candidates, with decode ms")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--emit", action="store_true",
                        help="end with the table as one JSON line (for make bench)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    spec = model_spec()
    predict = eager_fp32_predict()
    folder, variants = corpus.build()
    data = Corpus(folder, variants, spec, predict)
    jpegs = sum(1 for v in variants if is_jpeg(v))
    print(f"corpus: {len(variants)} variants ({jpegs} JPEG) in {folder}; reference: "
          "resize exact + eager fp32")
    fast_runtime = onnxruntime_predict()
    defaults = [*default_decode_paths(spec, predict),
                FidelityPath("runtime onnxruntime fp32 (decode exact)", mode_decode(spec, "exact"),
                             fast_runtime),
                FidelityPath("every default at once: decode fast + onnxruntime fp32",
                             mode_decode(spec, "fast"), fast_runtime)]
    rows = [data.measure(path).row() for path in defaults]
    print(HEADER)
    print("\n".join(rows))
    if args.emit:
        print(json.dumps({"variants": len(variants), "jpegs": jpegs, "header": HEADER,
                          "rows": rows}))
    if not args.sweep:
        return
    candidates = sweep_paths(spec, predict)
    try:
        import pyvips  # noqa: F401  (pyproject's `vips` extra: a benchmark's, not the daemon's)
    except ImportError:
        print("(no libvips rows: pip install -e '.[bench]')")
    else:
        from bench.decoders import vips_crop, vips_margin_crop

        candidates += [
            FidelityPath("libvips thumbnail (JPEG, WebP, PNG: its libheif has no HEVC)",
                         lambda data: vips_crop(data, spec.resize, spec.crop), predict,
                         lambda v: v.fmt != "HEIC"),
            FidelityPath("libvips shrink-on-load to ≥4× + resize (cubic), JPEG",
                         lambda data: vips_margin_crop(data, spec.resize, spec.crop), predict,
                         is_jpeg)]
    for path in candidates:
        print(data.measure(path).row())
    torch.set_num_threads(1)
    decodes = {"exact": mode_decode(spec, "exact"), "fast (default)": mode_decode(spec, "fast"),
               **{p.name: p.decode for p in candidates}}
    timings = ms_per_photo(decodes, twelve_mp_jpegs(), args.repeats)
    print("\n| decode | ms per 12-MP JPEG (one thread) |\n|---|---|")
    for name, ms in timings.items():
        print(f"| {name} | {ms:.1f} |")


if __name__ == "__main__":
    main()
