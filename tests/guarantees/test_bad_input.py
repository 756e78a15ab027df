"""Bad input never stops the daemon: each case gets exactly one clear outcome.

One real ``inboxd once`` run (real model, real files) over every awkward input at once, plus
the cases that need a watching daemon (a slow writer, the same file twice).
"""

from __future__ import annotations

import hashlib
import io
import multiprocessing
import os
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest
from inboxd.files.reading import read_and_hash
from inboxd.item import TransientError
from PIL import Image

from tests.conftest import drop, make_image, read_json, wait_until, write_config


def png_claiming(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width``×``height`` (a decompression bomb's calling card)."""
    data = io.BytesIO()
    Image.new("L", (1, 1)).save(data, "PNG")
    raw = bytearray(data.getvalue())
    ihdr = struct.pack(">II", width, height) + raw[24:29]
    raw[16:29] = ihdr
    raw[29:33] = struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))
    return bytes(raw)


def jpeg_bytes(size: tuple[int, int] = (320, 240), exif_orientation: int | None = None,
               mode: str = "RGB") -> bytes:
    data = io.BytesIO()
    image = Image.new(mode, size, (10, 120, 200) if mode == "RGB" else (10, 120, 200, 0))
    exif = Image.Exif()
    if exif_orientation:
        exif[0x0112] = exif_orientation
    image.save(data, "JPEG", exif=exif.tobytes())
    return data.getvalue()


def animated(fmt: str) -> bytes:
    data = io.BytesIO()
    frames = [Image.new("RGB", (64, 64), c) for c in ((255, 0, 0), (0, 255, 0), (0, 0, 255))]
    frames[0].save(data, fmt, save_all=True, append_images=frames[1:], duration=100, loop=0)
    return data.getvalue()


SUCCEED = {
    "tiny.png": lambda: _png(Image.new("RGB", (1, 1), (5, 5, 5))),
    "cmyk.jpg": lambda: jpeg_bytes(mode="CMYK"),
    "gray16.png": lambda: _png(Image.new("I;16", (64, 48), 40000)),
    "palette.png": lambda: _png(Image.new("RGB", (64, 48), (200, 10, 10)).convert("P")),
    "alpha.png": lambda: _png(Image.new("RGBA", (64, 48), (0, 200, 0, 128))),
    "gray.png": lambda: _png(Image.new("L", (64, 48), 128)),
    "animated.gif": lambda: animated("GIF"),
    "animated.webp": lambda: animated("WEBP"),
    "rotated.jpg": lambda: jpeg_bytes((200, 100), exif_orientation=6),
    "with space.png": lambda: _png(Image.new("RGB", (8, 8))),
    "new\nline.png": lambda: _png(Image.new("RGB", (8, 8))),
    "x" * 245 + ".png": lambda: _png(Image.new("RGB", (8, 8))),
}
FAIL = {
    "empty.jpg": (lambda: b"", "empty file"),
    "random.jpg": (lambda: os.urandom(4096), "not an image"),
    "truncated.jpg": (lambda: jpeg_bytes((800, 600))[:2000], "truncated"),
    "truncated.png": (lambda: _png(Image.effect_noise((300, 300), 50))[:3000], "truncated"),
    "bomb.png": (lambda: png_claiming(100_000, 100_000), "pixels"),
}


def _png(image: Image.Image) -> bytes:
    data = io.BytesIO()
    image.save(data, "PNG")
    return data.getvalue()


