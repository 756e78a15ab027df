"""Every decode path ``preprocess.resize: fast`` (the default) takes keeps the fidelity contract.

On the corpus of ``support/corpus.py`` (300+ variants of the packaged real photos: cropped,
rotated, mirrored, EXIF-oriented, 0.3-12 MP, JPEG at several qualities and subsamplings, HEIC,
WebP, PNG), the real built-in model in eager fp32 on both sides, so only the decode differs: the
fast decode against the exact one (torchvision's pixels) must agree on the top-1 class for at
least 99% of the variants and move the reference's top-1 score by a median of at most 0.01.
``python -m bench.fidelity`` prints the same rows with p95 and max.

The corpus is built on first use into ``var/corpus`` (a few minutes on 2 cores), then reused.
"""

from __future__ import annotations

import pytest
from inboxd.decode.pillow import RESIZINGS

from support import corpus, fidelity, real_photos

pytestmark = pytest.mark.slow  # minutes on 2 cores: `make test`, not `make test-fast`


@pytest.mark.timeout(1800)
def test_every_default_decode_path_keeps_the_contract() -> None:
    folder, variants = corpus.build()
    assert len(variants) >= 300
    spec, predict = fidelity.model_spec(), fidelity.eager_fp32_predict()
    measured = fidelity.Corpus([(folder, variants)], spec, predict)
    results = [measured.measure(path) for path in fidelity.default_decode_paths(spec, predict)]
    assert all(r.n > 0 for r in results)
    assert sum(r.n for r in results[:-1]) == len(measured.variants)  # every format has a path
    for result in results:
        assert result.holds(), result.row()
    # Not trivially: the fast path gives other pixels than the exact one for a good share.
    assert results[-1].changed >= len(measured.variants) // 4, results[-1].row()


# Variants per real photo in the test: a subset keeps its time modest (bench.fidelity runs all).
REAL_VARIANTS_PER_PHOTO = 3


@pytest.mark.timeout(1800)
def test_every_default_decode_path_keeps_the_contract_on_real_photos() -> None:
    """Camera photos at native resolution keep the detail an upscaled one lacks, and with it
    what a reduced-scale decode loses: the contract counted on them (decisive top-1 agreement:
    a near-tie of the reference is no decision to keep)."""
    why = real_photos.unavailable()
    if why is not None:
        pytest.skip(why)
    folder, variants = real_photos.build()
    chosen = [v for v in variants
              if int(v.file.rsplit("-", 1)[1][:2]) < REAL_VARIANTS_PER_PHOTO]
    assert len(chosen) == REAL_VARIANTS_PER_PHOTO * len(real_photos.PHOTOS)
    assert all(v.origin == "real" for v in chosen)
    spec, predict = fidelity.model_spec(), fidelity.eager_fp32_predict()
    measured = fidelity.Corpus([(folder, chosen)], spec, predict)
    for path in fidelity.default_decode_paths(spec, predict)[:1]:  # every real photo is a JPEG
        result = measured.measure(path, "real")
        assert result.n == len(chosen)
        assert result.decisive >= len(chosen) // 2, result.row()
        assert result.holds(), f"{result.row()} flips: {result.flips}"


def test_the_fast_decode_is_not_the_exact_one() -> None:
    """Otherwise the contract above would hold trivially."""
    fast, exact = RESIZINGS["fast"], RESIZINGS["exact"]
    assert fast.draft_margin < exact.draft_margin
    assert fast.reducing_gap is not None


def test_fastest_is_opt_in_and_drafts_right_down_to_the_target() -> None:
    """``preprocess.resize: fastest`` (outside the contract) is never the default, and it is
    what it says: libjpeg's DCT scaling to the target, other pixels than ``fast``."""
    import io
    from dataclasses import replace

    import numpy as np
    from inboxd.config import PreprocessConfig
    from inboxd.decode.pillow import decode_image
    from PIL import Image

    assert PreprocessConfig().resize == "fast"
    assert RESIZINGS["fastest"].draft_margin < RESIZINGS["fast"].draft_margin
    pixels = np.random.default_rng(5).integers(0, 256, (1536, 2048, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "JPEG", quality=90)
    spec = fidelity.model_spec()
    crops = {mode: decode_image(out.getvalue(), replace(spec, resize_mode=mode),
                                89_478_485).pixels for mode in ("fast", "fastest")}
    assert crops["fast"].shape == crops["fastest"].shape == (spec.crop, spec.crop, 3)
    assert not np.array_equal(crops["fast"], crops["fastest"])
