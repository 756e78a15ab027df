"""This process's memory figures from ``/proc/self/status`` (VmSize, VmPeak, VmHWM, ...): what
the decode workers and the ONNX probe set their address-space limits and report peaks from."""

from __future__ import annotations


def status_bytes(field: str) -> int:
    """``field`` of ``/proc/self/status`` (given there in kB) in bytes."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"no {field} in /proc/self/status")
