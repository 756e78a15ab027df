"""Decoders compared as a decode worker runs them: Pillow (exact, fast) against libvips.

Each (decoder, threads) runs in a fresh child process set up as ``decode/worker_child.py`` sets up a
worker (its environment, ``Worker.limit_memory``: ``RLIMIT_AS`` = the warmed-up size +
``decode_memory_mb``), decodes every photo once untimed, then times each photo one after
another on its thread; the children run in turns, ``--repeats`` rounds. Reported: median ms per
photo per kind of photo, and the child's peak RSS (VmHWM).

libvips (``pyvips`` with ``pyvips-binary``'s own libjpeg-turbo and libheif) makes the crop the
way a user's script would: ``thumbnail_buffer`` to the torchvision resize size (shrink-on-load:
JPEG DCT scaling, libwebp's scaled decode), then the centre crop, alpha over white, sRGB.
``VIPS_CONCURRENCY`` sets its thread pool; HEIC threads are libheif's (pillow-heif's
``DECODE_THREADS`` for Pillow).

    pip install -e '.[bench]'   # pyvips + pyvips-binary: for this benchmark only
    python -m bench.decoders [--repeats 3] [--interleaved | --heic-parallel]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from bench.photos import build_corpus

OUT = Path("bench/out/decoders")
DECODE_MEMORY_BYTES = 1536 << 20
MAX_PIXELS = 89_478_485


def vips_crop(data: bytes, resize: int, crop: int) -> np.ndarray:
    """The crop as libvips makes it: shorter side to ``resize`` (torchvision's arithmetic),
    centre ``crop``², RGB uint8."""
    import pyvips

    head = pyvips.Image.new_from_buffer(data, "")  # the header only: nothing decoded yet
    width, height = head.width, head.height
    orientation = head.get("orientation") if head.get_typeof("orientation") else 1
    if orientation in (5, 6, 7, 8):
        width, height = height, width
    if width <= height:
        new_w, new_h = resize, int(resize * height / width)
    else:
        new_w, new_h = int(resize * width / height), resize
    thumb = pyvips.Image.thumbnail_buffer(data, new_w, height=new_h, size="force")
    return _centre_crop_rgb(thumb, new_w, new_h, crop)


def _centre_crop_rgb(image: Any, new_w: int, new_h: int, crop: int) -> np.ndarray:
    """The centred ``crop``² of a resized libvips image, as RGB uint8 (alpha over white)."""
    left, top = round((new_w - crop) / 2.0), round((new_h - crop) / 2.0)
    image = image.crop(left, top, crop, crop)
    if image.hasalpha():
        image = image.flatten(background=[255, 255, 255])
    if image.interpretation not in ("srgb", "b-w"):
        image = image.colourspace("srgb")
    if image.bands == 1:
        image = image.bandjoin([image, image])
    image = image.cast("uchar")
    return np.ndarray(buffer=image.write_to_memory(), dtype=np.uint8,
                      shape=(image.height, image.width, image.bands))


def vips_margin_crop(data: bytes, resize: int, crop: int, margin: float = 4) -> np.ndarray:
    """libvips held to Pillow fast's fidelity: a JPEG shrunk on load only down to ``margin`` ×
    the target (jpegload ``shrink``), then libvips' resize (a box shrink, then cubic)."""
    import pyvips

    head = pyvips.Image.new_from_buffer(data, "")
    options = {}
    if head.get("vips-loader") == "jpegload_buffer":
        shorter = min(head.width, head.height)
        shrink = max([s for s in (1, 2, 4, 8) if shorter / s >= margin * resize] or [1])
        options["shrink"] = shrink
    image = pyvips.Image.new_from_buffer(data, "", **options).autorot()
    width, height = image.width, image.height
    if width <= height:
        new_w, new_h = resize, int(resize * height / width)
    else:
        new_w, new_h = int(resize * width / height), resize
    image = image.resize(new_w / width, vscale=new_h / height, kernel="cubic")
    return _centre_crop_rgb(image, new_w, new_h, crop)


def photos() -> dict[str, list[Path]]:
    """Kind of photo -> files: the bench corpus's JPEGs, and HEIC/WebP made from its 12 MP."""
    OUT.mkdir(parents=True, exist_ok=True)
    small = [p.path for p in build_corpus(Path("bench/out/photos"), sizes=["0.3MP"],
                                          formats=["jpg"])]
    large = [p.path for p in build_corpus(Path("bench/out/photos"), sizes=["12MP"],
                                          formats=["jpg"])]
    kinds: dict[str, list[Path]] = {"12-MP JPEG": large, "0.3-MP JPEG": small}
    import pillow_heif
    from PIL import Image

    made: dict[str, list[Path]] = {"12-MP HEIC": [], "12-MP HEIC, 512 grid": [],
                                   "12-MP WebP": []}
    for source in large[:3]:
        for kind, suffix in (("12-MP HEIC", ".heic"), ("12-MP HEIC, 512 grid", ".grid.heic"),
                             ("12-MP WebP", ".webp")):
            path = OUT / (source.stem + suffix)
            if not path.is_file():
                with Image.open(source) as image:
                    rgb = image.convert("RGB")
                out = io.BytesIO()
                if suffix == ".webp":
                    rgb.save(out, "WEBP", quality=85)
                else:
                    pillow_heif.options.GRID_TILE_SIZE = 512 if "grid" in suffix else 0
                    pillow_heif.from_pillow(rgb).save(out, quality=80)
                path.write_bytes(out.getvalue())
            made[kind].append(path)
    return kinds | made


def child(decoder: str, threads: int, files: list[str]) -> None:
    """In the child: set up as a worker, warm up, decode each file (``decoders`` in main)."""
    import pillow_heif
    from inboxd.decode import pillow
    from inboxd.decode.spec import PreprocessSpec
    from inboxd.decode.worker_child import Worker, peak_rss_bytes

    pillow_heif.options.DECODE_THREADS = threads
    spec = PreprocessSpec(256, 224, "bicubic", (0.5,) * 3, (0.5,) * 3)
    worker = Worker({"spec": {**{f: getattr(spec, f) for f in ("resize", "crop",
                                                                "interpolation", "mean",
                                                                "std")},
                              "resize_mode": "exact"},
                     "max_image_pixels": MAX_PIXELS, "max_file_bytes": 256 << 20,
                     "decode_memory_bytes": DECODE_MEMORY_BYTES})
    worker.warm_up()
    if decoder.startswith("vips"):
        import pyvips

        pyvips.cache_set_max(0)  # a worker decodes each file once: nothing to cache
    datas = [Path(f).read_bytes() for f in files]
    if decoder.startswith("vips"):
        try:
            vips_crop(datas[0], 256, 224)
        except pyvips.Error as exc:  # pyvips-binary's libheif has no HEVC decoder
            print(json.dumps({"unsupported": str(exc).splitlines()[-1][:200]}))
            return
    limit_error = worker.limit_memory()
    moded = replace(spec, resize_mode="fast" if decoder == "pillow-fast" else "exact")

    def decode(data: bytes) -> np.ndarray:
        if decoder == "vips":
            return vips_crop(data, 256, 224)
        if decoder == "vips-margin4":
            return vips_margin_crop(data, 256, 224)
        return pillow.decode_image(data, moded, MAX_PIXELS).pixels

    for data in datas:  # untimed: each decoder's first use of each code path
        decode(data)
    times = []
    for data in datas:
        started = time.perf_counter()
        crop = decode(data)
        times.append((time.perf_counter() - started) * 1000)
        assert crop.shape == (224, 224, 3), crop.shape
    print(json.dumps({"ms": times, "peak_rss_mb": peak_rss_bytes() / 2**20,
                      "limit_error": limit_error}))


# (decoder, threads): pillow-exact with pillow-heif's default 4 HEIC threads is today's worker.
DECODERS = [("pillow-exact", 4), ("pillow-fast", 1), ("pillow-fast", 2), ("pillow-fast", 4),
            ("vips", 1), ("vips", 2)]


def run_child(decoder: str, threads: int, files: list[Path]) -> dict[str, object]:
    from inboxd.decode.worker_process import worker_env

    env = {**worker_env(), "VIPS_CONCURRENCY": str(threads)}
    out = subprocess.run([sys.executable, "-m", "bench.decoders", "--child", decoder,
                          str(threads), *map(str, files)], env=env, capture_output=True,
                         text=True, check=True, timeout=600)
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


INTERLEAVED = ("pillow-exact", "pillow-fast", "vips", "vips-margin4")


def interleaved_child(kinds: dict[str, list[str]], repeats: int) -> None:
    """In one child set up as a worker: every decoder takes its turn on each photo in each
    round, so a shared machine's load falls on all of them alike."""
    import pyvips
    from inboxd.decode import pillow
    from inboxd.decode.worker_child import Worker

    pyvips.cache_set_max(0)
    from inboxd.decode.spec import PreprocessSpec

    spec = PreprocessSpec(256, 224, "bicubic", (0.5,) * 3, (0.5,) * 3)
    worker = Worker({"spec": {"resize": 256, "crop": 224, "interpolation": "bicubic",
                              "mean": (0.5,) * 3, "std": (0.5,) * 3, "resize_mode": "exact"},
                     "max_image_pixels": MAX_PIXELS, "max_file_bytes": 256 << 20,
                     "decode_memory_bytes": DECODE_MEMORY_BYTES})
    worker.warm_up()
    vips_crop(Path(kinds["12-MP JPEG"][0]).read_bytes(), 256, 224)
    worker.limit_memory()
    decoders: dict[str, Callable[[bytes], Any]] = {
        "pillow-exact": lambda d: pillow.decode_image(d, spec, MAX_PIXELS).pixels,
        "pillow-fast": lambda d: pillow.decode_image(d, replace(spec, resize_mode="fast"),
                                                     MAX_PIXELS).pixels,
        "vips": lambda d: vips_crop(d, 256, 224),
        "vips-margin4": lambda d: vips_margin_crop(d, 256, 224),
    }
    times: dict[str, dict[str, list[float]]] = {}
    for _ in range(repeats):
        for kind, files in kinds.items():
            for file in files:
                data = Path(file).read_bytes()
                for name in INTERLEAVED:
                    if "HEIC" in kind and name.startswith("vips"):
                        continue
                    started = time.perf_counter()
                    decoders[name](data)
                    elapsed_ms = (time.perf_counter() - started) * 1000
                    times.setdefault(name, {}).setdefault(kind, []).append(elapsed_ms)
    print(json.dumps(times))


def interleaved(kinds: dict[str, list[Path]], repeats: int) -> None:
    from inboxd.decode.worker_process import worker_env

    env = {**worker_env(), "VIPS_CONCURRENCY": "1"}
    chosen = {k: [str(p) for p in v] for k, v in kinds.items() if k != "12-MP HEIC"}
    out = subprocess.run([sys.executable, "-m", "bench.decoders", "--interleaved-child",
                          json.dumps(chosen), str(repeats)], env=env, capture_output=True,
                         text=True, check=True, timeout=1200)
    times = json.loads(out.stdout.strip().splitlines()[-1])
    names = list(chosen)
    print("\n| decoder, in turns, one thread | " + " | ".join(f"{k} ms (median / min)"
                                                          for k in names) + " |")
    print("|---|" + "---|" * len(names))
    for name in INTERLEAVED:
        cells = [f"{statistics.median(times[name][k]):.1f} / {min(times[name][k]):.1f}"
                 if k in times[name] else "cannot" for k in names]
        print(f"| {name} | " + " | ".join(cells) + " |")


def parallel_heic(kinds: dict[str, list[Path]], repeats: int, workers: int = 2) -> None:
    """``workers`` children decoding the same HEICs at once, as a busy daemon's workers do: each
    one's median ms per photo while the others decode too (their timed passes overlap), for
    each libheif thread count (pillow-heif's DECODE_THREADS)."""
    print(f"\n| {workers} workers decoding at once | threads | ms per photo in each worker |"
          "\n|---|---|---|")
    for kind in ("12-MP HEIC", "12-MP HEIC, 512 grid"):
        files = kinds[kind] * 2
        per_photo: dict[int, list[float]] = {}
        for _ in range(repeats):
            for threads in (1, 2, 4):
                with ThreadPoolExecutor(workers) as pool:
                    got = list(pool.map(run_child, ["pillow-fast"] * workers,
                                        [threads] * workers, [files] * workers))
                for result in got:
                    ms = result["ms"]
                    assert isinstance(ms, list)
                    per_photo.setdefault(threads, []).append(statistics.median(ms))
        for threads, values in per_photo.items():
            print(f"| {kind} | {threads} | {statistics.median(values):.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--heic-parallel", action="store_true",
                        help="only the HEIC threads with two workers decoding at once")
    parser.add_argument("--interleaved", action="store_true",
                        help="only every decoder in turns on each photo, in one worker")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--interleaved-child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]), args.child[2:])
        return
    if args.interleaved_child:
        interleaved_child(json.loads(args.interleaved_child[0]),
                          int(args.interleaved_child[1]))
        return
    kinds = photos()
    if args.heic_parallel:
        parallel_heic(kinds, args.repeats)
        return
    if args.interleaved:
        interleaved(kinds, args.repeats)
        return
    results: dict[tuple[str, int, str], list[float]] = {}
    peaks: dict[tuple[str, int], float] = {}
    unsupported: dict[tuple[str, str], str] = {}
    for _ in range(args.repeats):
        for decoder, threads in DECODERS:
            for kind, files in kinds.items():
                got = run_child(decoder, threads, files)
                if "unsupported" in got:
                    unsupported[(decoder, kind)] = str(got["unsupported"])
                    continue
                ms = got["ms"]
                assert isinstance(ms, list)
                results.setdefault((decoder, threads, kind), []).append(statistics.median(ms))
                peak = got["peak_rss_mb"]
                assert isinstance(peak, float)
                peaks[(decoder, threads)] = max(peaks.get((decoder, threads), 0.0), peak)
                if got["limit_error"]:
                    print(f"{decoder}: no memory limit: {got['limit_error']}", file=sys.stderr)
    names = list(kinds)
    print("| decoder | threads | " + " | ".join(f"{k} ms" for k in names)
          + " | peak RSS MiB |")
    print("|---|---|" + "---|" * len(names) + "---|")
    for decoder, threads in DECODERS:
        cells = [f"{statistics.median(results[(decoder, threads, k)]):.1f}"
                 if (decoder, threads, k) in results else "cannot" for k in names]
        print(f"| {decoder} | {threads} | " + " | ".join(cells)
              + f" | {peaks[(decoder, threads)]:.0f} |")
    for (decoder, kind), why in sorted(unsupported.items()):
        print(f"{decoder} cannot decode {kind}: {why}")


if __name__ == "__main__":
    os.environ.setdefault("VIPS_WARNING", "0")
    main()
