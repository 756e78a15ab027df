"""The whole pipeline with the device decode route in place (on the CPU: the same tensor code
the GPU runs) and the real built-in model: eligible JPEGs are decoded by the route, every other
file by the sandboxed workers, each with the outcome the CPU path gives it, and one batch of
the model mixes both kinds of crops."""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path

import torch
from inboxd.config import ModelConfig, load_config
from inboxd.decode.device_route import DeviceRoute
from inboxd.decode.tensor import TensorDecoder
from inboxd.models.loading import load_model
from inboxd.pipeline.wiring import Pipeline
from PIL import Image

from support.photos import photo_jpeg
from tests.conftest import write_config
from tests.decode.test_tensor import cmyk_jpeg, jpeg_of


def test_each_file_takes_its_path_through_the_real_pipeline(tmp_path: Path) -> None:
    model = load_model(ModelConfig(device="cpu"))
    config = load_config(write_config(
        tmp_path, inbox={"settle_ms": 0}, batch={"max_size": 8, "max_delay_ms": 300},
        preprocess={"workers": 2}, capacity={"queue": 4, "preprocess_cache": 8}))
    pipeline = Pipeline(config, model)
    assert pipeline.preprocessor.device_route is None  # the CPU: only a GPU decodes in-process
    route = DeviceRoute(TensorDecoder(model.spec, torch.device("cpu"), max_batch=2), model.spec,
                        config.preprocess.max_image_pixels, config.preprocess.max_file_mb << 20)
    pipeline.preprocessor.device_route = route
    cat = photo_jpeg("chelsea", (640, 480), 1)
    png = io.BytesIO()
    Image.open(io.BytesIO(cat)).save(png, "PNG")
    inbox = tmp_path / "inbox"
    (inbox / "cat.jpg").write_bytes(cat)
    (inbox / "cat-progressive.jpg").write_bytes(jpeg_of(Image.open(io.BytesIO(cat)),
                                                        progressive=True))
    (inbox / "cat.png").write_bytes(png.getvalue())
    (inbox / "cmyk.jpg").write_bytes(cmyk_jpeg())
    (inbox / "cut.jpg").write_bytes(cat[: len(cat) // 2])
    asyncio.run(pipeline.process_backlog())

    results = {p.name.removesuffix(".json"): json.loads(p.read_text())
               for p in (tmp_path / "results").glob("*.json")}
    assert set(results) == {"cat.jpg", "cat-progressive.jpg", "cat.png", "cmyk.jpg"}
    failed = sorted(p.name for p in (tmp_path / "failed").iterdir() if p.name[0] != ".")
    assert failed == ["cut.jpg", "cut.jpg.error.json"]
    assert "truncated" in (tmp_path / "failed" / "cut.jpg.error.json").read_text()
    top1 = {name: doc["top_k"][0]["label"] for name, doc in results.items() if "top_k" in doc}
    assert top1["cat.jpg"] == top1["cat-progressive.jpg"] == top1["cat.png"]
    assert route.device_decoded == 1 and route.cpu_fallbacks == 3
    assert pipeline.preprocess_cache.high_water_bytes >= 224 * 224 * 3
