"""One decode worker process: reads, hashes and decodes one untrusted file at a time.

Started by ``decode/worker_process.py`` as ``python -m inboxd.decode.worker_child``: a fresh
interpreter, never a fork of the daemon (which has threads and torch), importing only Pillow,
numpy and the small modules below. Whatever a file does to it — any exception, a runaway
allocation (it runs under ``RLIMIT_AS``), a hang (the daemon kills it), a crash in a C decoder —
costs that file and, at worst, this process; the daemon answers the file and starts a new
worker.

Lifetime (``inboxd.children``): it exits when its request pipe reaches EOF and is killed by the
kernel when the daemon dies, even by SIGKILL, even mid-decode; SIGINT, SIGTERM and SIGHUP are
ignored, so a decode the daemon is still draining is not cut short.
"""

from __future__ import annotations

import ctypes
import faulthandler
import io
import os
import resource
import struct
import sys
import time
import warnings
from typing import Any

import numpy as np
from PIL import Image

import inboxd
from inboxd import testing, wire
from inboxd.children import die_with_parent, protocol_fds
from inboxd.decode.pillow import decode_image
from inboxd.decode.spec import PreprocessSpec
from inboxd.files.reading import classify, hash_stream, open_input
from inboxd.files.settling import held_open_for_writing, identity, survive_lease_breaks
from inboxd.item import PermanentError, TooLargeError, TransientError
from inboxd.proc_status import status_bytes

# Test-only fault injection (``testing.DECODE_FAULTS``), read only here:
# "abort=crash,hang=slow,raise:RuntimeError=rt" makes a file whose name contains "crash" abort
# this process, and so on; "slow:2.5=name" sleeps 2.5 s before decoding it (a decode that takes
# a while, then succeeds). Unset in production.
# A request names up to preprocess.files_per_request paths (each up to PATH_MAX, hex-encoded).
REQUEST_HEADER_BYTES = 1 << 20
FAULT_KINDS = {"abort", "segv", "hang", "spin", "alloc", "exit", "raise", "slow"}
RAISABLE: dict[str, type[BaseException]] = {
    e.__name__: e for e in (RuntimeError, NotImplementedError, AttributeError, MemoryError,
                            KeyError, IndexError, TypeError, RecursionError, ZeroDivisionError)
} | {"struct.error": struct.error}


def parse_faults(spec: str) -> list[tuple[str, str]]:
    """``kind[:detail]=name-substring`` pairs, e.g. ``[("raise:RuntimeError", "rt")]``."""
    faults = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        kind, _, needle = part.partition("=")
        name, _, detail = kind.partition(":")
        bad_detail = ((name == "raise" and detail not in RAISABLE)
                      or (name == "slow" and not _seconds(detail)))
        if name not in FAULT_KINDS or not needle or bad_detail:
            raise ValueError(f"{testing.DECODE_FAULTS}: cannot parse {part!r} (kinds: "
                             f"{sorted(FAULT_KINDS)}, raise:<one of {sorted(RAISABLE)}>, "
                             "slow:<seconds>)")
        faults.append((kind, needle))
    return faults


def _seconds(text: str) -> bool:
    try:
        return float(text) > 0
    except ValueError:
        return False


def inject(faults: list[tuple[str, str]], path: str) -> None:
    name = os.path.basename(path)
    for kind, needle in faults:
        if needle not in name:
            continue
        if kind == "abort":
            os.abort()
        elif kind == "segv":
            ctypes.string_at(0)  # a real SIGSEGV, as a C decoder would take
        elif kind == "hang":
            while True:
                time.sleep(1)
        elif kind == "spin":  # a hang that burns the CPU, as a decoder caught in a loop
            while True:
                pass
        elif kind == "alloc":
            hog = [bytearray(1 << 26) for _ in range(1 << 20)]  # until RLIMIT_AS says no
            del hog
        elif kind == "exit":
            os._exit(3)
        elif kind.startswith("slow:"):
            time.sleep(float(kind.partition(":")[2]))
        else:
            raise RAISABLE[kind.partition(":")[2]](f"injected by {testing.DECODE_FAULTS}")


