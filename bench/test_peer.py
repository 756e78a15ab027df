"""The peer of ``make bench-peer`` (``bench/peer.py``) is not a broken strawman: run end to end as
a user runs it, on real photos in three formats (a JPEG, a greyscale PNG, a HEIC, which takes its
pillow_heif path), it writes one JSON per file whose top-1 is the one inboxd's own decoding and
built-in model give the same file. A peer that normalised wrongly, cropped elsewhere or lost
the label order would be compared with inboxd at a speed it only has by being wrong.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pillow_heif
import pytest
from PIL import Image

from bench.offline import load, prepare
from bench.peer import ensure_model
from support.photos import photo_paths

pytestmark = pytest.mark.slow  # minutes on 2 cores: `make test`, not `make test-fast`

REPO = Path(__file__).resolve().parent.parent
# name → (photo, format): the greyscale camera exercises the peer's colour conversion.
FILES = {"chelsea.jpg": ("chelsea", "JPEG"), "camera.png": ("camera", "PNG"),
         "coffee.heic": ("coffee", "HEIF")}


def make_inbox(inbox: Path) -> None:
    pillow_heif.register_heif_opener()
    inbox.mkdir()
    photos = photo_paths()
    for name, (photo, fmt) in FILES.items():
        with Image.open(photos[photo]) as image:
            image.convert("L" if photo == "camera" else "RGB").save(inbox / name, format=fmt)


@pytest.mark.timeout(240)
def test_peer_writes_one_result_per_photo_with_inboxds_top1(tmp_path: Path) -> None:
    inbox, results = tmp_path / "inbox", tmp_path / "results"
    make_inbox(inbox)
    model_path = ensure_model()  # cached under bench/out/peer/ after the first export
    proc = subprocess.run([sys.executable, "-m", "bench.peer", "run", str(inbox), str(results),
                           "--model", str(model_path)], cwd=REPO, capture_output=True,
                          text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (summary["files"], summary["failed"]) == (len(FILES), 0)
    assert sorted(p.name for p in results.iterdir()) == sorted(f"{n}.json" for n in FILES)

    model, max_pixels = load(len(FILES))
    ours = model.classify([prepare(inbox / name, model, max_pixels).pixels for name in FILES])
    for name, inboxd in zip(FILES, ours, strict=True):
        peer = json.loads((results / f"{name}.json").read_text())
        top_k = peer["top_k"]
        assert len(top_k) == 5 and peer["source"] == name
        assert [entry["score"] for entry in top_k] == sorted(
            (entry["score"] for entry in top_k), reverse=True)
        assert (top_k[0]["index"], top_k[0]["label"]) == (
            inboxd.top_k[0]["index"], inboxd.top_k[0]["label"]), name
        assert abs(top_k[0]["score"] - inboxd.top_k[0]["score"]) < 0.1, name
