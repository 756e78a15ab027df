"""``model: {name: ocr}`` end to end: the real daemon from a YAML file, real photos with
rendered text (upright and stored turned with an EXIF tag), the real PP-OCRv4 networks; and a
flood of pages of small print, each holding over a thousand text regions, against a flood of
ordinary photos: every layer within its capacity, the crop layer included, and the same RSS."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from PIL import Image

from support.photos import photo_paths
from support.text_images import TextImage, dense_page, receipt_total
from tests.conftest import last_stats, line_fields, read_json, wait_until, write_config

# A page of small print may hold this much more RSS than ordinary photos of its size.
RSS_TOLERANCE = 0.10


def drop_text(text: TextImage, inbox: Path) -> str:
    path = text.save(inbox.parent)
    os.rename(path, inbox / path.name)
    return path.name


@pytest.mark.daemon
@pytest.mark.timeout(600)
@pytest.mark.slow  # a costly run: `make test`, not the fast tier
def test_ocr_from_yaml_reads_upright_and_turned_photos_in_displayed_pixels(
        tmp_path: Path, daemon_factory) -> None:
    config = write_config(tmp_path, model={"name": "ocr", "max_regions": 50},
                          capacity={"ocr_crops": 4})
    daemon = daemon_factory(config)
    daemon.wait_for("ready")
    started = line_fields(daemon.records("started")[0])
    assert started["MODEL"] == "ocr", started
    total = receipt_total()
    names = [drop_text(TextImage(f"total-{o}", total.image, total.lines, total.boxes, o),
                       tmp_path / "inbox") for o in (1, 6, 8)]
    results = [tmp_path / "results" / f"{name}.json" for name in names]
    wait_until(lambda: all(r.exists() for r in results), 300, "the three results")
    left, top, right, bottom = total.boxes[0]
    for path in results:
        result = read_json(path)
        assert result["model"] == "ocr" and result["runtime"] == "onnxruntime"
        assert (result["image"]["width"], result["image"]["height"]) == total.image.size
        ocr = result["ocr"]
        assert ocr["full_text"] == "Total 348.20 EUR", (path.name, ocr)
        assert ocr["cut"] == 0
        [line] = ocr["lines"]
        xs = [x for x, _ in line["polygon"]]
        ys = [y for _, y in line["polygon"]]
        # In the displayed photo: around the ink, whichever way the file was stored.
        assert left - 12 <= min(xs) <= left + 2 and right - 2 <= max(xs) <= right + 12, line
        assert top - 12 <= min(ys) <= top + 2 and bottom - 2 <= max(ys) <= bottom + 12, line
    daemon.wait_for("stats", 30, count=len(daemon.records("stats")) + 1)
    stats = last_stats(daemon.records("stats"))
    assert int(stats["OCR_CROPS_CAPACITY"]) == 4
    assert 1 <= int(stats["OCR_CROPS_HIGH_WATER"]) <= 4
    assert daemon.stop() == 0


def flood(tmp_path: Path, daemon_factory, files: list[TextImage], capacity: dict[str, int],
          max_regions: int) -> tuple[dict[str, str], int, list[dict]]:
    """The daemon over ``files`` dropped at once: its last stats record, the largest RSS any
    record gave, and the results."""
    tmp_path.mkdir()
    config = write_config(tmp_path, model={"name": "ocr", "max_regions": max_regions},
                          capacity=capacity, batch={"max_size": 2})
    daemon = daemon_factory(config)
    daemon.wait_for("ready")
    names = [drop_text(text, tmp_path / "inbox") for text in files]
    results = [tmp_path / "results" / f"{name}.json" for name in names]
    wait_until(lambda: all(r.exists() for r in results), 1200, "every result")
    daemon.wait_for("stats", 30, count=len(daemon.records("stats")) + 1)
    assert daemon.stop() == 0
    records = [line_fields(line) for line in daemon.records("stats")]
    return (last_stats(daemon.records("stats")), max(int(r["RSS_BYTES"]) for r in records),
            [read_json(r) for r in results])


@pytest.mark.daemon
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_flood_of_dense_pages_stays_within_every_capacity_and_the_rss_of_photos(
        tmp_path: Path, daemon_factory) -> None:
    count, side, max_regions = 8, 1400, 64
    capacity = {"queue": 1, "preprocess_cache": 2, "ocr_crops": 8}
    photos = sorted(photo_paths().values())
    ordinary = [TextImage(f"photo-{n}", Image.open(photos[n % len(photos)]).convert("RGB")
                          .resize((side, side)), [], []) for n in range(count)]
    dense = [dense_page(seed, side=side, size=12) for seed in range(count)]
    _, photos_rss, _ = flood(tmp_path / "photos", daemon_factory, ordinary, capacity,
                             max_regions)
    stats, dense_rss, results = flood(tmp_path / "dense", daemon_factory, dense, capacity,
                                      max_regions)
    for result in results:
        ocr = result["ocr"]
        assert len(ocr["lines"]) <= max_regions
        assert ocr["cut"] + max_regions >= 1000, "every page holds over a thousand regions"
    for layer, bound in capacity.items():
        assert int(stats[f"{layer.upper()}_HIGH_WATER"]) <= bound, (layer, stats)
    assert int(stats["OCR_CROPS_HIGH_WATER"]) == capacity["ocr_crops"], "the layer filled"
    assert dense_rss <= photos_rss * (1 + RSS_TOLERANCE), (dense_rss, photos_rss)
    print(f"RSS: dense pages {dense_rss / 2**20:.0f} MiB, photos {photos_rss / 2**20:.0f} MiB; "
          f"ocr_crops high-water {stats['OCR_CROPS_HIGH_WATER']}/{capacity['ocr_crops']}")