class Worker:
    def __init__(self, init: dict[str, Any]) -> None:
        self.spec = PreprocessSpec.from_dict(init["spec"])
        self.other_specs = tuple(PreprocessSpec.from_dict(s) for s in init.get("other_specs", ()))
        self.max_pixels: int = init["max_image_pixels"]
        self.max_file_bytes: int = init["max_file_bytes"]
        self.decode_memory_bytes: int = init["decode_memory_bytes"]
        self.faults = parse_faults(testing.hook(testing.DECODE_FAULTS))
        Image.MAX_IMAGE_PIXELS = self.max_pixels

    def warm_up(self) -> None:
        """Load every Pillow plugin and decoder library now, so the memory limit is measured
        from a worker that has them mapped, and the first real file is not slower."""
        Image.init()
        for fmt in ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF"):
            data = io.BytesIO()
            Image.new("RGB", (8, 8)).save(data, fmt)
            decode_image(data.getvalue(), self.spec, self.max_pixels)

    def limit_memory(self) -> str | None:
        """Address space = what the warmed-up worker maps now + ``decode_memory_mb``. Returns
        why it could not be set (a seccomp filter, say), for the daemon to log."""
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a crash must not dump gigabytes
        limit = vm_size_bytes() + self.decode_memory_bytes
        try:
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        except (OSError, ValueError) as exc:
            return str(exc)
        return None

    def handle(self, entry: dict[str, Any]) -> tuple[dict[str, Any], bytes | memoryview, bool]:
        """One file of a request: (reply header, pixel bytes, whether this process should exit
        after replying)."""
        path = os.fsdecode(bytes.fromhex(entry["path_hex"]))
        state: dict[str, Any] = {"sha256": None, "size_bytes": None}
        try:
            header, pixels = self._decode(path, entry.get("expected_sha256"), state,
                                          entry.get("opened"))
            return header, pixels, False
        except (PermanentError, TransientError) as exc:
            return _error(exc, state), b"", False
        except MemoryError:
            return _error(TooLargeError(
                f"decoding needs more memory than preprocess.decode_memory_mb = "
                f"{self.decode_memory_bytes >> 20} allows (a decompression bomb? raise it if "
                "such files are real images)"), state), b"", True  # start clean after this
        except OSError as exc:
            return _error(classify(exc, "cannot read the file"), state), b"", False
        except Exception as exc:
            # Any other type from a decoder on hostile bytes (RuntimeError, struct.error,
            # NotImplementedError, ...): a decoder bug this file found, not ours to crash on.
            return _error(PermanentError(
                f"the decoder failed on this file: {type(exc).__name__}: {exc}"), state), b"", False

    def _decode(self, path: str, expected: str | None, state: dict[str, Any],
                opened: str | None = None) -> tuple[dict[str, Any], bytes | memoryview]:
        image = None
        with open_input(path, self.max_file_bytes, opened) as handle:
            before = os.fstat(handle.fileno())
            state["sha256"], state["size_bytes"], whole = hash_stream(handle,
                                                                       self.max_file_bytes)
            if expected is None or state["sha256"] != expected:
                inject(self.faults, path)
                if whole is None:
                    handle.seek(0)
                image = decode_image(handle if whole is None else whole, self.spec,
                                     self.max_pixels, self.other_specs)
            # Asked on the file just read, with every byte of it behind us: the daemon
            # compares the identity with the claim's and gives a changing file back to settle.
            after = os.fstat(handle.fileno())
            state["identity"] = identity(after)
            state["held_for_writing"] = held_open_for_writing(handle.fileno())
        if (after.st_size, after.st_mtime_ns) != (before.st_size, before.st_mtime_ns):
            raise TransientError("the file changed while it was being read; it is read again")
        if image is None:
            return {"ok": True, "duplicate": True, **state}, b""
        header = {"ok": True, "duplicate": False, **state, "shape": list(image.pixels.shape),
                  "width": image.width, "height": image.height, "format": image.format,
                  "mode": image.mode}
        if not image.others:
            return header, np.ascontiguousarray(image.pixels).data
        # One payload, the tasks' images one after another (a copy, only with several tasks).
        header["other_shapes"] = [list(other.shape) for other in image.others]
        return header, b"".join(np.ascontiguousarray(a).data for a in (image.pixels,
                                                                       *image.others))


