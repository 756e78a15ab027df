"""What a decode worker's reply, or its death, means for the one file it had."""

from __future__ import annotations

import math
import signal
from dataclasses import dataclass
from typing import Any

import numpy as np

from inboxd.children import describe_exit
from inboxd.files.settling import Identity, changed
from inboxd.item import DecodedImage, PermanentError, TransientError, permanent


@dataclass(slots=True)
class DecodeResult:
    """What one file came to. ``error`` is set when it failed (``sha256`` may still be known);
    ``image`` is None for a duplicate (its sha256 was the expected one) and for failures."""

    sha256: str | None
    size_bytes: int | None
    image: DecodedImage | None = None
    duplicate: bool = False
    error: PermanentError | TransientError | None = None
    peak_rss_bytes: int = 0  # the worker's peak RSS while it worked on this file
    identity: Identity | None = None  # the file's, once every byte of it was read
    held_for_writing: bool = False  # another open file could still write to it then

    def still_being_written(self, claimed_as: Identity | None) -> bool:
        """Whether the file read is not the one claimed, or not finished: a writer paused
        longer than ``inbox.settle_ms``, and the file must go back to settle."""
        return self.held_for_writing or changed(claimed_as, self.identity)


def result_from(header: dict[str, Any], payload: bytearray) -> DecodeResult:
    sha256, size_bytes = header.get("sha256"), header.get("size_bytes")
    peak = int(header.get("peak_rss_bytes", 0))
    if not header.get("ok"):
        reason = str(header.get("reason"))
        error = (permanent(str(header.get("reason_class")), reason)
                 if header.get("permanent", True) else TransientError(reason))
        return DecodeResult(sha256, size_bytes, error=error, peak_rss_bytes=peak)
    found = header.get("identity")
    identity = None if found is None else _identity(found)
    held = bool(header.get("held_for_writing"))
    if header.get("duplicate"):
        return DecodeResult(sha256, size_bytes, duplicate=True, peak_rss_bytes=peak,
                            identity=identity, held_for_writing=held)
    shapes = [tuple(int(n) for n in shape)
              for shape in (header["shape"], *header.get("other_shapes", ()))]
    arrays, offset = [], 0
    for shape in shapes:  # each a view of the payload: writable (a bytearray), no copy
        size = math.prod(shape)  # not np.prod: its reduction costs more than the rest of this
        arrays.append(np.frombuffer(payload, dtype=np.uint8, count=size,
                                    offset=offset).reshape(shape))
        offset += size
    if offset != len(payload):
        raise ValueError(f"{len(payload)} payload bytes for images of shapes {shapes}")
    image = DecodedImage(arrays[0], int(header["width"]), int(header["height"]),
                         header.get("format"), str(header.get("mode")), others=tuple(arrays[1:]))
    return DecodeResult(sha256, size_bytes, image=image, peak_rss_bytes=peak, identity=identity,
                        held_for_writing=held)


def _identity(found: Any) -> Identity:
    ino, size, mtime_ns = (int(n) for n in found)  # ValueError unless three numbers
    return ino, size, mtime_ns


class DecodeTimedOut(TransientError):
    """The file used up ``decode_timeout_s``: transient the first time (the machine may have
    been starved), permanent when it happens again to the same file."""

    reason_class = "decode"


def death_error(code: int) -> PermanentError | TransientError:
    if code == -signal.SIGKILL:
        # Not us (we count our own kills as timeouts): most likely the kernel's OOM killer,
        # which says more about the machine than about this file. Try it again later.
        return TransientError("the decode worker was killed from outside (SIGKILL: the OOM "
                              "killer?) while decoding this file")
    return PermanentError(f"the decoder crashed on this file ({describe_exit(code)}); "
                          "the decode worker was replaced")
