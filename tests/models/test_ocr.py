"""The built-in OCR task (``model: {name: ocr}``) with the real PP-OCRv4 networks from the
``rapidocr-onnxruntime`` wheel: it reads rendered text exactly, in displayed pixels whatever
the photo's EXIF orientation or decoded size, reads what RapidOCR's own API reads, and keeps its
fan-out bounded (``max_regions`` per photo, ``capacity.ocr_crops`` crops at a time)."""

from __future__ import annotations

from functools import cache

import numpy as np
import pytest
import torch
from inboxd.config import ConfigError, ModelConfig, load_config
from inboxd.decode.pillow import decode_image
from inboxd.decode.spec import PreprocessSpec
from inboxd.models.loading import load_model
from inboxd.models.ocr.reader import CropLayer, OcrReader, OcrReading, OcrSettings
from inboxd.models.ocr_model import OcrModel, load_ocr

from support.text_images import TextImage, dense_page, generated, receipt_total
from tests.conftest import write_config

MAX_PIXELS = 89_478_485
# How far a detected polygon may lie outside a line's ink box: the detector grows each text
# kernel back by unclip_ratio, a few pixels beyond the glyphs' own extent.
MARGIN_PX = 12


@cache
def ocr_model() -> OcrModel:
    return load_ocr(ModelConfig(name="ocr"), torch.device("cpu"))


def read(text: TextImage, fit_px: int = 2000) -> OcrReading:
    """``text`` as the daemon reads it: its file decoded by inboxd's decoder (EXIF applied,
    fitted within ``fit_px``, never enlarged), then the model."""
    model = ocr_model()
    spec = PreprocessSpec(fit_px, fit_px, "bilinear", (0.5,) * 3, (0.5,) * 3, kind="fit_within")
    decoded = decode_image(text.encoded(), spec, MAX_PIXELS)
    return model.predict([model.input_of(decoded)])[0]


def assert_around(polygon: list[list[float]], box: tuple[int, int, int, int],
                  scale: int = 1) -> None:
    xs, ys = [p[0] for p in polygon], [p[1] for p in polygon]
    left, top, right, bottom = box
    margin = MARGIN_PX * scale
    assert min(xs) <= left + 2 and max(xs) >= right - 2, (polygon, box)
    assert min(ys) <= top + 2 and max(ys) >= bottom - 2, (polygon, box)
    assert min(xs) >= left - margin and max(xs) <= right + margin, (polygon, box)
    assert min(ys) >= top - margin and max(ys) <= bottom + margin, (polygon, box)


def test_reads_rendered_text_exactly_with_its_polygon_around_the_ink() -> None:
    total = receipt_total()
    reading = read(total)
    assert reading.full_text == "Total 348.20 EUR"
    assert [line.text for line in reading.lines] == ["Total 348.20 EUR"]
    assert reading.cut == 0 and reading.lines[0].score > 0.9
    assert_around(reading.lines[0].polygon, total.boxes[0])


@pytest.mark.parametrize("orientation", [6, 8, 3])
def test_a_photo_stored_turned_reads_upright_in_displayed_pixels(orientation: int) -> None:
    upright = receipt_total()
    turned = TextImage(upright.name, upright.image, upright.lines, upright.boxes, orientation)
    reading = read(turned)
    assert reading.full_text == "Total 348.20 EUR"
    assert_around(reading.lines[0].polygon, upright.boxes[0])


def test_polygons_are_in_the_displayed_photo_when_it_was_decoded_smaller() -> None:
    """Decoded at a third of its size (a larger photo than the working size), the polygon is
    still given in the photo's own pixels."""
    total = receipt_total()
    large = total.image.resize((3000, 600))
    scaled = TextImage("large", large, total.lines,
                       [tuple(3 * v for v in total.boxes[0])], 1)  # type: ignore[list-item]
    reading = read(scaled, fit_px=1000)
    assert reading.full_text == "Total 348.20 EUR"
    assert_around(reading.lines[0].polygon, scaled.boxes[0], scale=3)


def test_lines_come_in_reading_order() -> None:
    page = next(t for t in generated(8) if t.name.endswith("document"))
    reading = read(page)
    assert [line.text for line in reading.lines] == page.lines


@pytest.mark.slow
def test_a_page_of_small_print_is_cut_to_max_regions_and_crops_stay_within_capacity() -> None:
    model = ocr_model()
    crops = CropLayer(capacity=8)
    reader = OcrReader(model.reader.detector, model.reader.classifier.session,
                       model.reader.recogniser.session, OcrSettings(max_regions=40), crops)
    page = dense_page(seed=1, side=1400, size=12)
    reading = reader.read(np.asarray(page.image), page.image.size)
    assert len(reading.lines) <= 40
    assert reading.cut + 40 >= 1000, "the page must hold over a thousand regions"
    assert reading.as_json()["cut"] == reading.cut
    assert crops.high_water == 8 and crops.size == 0
    # The kept regions are the best by score: every line read is one of the page's numbers.
    words = {word for line in page.lines for word in line.split()}
    assert sum(line.text in words for line in reading.lines) >= 0.9 * len(reading.lines)


@pytest.mark.slow
def test_reads_what_rapidocr_reads() -> None:
    """The reference: RapidOCR's own API on the same upright pixels (its own loader ignores
    EXIF orientation, so it is handed the array): the same lines, the same polygons."""
    rapidocr = pytest.importorskip("rapidocr_onnxruntime")
    peer = rapidocr.RapidOCR(intra_op_num_threads=2)
    for text in list(generated(8))[:8]:
        if text.orientation != 1:
            continue
        ours = read(text)
        rgb = np.asarray(text.image.convert("RGB"))
        found, _ = peer(np.ascontiguousarray(rgb[:, :, ::-1]))
        theirs = [(line[1], line[0]) for line in found or []]
        assert [line.text for line in ours.lines] == [t for t, _ in theirs], text.name
        for line, (_, polygon) in zip(ours.lines, theirs, strict=True):
            assert np.allclose(line.polygon, polygon, atol=1.0), text.name


def test_the_config_refuses_what_ocr_does_not_take(tmp_path) -> None:
    for model, says in [({"name": "ocr", "top_k": 3}, "remove top_k"),
                        ({"name": "ocr", "precision": "fp16"}, "remove precision"),
                        ({"name": "efficientnet_lite0", "max_regions": 5}, "name: ocr")]:
        with pytest.raises(ConfigError) as caught:
            load_config(write_config(tmp_path, model=model))
        assert says in str(caught.value), caught.value
    # engine: ray serves OCR too (its replicas read the text: tests/models/test_ray_tasks.py).
    on_ray = load_config(write_config(tmp_path, model={"name": "ocr", "engine": "ray"}))
    assert on_ray.model.engine == "ray" and on_ray.model.kind == "ocr"


def test_loads_from_the_config_and_says_where_it_runs(tmp_path) -> None:
    config = load_config(write_config(tmp_path, model={"name": "ocr", "max_regions": 7}))
    model = load_model(config.model)
    assert isinstance(model, OcrModel)
    assert model.reader.settings.max_regions == 7
    assert model.spec.kind == "fit_within" and model.spec.crop == 2000
    assert model.providers == ("CPUExecutionProvider",)
    # The started record's runtime fields, as every model gives them (runtime_record).
    assert "CPUExecutionProvider" in model.fields["RUNTIME_REASON"], model.fields
    assert "MODEL_NOTE" not in model.fields  # asked for the CPU: nothing to explain