def _error(exc: PermanentError | TransientError, state: dict[str, Any]) -> dict[str, Any]:
    return {"ok": False, "permanent": isinstance(exc, PermanentError),
            "reason_class": exc.reason_class, "reason": str(exc) or type(exc).__name__,
            **state}


def vm_size_bytes() -> int:
    return status_bytes("VmSize")


def peak_rss_bytes() -> int:
    """VmHWM, not ``ru_maxrss``: the latter survives exec and so starts at the peak of
    whatever process started this one."""
    return status_bytes("VmHWM")


# After each file VmHWM is restarted only when it stands this far above the current RSS (the
# file allocated and freed): for the common small file the two are equal, and the restart (a
# walk of every page table) and a second read of /proc are skipped. A reported peak then
# includes at most this much of an earlier file's.
PEAK_SLACK_BYTES = 1 << 20


_status_fd: int | None = None


def rss_and_peak_bytes() -> tuple[int, int]:
    """(VmRSS, VmHWM) in one read of /proc/self/status (after every file: found, not parsed
    line by line; the file kept open, which takes 7 us a read where opening it each time took
    18)."""
    global _status_fd
    if _status_fd is None:
        _status_fd = os.open("/proc/self/status", os.O_RDONLY | os.O_CLOEXEC)
    text = os.pread(_status_fd, 1 << 14, 0)  # both fields come within the first KB
    return _kb_field(text, b"VmRSS:") * 1024, _kb_field(text, b"VmHWM:") * 1024


def _kb_field(text: bytes, name: bytes) -> int:
    start = text.index(name) + len(name)
    return int(text[start:text.index(b"kB", start)])


def reset_peak_rss() -> None:
    """Start VmHWM again from the current RSS, so each reply reports that file's own peak."""
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
    except OSError:
        pass  # an old kernel or a sandbox: the peak is then the worker's lifetime peak


def main() -> None:
    requests, replies = protocol_fds()
    survive_lease_breaks()
    faulthandler.enable()  # a C crash leaves a Python traceback in the journal
    # Pillow warns about every oddity of hostile metadata; the outcome says what matters.
    warnings.simplefilter("ignore")
    reader = wire.Reader(requests, REQUEST_HEADER_BYTES)
    init, _ = reader.recv()
    die_with_parent(init["parent_pid"])
    worker = Worker(init)
    worker.warm_up()
    limit_error = worker.limit_memory()
    wire.send(replies, {"ready": True, "pid": os.getpid(), "limit_error": limit_error,
                        "heavy_modules": [m for m in ("torch", "torchvision") if m in sys.modules],
                        "faults": testing.hook(testing.DECODE_FAULTS),
                        "inboxd_path": inboxd.__file__,
                        "peak_rss_bytes": peak_rss_bytes()})
    reset_peak_rss()  # the first file's peak is its own, not the warm-up's
    while True:
        try:
            request, _ = reader.recv()
        except EOFError:
            return
        # From here on, a death is the doing of the first file not yet answered.
        # The request's number on the receipt and on each reply, with the file's place: the
        # daemon reads a frame that is not the one it waits for as a malformed reply.
        number = request.get("request")
        wire.send(replies, {"ack": True, "request": number})
        for index, entry in enumerate(request["files"]):
            header, payload, recycle = worker.handle(entry)
            rss, peak = rss_and_peak_bytes()
            header["peak_rss_bytes"] = peak
            header["recycle"] = recycle
            header["request"], header["file"] = number, index
            wire.send(replies, header, payload)
            if recycle:
                return  # the daemon gives the request's other files to a fresh worker
            if peak > rss + PEAK_SLACK_BYTES:  # after the reply: off this file's latency
                reset_peak_rss()

if __name__ == "__main__":
    main()
