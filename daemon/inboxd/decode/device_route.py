"""Which files are decoded on the model's device, and the reading that decides it.

For a file whose name says JPEG, the preprocess thread reads and hashes it itself (no worker
round trip: the worker would only hand the bytes back), checks its header in pure Python
(``jpeg_header.inspect``) and hands an eligible one to the ``TensorDecoder``. Every other file
— another format, a JPEG that is progressive, CMYK, truncated, too large, or one the device
decoder rejects — returns ``None`` here and takes the sandboxed CPU path (``DecodePool``) as
before, which also gives every error the very words it gives today (an unreadable file, a link,
a FIFO: the worker reports them). ``decode/tensor.py`` has the security trade-off and the key
that turns this off (``preprocess.gpu_decode: off``).
"""

from __future__ import annotations

import hashlib
import logging
import os
from typing import TYPE_CHECKING, Protocol

from inboxd import logs
from inboxd.decode.device_crop import DecodeFailed, fits
from inboxd.decode.jpeg_header import NotEligible, inspect
from inboxd.decode.replies import DecodeResult
from inboxd.decode.spec import PreprocessSpec
from inboxd.files.reading import open_input
from inboxd.files.settling import held_open_for_writing, identity
from inboxd.item import PermanentError, TransientError

if TYPE_CHECKING:
    from inboxd.decode.tensor import TensorDecoder

JPEG_SUFFIXES = frozenset({".jpg", ".jpeg", ".jpe", ".jfif"})
# Read whole into the daemon's memory, once per preprocess thread: larger JPEGs (no camera
# makes one) take the CPU path, where a worker streams them under its own memory limit.
MAX_DEVICE_FILE_BYTES = 64 << 20


class Device(Protocol):
    """Where the model runs: a ``torch.device``, or the CPU said without torch."""

    @property
    def type(self) -> str: ...


class DeviceRoute:
    def __init__(self, decoder: TensorDecoder, spec: PreprocessSpec, max_pixels: int,
                 max_file_bytes: int) -> None:
        self.decoder = decoder
        self.spec = spec
        self.max_pixels = max_pixels
        self.max_file_bytes = min(max_file_bytes, MAX_DEVICE_FILE_BYTES)
        self.device_decoded = 0  # files whose crop came from the device
        self.cpu_fallbacks = 0  # JPEG names that took the CPU path after all

    def decode(self, path: os.PathLike[str] | str,
               expected_sha256: str | None) -> DecodeResult | None:
        """The file's outcome from the device path, or None: take the CPU path."""
        if os.path.splitext(path)[1].lower() not in JPEG_SUFFIXES:  # no pathlib: per file
            return None
        try:
            with open_input(path, self.max_file_bytes) as handle:
                before = os.fstat(handle.fileno())
                data = handle.read(self.max_file_bytes + 1)
                after = os.fstat(handle.fileno())
                held = held_open_for_writing(handle.fileno())
        except (PermanentError, TransientError, OSError):
            return self._fallback(path, "the CPU path reads and reports it")
        if len(data) > self.max_file_bytes:
            return self._fallback(path, "larger than the device path reads")
        sha256, size_bytes = hashlib.sha256(data).hexdigest(), len(data)
        if (after.st_size, after.st_mtime_ns) != (before.st_size, before.st_mtime_ns) or (
                size_bytes != after.st_size):
            return DecodeResult(sha256, size_bytes, error=TransientError(
                "the file changed while it was being read; it is read again"))
        identity_now = identity(after)
        if expected_sha256 is not None and sha256 == expected_sha256:
            return DecodeResult(sha256, size_bytes, duplicate=True, identity=identity_now,
                                held_for_writing=held)
        try:
            header = inspect(data, self.max_pixels)
        except NotEligible as why:
            return self._fallback(path, str(why))
        if not fits(header, self.spec):
            return self._fallback(path, "extreme aspect ratio")
        try:
            image = self.decoder.decode(data, header)
        except DecodeFailed as why:
            return self._fallback(path, f"the device decoder refused it: {why}")
        self.device_decoded += 1
        return DecodeResult(sha256, size_bytes, image=image, identity=identity_now,
                            held_for_writing=held)

    def _fallback(self, path: os.PathLike[str] | str, why: str) -> DecodeResult | None:
        """None (take the CPU path), said in a debug line."""
        self.cpu_fallbacks += 1
        logs.emit(logging.DEBUG, "cpu_decode", f"{os.fspath(path)}: CPU decode ({why})",
                  path=os.fspath(path), reason=why)
        return None

    def close(self) -> None:
        self.decoder.close()


def build(mode: str, device: Device, spec: PreprocessSpec, max_pixels: int,
          max_file_bytes: int, threads: int) -> DeviceRoute | None:
    """The route for ``preprocess.gpu_decode`` (``mode``) with the model on ``device``, or None:
    only a GPU decodes in the daemon (on the CPU the sandboxed workers are as fast)."""
    if mode == "off" or device.type != "cuda":
        return None
    # Only here: torchvision's decoder (and torch) load where a GPU decodes, nowhere else.
    from inboxd.decode.tensor import TensorDecoder, supported

    why = supported(spec)
    if why is not None:
        logs.emit(logging.WARNING, "gpu_decode", f"JPEGs are decoded on the CPU: {why}",
                  reason=why)
        return None
    # At most one file per preprocess thread is waiting, so a batch never exceeds ``threads``.
    logs.emit(logging.INFO, "gpu_decode", f"baseline JPEGs are decoded on {device} (nvJPEG, "
              "in the daemon, after a header check); preprocess.gpu_decode: off keeps every "
              "file in the sandboxed decode workers", device=str(device))
    import torch

    assert isinstance(device, torch.device)
    decoder = TensorDecoder(spec, device, max_batch=max(1, threads))
    return DeviceRoute(decoder, spec, max_pixels, max_file_bytes)
