"""The fidelity contract, measured: every fast path against the exact fp32 path on the corpus.

The reference is the exact path: ``preprocess.resize: exact`` (torchvision's pixels) and the
built-in model in eager fp32. Each row is one path: a decode (file bytes → the crop) and a
``predict`` (crops → softmax scores), so a model runtime is one more row with the exact decode
and its own ``predict``. Per row, over the corpus variants it applies to (``support/corpus.py``):
top-1 agreement with the reference, and |Δ top-1 score| — how far the path moves the score of
the class the reference put first — as median, p95 and max. The contract a default must hold:
agreement >= 99% and median |Δ| <= 0.01 (``tests/decode/test_fast_fidelity.py`` asserts it;
the measuring is ``support/fidelity.py``'s, shared with that test).

``--sweep`` adds the candidates the fast decode was chosen from (draft margin × reducing_gap)
with their decode time per 12-MP JPEG (``bench/photos.py``'s, one thread, candidates in turns).

    python -m bench.fidelity [--sweep] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from inboxd.config import ModelConfig
from inboxd.decode import pillow
from inboxd.decode.spec import PreprocessSpec

from support import corpus
from support.corpus import Variant
from support.fidelity import (
    HEADER,
    MAX_PIXELS,
    Agreement,
    Corpus,
    Decode,
    FidelityPath,
    Predict,
    default_decode_paths,
    eager_fp32_predict,
    is_jpeg,
    mode_decode,
    model_spec,
    softmax_predict,
)


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


def resized_decode(spec: PreprocessSpec, resizing: pillow.Resizing) -> Decode:
    return lambda data: pillow.decode_resized(data, spec, MAX_PIXELS, resizing).pixels


def sweep_paths(spec: PreprocessSpec, predict: Predict) -> list[FidelityPath]:
    """The candidates for the fast JPEG decode (margin 8 without a gap is ``exact``)."""
    return [FidelityPath(f"JPEG draft ≥{margin:g}×, reducing_gap {gap}",
                         resized_decode(spec, pillow.Resizing(margin, gap)), predict, is_jpeg)
            for margin in (1, 2, 4) for gap in (None, 2.0, 3.0)]


def all_parts(real_limit: int | None = None) -> list[tuple[Path, Sequence[Variant]]]:
    """The upscaled corpus and, where apt can fetch them, the real photos (``real_limit``:
    the first variants per photo only, for a quicker run)."""
    from support import real_photos

    parts: list[tuple[Path, Sequence[Variant]]] = [corpus.build()]
    why = real_photos.unavailable()
    if why is not None:
        print(f"(no real photos: {why})")
        return parts
    folder, variants = real_photos.build()
    if real_limit is not None:
        variants = [v for v in variants if int(v.file.rsplit("-", 1)[1][:2]) < real_limit]
    return [*parts, (folder, variants)]


def table(data: Corpus, paths: Sequence[FidelityPath]) -> list[tuple[str, Agreement]]:
    """Each path on each source, then on the whole corpus."""
    origins: list[str | None] = [*data.origins(), None]
    return [(origin or "all", agreement) for path in paths
            for origin, agreement in data.by_origin(path, origins)]


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
    data = Corpus(all_parts(), spec, predict)
    variants = data.variants
    jpegs = sum(1 for v in variants if is_jpeg(v))
    print(f"corpus: {len(variants)} variants ({jpegs} JPEG; "
          + ", ".join(f"{o} {sum(v.origin == o for v in variants)}" for o in data.origins())
          + "); reference: resize exact + eager fp32")
    fast_runtime = onnxruntime_predict()
    defaults = [*default_decode_paths(spec, predict),
                FidelityPath("runtime onnxruntime fp32 (decode exact)", mode_decode(spec, "exact"),
                             fast_runtime),
                FidelityPath("every default at once: decode fast + onnxruntime fp32",
                             mode_decode(spec, "fast"), fast_runtime)]
    measured = table(data, defaults)
    rows = [agreement.row(origin) for origin, agreement in measured]
    print(HEADER)
    print("\n".join(rows))
    flips = sorted({flip for origin, agreement in measured
                    if origin != "all" for flip in agreement.flips})
    print("\nflips (reference top-1 → the path's, and the reference's lead over its runner-up):")
    print("\n".join(f"- {flip}" for flip in flips) or "- none")
    if args.emit:
        print(json.dumps({"variants": len(variants), "jpegs": jpegs, "header": HEADER,
                          "rows": rows, "flips": flips}))
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
    for origin, agreement in table(data, candidates):
        print(agreement.row(origin))
    torch.set_num_threads(1)
    decodes = {"exact": mode_decode(spec, "exact"), "fast (default)": mode_decode(spec, "fast"),
               **{p.name: p.decode for p in candidates}}
    timings = ms_per_photo(decodes, twelve_mp_jpegs(), args.repeats)
    print("\n| decode | ms per 12-MP JPEG (one thread) |\n|---|---|")
    for name, ms in timings.items():
        print(f"| {name} | {ms:.1f} |")


if __name__ == "__main__":
    main()
