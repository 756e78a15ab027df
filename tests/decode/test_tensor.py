"""The device decode path, run on the CPU: the same tensor code the GPU runs (libjpeg-turbo in
place of nvJPEG), proven against the Pillow path with the real built-in model on real photos:
top-5 identical and every score within 2e-3 (the fidelity tolerance of the inputs issue).
"""

from __future__ import annotations

import contextlib
import io
import threading

import numpy as np
import pytest
import torch
from inboxd.config import ModelConfig
from inboxd.decode import jpeg_header
from inboxd.decode.pillow import decode_image
from inboxd.decode.tensor import DecodeFailed, TensorDecoder, decode_batch, orient
from inboxd.models.loading import load_model
from inboxd.models.model import Model
from PIL import Image

from support.photos import DECODE_SIZES as SIZES
from support.photos import photo_jpeg, photo_paths
from tests.decode.test_fidelity import MAX_SCORE_DIFF

MAX_PIXELS = 89_478_485
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model() -> Model:
    return load_model(ModelConfig(device="cpu"))


def jpeg_of(pixels: np.ndarray | Image.Image, **save: object) -> bytes:
    image = pixels if isinstance(pixels, Image.Image) else Image.fromarray(pixels)
    out = io.BytesIO()
    image.save(out, format="JPEG", **{"quality": 90, **save})
    return out.getvalue()


def tensor_crops(datas: list[bytes], model: Model) -> list[torch.Tensor | DecodeFailed]:
    headers = [jpeg_header.inspect(data, MAX_PIXELS) for data in datas]
    return decode_batch(datas, headers, model.spec, CPU)


@pytest.mark.slow
def test_tensor_path_matches_the_pillow_path_on_real_photos(model: Model) -> None:
    photos = photo_paths()
    datas = {name: photo_jpeg(name, size, seed)
             for seed, (name, size) in enumerate(SIZES.items()) if name in photos}
    assert len(datas) >= 6
    crops = tensor_crops(list(datas.values()), model)
    assert all(isinstance(crop, torch.Tensor) for crop in crops)
    ours = torch.softmax(model.outputs(crops), dim=1)  # type: ignore[arg-type]
    pillow = torch.softmax(model.outputs(
        [decode_image(data, model.spec, MAX_PIXELS).pixels for data in datas.values()]), dim=1)
    diffs = {}
    for n, name in enumerate(datas):
        diffs[name] = float((ours[n] - pillow[n]).abs().max())
        assert ours[n].topk(5).indices.tolist() == pillow[n].topk(5).indices.tolist(), name
    print(f"tensor vs Pillow, {len(datas)} photos: max score diff "
          f"{max(diffs.values()):.2e}", {k: f"{v:.1e}" for k, v in diffs.items()})
    assert max(diffs.values()) <= MAX_SCORE_DIFF, diffs


def test_greyscale_and_444_jpegs_take_the_tensor_path_and_match(model: Model) -> None:
    with Image.open(photo_paths()["camera"]) as grey:  # a real greyscale photo
        grey_jpeg = jpeg_of(grey.convert("L"))
    colour = photo_jpeg("chelsea", (800, 600), 7)
    full_chroma = jpeg_of(Image.open(io.BytesIO(colour)), subsampling=0)  # 4:4:4
    datas = [grey_jpeg, full_chroma]
    crops = tensor_crops(datas, model)
    ours = torch.softmax(model.outputs(crops), dim=1)  # type: ignore[arg-type]
    pillow = torch.softmax(model.outputs(
        [decode_image(d, model.spec, MAX_PIXELS).pixels for d in datas]), dim=1)
    assert float((ours - pillow).abs().max()) <= MAX_SCORE_DIFF
    assert ours.topk(5).indices.tolist() == pillow.topk(5).indices.tolist()


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_is_applied_as_pillow_applies_it(model: Model,
                                                          orientation: int) -> None:
    with Image.open(photo_paths()["chelsea"]) as photo:  # 451×300: not symmetric
        source = photo.convert("RGB")
    exif = Image.Exif()
    exif[0x0112] = orientation
    data = jpeg_of(source, exif=exif.tobytes())
    header = jpeg_header.inspect(data, MAX_PIXELS)
    assert header.orientation == orientation
    [crop] = decode_batch([data], [header], model.spec, CPU)
    assert isinstance(crop, torch.Tensor)
    expected = decode_image(data, model.spec, MAX_PIXELS)
    assert header.oriented_size == (expected.width, expected.height)
    diff = np.abs(crop.numpy().astype(np.int16) - expected.pixels.astype(np.int16))
    assert diff.mean() < 1.0, f"orientation {orientation}: mean pixel diff {diff.mean():.2f}"