@pytest.mark.daemon
@pytest.mark.slow
def test_every_awkward_input_gets_one_clear_outcome(tmp_path: Path) -> None:
    config = write_config(tmp_path, inbox={
        "include": ["*.jpg", "*.jpeg", "*.png", "*.webp", "*.gif"], "settle_ms": 0,
    }, preprocess={"max_image_pixels": 50_000_000})
    inbox = tmp_path / "inbox"
    for name, make in SUCCEED.items():
        (inbox / name).write_bytes(make())
    for name, (make, _) in FAIL.items():
        (inbox / name).write_bytes(make())
    non_utf8 = os.fsdecode(b"caf\xe9-\xff.png")  # Latin-1 bytes: not valid UTF-8
    (inbox / non_utf8).write_bytes(_png(Image.new("RGB", (8, 8))))
    os.mkfifo(inbox / "fifo.jpg")
    outside = tmp_path / "secret.png"
    outside.write_bytes(_png(Image.new("RGB", (8, 8))))
    os.symlink(outside, inbox / "link_out.png")
    os.symlink("loop.png", inbox / "loop.png")
    make_image(inbox / "folder.jpg" / "inner.png")  # a directory named like an image

    done = subprocess.run([sys.executable, "-m", "inboxd", "once", "-c", str(config)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr  # some files failed, and it said so
    results, failed = tmp_path / "results", tmp_path / "failed"

    for name in [*SUCCEED, non_utf8, "folder.jpg/inner.png"]:
        result = read_json(results / f"{name}.json")
        assert result["source"] == name
        assert (tmp_path / "done" / name).exists()
    rotated = read_json(results / "rotated.jpg.json")["image"]
    assert (rotated["width"], rotated["height"]) == (100, 200), "EXIF rotation applied first"
    assert read_json(results / "animated.gif.json")["image"]["format"] == "GIF"

    refused = {
        **{name: why for name, (_, why) in FAIL.items()},
        "fifo.jpg": "not a regular file",
        "link_out.png": "outside the inbox",
        "loop.png": "loop",
    }
    for name, why in refused.items():
        report = read_json(failed / f"{name}.error.json")
        assert why in report["reason"], (name, report)
        assert report["permanent"] is True
        assert os.path.lexists(failed / name), name
        assert f"failed {name}" in done.stderr, "a warning line for each failure"
    assert outside.read_bytes(), "the link's target was never touched"
    assert os.path.islink(failed / "link_out.png")
    assert f"{len(SUCCEED) + 2} completed, {len(refused)} failed" in done.stdout

    leftovers = [p for p in inbox.rglob("*") if ".processing" not in p.parts and p.is_file()]
    assert leftovers == []


def _read_as_nobody(path: str, out: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    os.setegid(65534)
    os.seteuid(65534)
    try:
        read_and_hash(path)
        out.put("read")
    except TransientError as exc:
        out.put(f"transient: {exc}")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to drop to another user")
def test_a_file_without_read_permission_is_a_transient_error(tmp_path: Path) -> None:
    """Root reads everything, so the check drops to ``nobody`` in a forked child."""
    tmp_path.chmod(0o755)
    locked = tmp_path / "locked.png"
    locked.write_bytes(b"whatever")
    locked.chmod(0)
    out: multiprocessing.Queue = multiprocessing.get_context("fork").Queue()  # type: ignore[type-arg]
    child = multiprocessing.get_context("fork").Process(target=_read_as_nobody,
                                                        args=(str(locked), out))
    child.start()
    child.join(30)
    assert out.get(timeout=5) == "transient: cannot open the file: Permission denied"


@pytest.mark.daemon
@pytest.mark.slow
def test_a_slowly_written_file_is_taken_only_when_complete(tmp_path: Path, daemon_factory) -> None:
    config = write_config(tmp_path, inbox={"settle_ms": 400})
    daemon = daemon_factory(config)
    daemon.wait_for("ready")
    payload = _png(Image.effect_noise((400, 400), 60).convert("RGB"))
    target = tmp_path / "inbox" / "slow.png"
    with open(target, "wb") as writer:
        for start in range(0, len(payload), len(payload) // 10 + 1):
            writer.write(payload[start:start + len(payload) // 10 + 1])
            writer.flush()
            time.sleep(0.1)  # the slow writer itself; the daemon must wait it out
    result_path = tmp_path / "results" / "slow.png.json"
    wait_until(result_path.exists, 30, "the slow file's result")
    assert read_json(result_path)["sha256"] == hashlib.sha256(payload).hexdigest()
    assert not (tmp_path / "failed").joinpath("slow.png").exists()
    assert daemon.stop() == 0


@pytest.mark.daemon
@pytest.mark.slow
def test_the_same_file_dropped_twice_keeps_one_result(tmp_path: Path, daemon_factory) -> None:
    config = write_config(tmp_path)
    daemon = daemon_factory(config)
    daemon.wait_for("ready")
    source = make_image(tmp_path / "a.png")
    drop(source, tmp_path / "inbox")
    result_path = tmp_path / "results" / "a.png.json"
    wait_until(result_path.exists, 30, "the first result")
    first = read_json(result_path)
    drop(source, tmp_path / "inbox")
    # The second copy may not replace the first in done/: it gets the content-named variant.
    second = tmp_path / "done" / f"a.{first['sha256'][:12]}.png"
    wait_until(second.exists, 30, "the second copy in done/")
    assert (tmp_path / "done" / "a.png").read_bytes() == second.read_bytes()
    assert read_json(result_path) == first, "same name, same content: the result stands"
    assert "DUPLICATE=1" in daemon.output()
    assert daemon.stop() == 0
