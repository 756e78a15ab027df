"""Every decode path ``preprocess.resize: fast`` (the default) takes keeps the fidelity contract.

On the corpus of ``support/corpus.py`` (300+ variants of the packaged real photos: cropped,
rotated, mirrored, EXIF-oriented, 0.3-12 MP, JPEG at several qualities and subsamplings, HEIC,
WebP, PNG), the real built-in model in eager fp32 on both sides, so only the decode differs: the
fast decode against the exact one (torchvision's pixels) must agree on the top-1 class for at
least 99% of the variants and move the reference's top-1 score by a median of at most 0.01.
``bench.fidelity`` prints the same rows with p95 and max.

The corpus is built on first use into ``var/corpus`` (a few minutes on 2 cores), then reused.
"""

from __future__ import annotations

import pytest
from inboxd.decode.pillow import RESIZINGS

from bench import fidelity
from support import corpus

pytestmark = pytest.mark.slow  # minutes on 2 cores: `make test`, not `make test-fast`


@pytest.mark.timeout(1800)
def test_every_default_decode_path_keeps_the_contract() -> None:
    folder, variants = corpus.build()
    assert len(variants) >= 300
    spec, predict = fidelity.model_spec(), fidelity.eager_fp32_predict()
    measured = fidelity.Corpus(folder, variants, spec, predict)
    results = [measured.measure(path) for path in fidelity.default_decode_paths(spec, predict)]
    assert all(r.n > 0 for r in results)
    assert sum(r.n for r in results[:-1]) == len(measured.variants)  # every format has a path
    for result in results:
        assert result.holds(), result.row()
    # Not trivially: the fast path gives other pixels than the exact one for a good share.
    assert results[-1].changed >= len(measured.variants) // 4, results[-1].row()


def test_the_fast_decode_is_not_the_exact_one() -> None:
    """Otherwise the contract above would hold trivially."""
    fast, exact = RESIZINGS["fast"], RESIZINGS["exact"]
    assert fast.draft_margin < exact.draft_margin
    assert fast.reducing_gap is not None