def test_orient_matches_pillow_transposes_exactly() -> None:
    pixels = np.random.default_rng(0).integers(0, 255, (5, 7, 3), dtype=np.uint8)
    for orientation in range(1, 9):
        image = Image.fromarray(pixels)
        image.getexif()[0x0112] = orientation
        from PIL import ImageOps

        expected = np.asarray(ImageOps.exif_transpose(image))
        ours = orient(torch.from_numpy(pixels).permute(2, 0, 1), orientation).permute(1, 2, 0)
        assert np.array_equal(ours.numpy(), expected), orientation


def cmyk_jpeg() -> bytes:
    return jpeg_of(Image.new("CMYK", (64, 48), (10, 200, 30, 5)))


def test_what_the_gpu_may_not_decode_is_refused_with_a_reason() -> None:
    photo = photo_jpeg("chelsea", (320, 240), 1)
    progressive = jpeg_of(Image.open(io.BytesIO(photo)), progressive=True)
    png = io.BytesIO()
    Image.open(io.BytesIO(photo)).save(png, "PNG")
    cases = {
        "progressive": progressive,
        "components": cmyk_jpeg(),
        "not a JPEG": png.getvalue(),
        "truncated": photo[: len(photo) // 2],
        "max_image_pixels": photo,
    }
    for why, data in cases.items():
        limit = 1000 if why == "max_image_pixels" else MAX_PIXELS
        with pytest.raises(jpeg_header.NotEligible, match=why):
            jpeg_header.inspect(data, limit)
    assert jpeg_header.inspect(photo, MAX_PIXELS).components == 3


def test_hostile_headers_only_ever_give_a_reason() -> None:
    """A seeded fuzzer over the header: any mutation is accepted or refused, never a crash."""
    photo = photo_jpeg("chelsea", (96, 64), 2)
    rng = np.random.default_rng(12)
    scan = photo.index(b"\xff\xda")
    for _ in range(2000):
        data = bytearray(photo[: scan + 40 + int(rng.integers(0, 200))])
        for _ in range(int(rng.integers(1, 6))):
            data[int(rng.integers(0, scan + 4))] = int(rng.integers(0, 256))
        with contextlib.suppress(jpeg_header.NotEligible):
            jpeg_header.inspect(bytes(data) + b"\xff\xd9", MAX_PIXELS)


def bogus_huffman(data: bytes) -> bytes:
    """Passes the header check, fails in the decoder: a DHT whose code counts overflow."""
    at = data.index(b"\xff\xc4") + 5  # the first of its 16 counts
    return data[:at] + b"\xff" * 16 + data[at + 16:]


def test_one_bad_jpeg_in_a_batch_fails_only_itself(model: Model) -> None:
    good = [photo_jpeg(name, (320, 240), n) for n, name in enumerate(["chelsea", "coffee"])]
    results = tensor_crops([good[0], bogus_huffman(good[1]), good[1], bogus_huffman(good[0])],
                           model)
    assert isinstance(results[0], torch.Tensor) and isinstance(results[2], torch.Tensor)
    assert isinstance(results[1], DecodeFailed) and isinstance(results[3], DecodeFailed)
    assert "Huffman" in str(results[1])
    alone = tensor_crops([good[1]], model)[0]
    assert isinstance(alone, torch.Tensor) and torch.equal(alone, results[2])


def test_a_jpeg_cut_short_with_an_eoi_decodes_grey_filled_as_pillow_does(model: Model) -> None:
    """libjpeg pads a scan that ends early with grey and says so; Pillow does the same, so
    the two paths agree that such a file is an image (one without its EOI takes the CPU
    path, where Pillow refuses it as truncated: test_routing)."""
    photo = photo_jpeg("chelsea", (320, 240), 0)
    cut = photo[: len(photo) * 2 // 3] + b"\xff\xd9"
    [crop] = tensor_crops([cut], model)
    assert isinstance(crop, torch.Tensor)
    expected = decode_image(cut, model.spec, MAX_PIXELS).pixels
    assert np.abs(crop.numpy().astype(np.int16) - expected.astype(np.int16)).mean() < 1.0


def test_the_decoder_thread_batches_concurrent_callers_and_isolates_failures(
        model: Model) -> None:
    datas = [photo_jpeg("chelsea", (200 + 8 * n, 150), n) for n in range(6)]
    datas[3] = bogus_huffman(datas[3])
    decoder = TensorDecoder(model.spec, CPU, max_batch=8, gather_s=0.2)
    results: dict[int, object] = {}

    def one(n: int) -> None:
        try:
            results[n] = decoder.decode(datas[n], jpeg_header.inspect(datas[n], MAX_PIXELS))
        except DecodeFailed as exc:
            results[n] = exc

    threads = [threading.Thread(target=one, args=(n,)) for n in range(len(datas))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    decoder.close()
    assert isinstance(results[3], DecodeFailed)
    good = [results[n] for n in range(len(datas)) if n != 3]
    assert all(r.device_pixels.shape == (224, 224, 3) for r in good)  # type: ignore[attr-defined]
    assert all(r.nbytes == 224 * 224 * 3 for r in good)  # type: ignore[attr-defined]
    assert decoder.decoded == 6 and decoder.batches < 6  # gathered, not one call per file
    with pytest.raises(DecodeFailed, match="shutting down"):
        decoder.decode(datas[0], jpeg_header.inspect(datas[0], MAX_PIXELS))


def test_a_decode_batch_stays_within_its_pixel_budget(model: Model) -> None:
    datas = [photo_jpeg("chelsea", (200, 150), n) for n in range(5)]
    sizes: list[int] = []

    def counting(*args: object) -> list[torch.Tensor | DecodeFailed]:
        sizes.append(len(args[0]))  # type: ignore[arg-type]
        return decode_batch(*args)  # type: ignore[arg-type]

    decoder = TensorDecoder(model.spec, CPU, max_batch=8, gather_s=0.3,
                            max_batch_pixels=2 * 200 * 150, decode=counting)
    threads = [threading.Thread(target=decoder.decode,
                                args=(d, jpeg_header.inspect(d, MAX_PIXELS))) for d in datas]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    decoder.close()
    assert sum(sizes) == 5 and max(sizes) <= 2, sizes


# -- the same on a real GPU (nvJPEG): run by bench/gpu_check.sh's gpu_tests stage -----------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
def test_nvjpeg_matches_the_pillow_path_on_real_photos() -> None:
    cuda_model = load_model(ModelConfig(device="cuda"))
    photos = photo_paths()
    datas = [photo_jpeg(name, size, seed)
             for seed, (name, size) in enumerate(SIZES.items()) if name in photos]
    headers = [jpeg_header.inspect(data, MAX_PIXELS) for data in datas]
    crops = decode_batch(datas, headers, cuda_model.spec, torch.device("cuda"))
    assert all(isinstance(c, torch.Tensor) and c.is_cuda for c in crops)
    ours = torch.softmax(cuda_model.outputs(crops), dim=1).cpu()  # type: ignore[arg-type]
    pillow = torch.softmax(cuda_model.outputs(
        [decode_image(d, cuda_model.spec, MAX_PIXELS).pixels for d in datas]), dim=1).cpu()
    assert float((ours - pillow).abs().max()) <= MAX_SCORE_DIFF
    assert ours.topk(5).indices.tolist() == pillow.topk(5).indices.tolist()

