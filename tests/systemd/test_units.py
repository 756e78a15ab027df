"""The shipped systemd units: `systemd-analyze verify`, `security` exposure <= 1.5, and the
directives the daemon depends on (or must never get)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
UNITS = REPO / "systemd"
SERVICE = UNITS / "inboxd.service"
TEMPLATE = UNITS / "inboxd@.service"
EXAMPLE_CONFIG = REPO / "config" / "inboxd.example.yaml"
EXEC = "/opt/inboxd/.venv/bin/inboxd"
MAX_EXPOSURE = 1.5


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} is required in CI (Debian package systemd)")
        pytest.skip(f"{name} is not installed")
    return path


def directives(unit: Path) -> dict[str, list[str]]:
    """Key -> every value it is given (systemd units may repeat keys), comments dropped."""
    found: dict[str, list[str]] = {}
    for line in unit.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";", "[")):
            continue
        key, _, value = line.partition("=")
        found.setdefault(key.strip(), []).append(value.strip())
    return found


def _seconds(value: str) -> float:
    units = {"ms": 0.001, "s": 1, "sec": 1, "min": 60, "m": 60, "h": 3600}
    total = 0.0
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", value):
        total += float(number) * units[unit or "s"]
    return total


def _verify(unit_name: str, source: Path, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """verify insists that ExecStart's program exists, and /opt/inboxd is not installed here:
    check a copy whose only change is that path, pointing at a stub."""
    stub = tmp_path / "bin" / "inboxd"
    stub.parent.mkdir(exist_ok=True)
    stub.write_text("#!/bin/sh\nexit 0\n")
    stub.chmod(0o755)
    copy = tmp_path / source.name
    text = source.read_text()
    assert EXEC in text
    copy.write_text(text.replace(EXEC, str(stub)))
    return subprocess.run(
        [_tool("systemd-analyze"), "verify", str(tmp_path / unit_name)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize(
    ("unit_name", "source"),
    [
        ("inboxd.service", SERVICE),
        ("inboxd@.service", TEMPLATE),
        ("inboxd@0.service", TEMPLATE),
    ],
)
def test_systemd_analyze_verify(unit_name: str, source: Path, tmp_path: Path) -> None:
    proc = _verify(unit_name, source, tmp_path)
    # verify only warns (exit 0) about unknown keys or bad values: any output is a failure.
    assert proc.returncode == 0 and not (proc.stdout + proc.stderr).strip(), proc.stderr


def test_verify_catches_a_typo(tmp_path: Path) -> None:
    """Guard for the test above: a misspelt directive must show up."""
    bad = tmp_path / "src" / "inboxd.service"
    bad.parent.mkdir()
    bad.write_text(SERVICE.read_text().replace("KillMode=mixed", "KilMode=mixed"))
    proc = _verify("inboxd.service", bad, tmp_path)
    assert "Unknown key" in proc.stderr


@pytest.mark.parametrize("unit", [SERVICE, TEMPLATE], ids=lambda p: p.name)
def test_security_exposure(unit: Path) -> None:
    threshold = round(MAX_EXPOSURE * 10)  # systemd-analyze counts in tenths
    proc = subprocess.run(
        [
            _tool("systemd-analyze"),
            "security",
            "--offline=true",
            f"--threshold={threshold}",
            str(unit),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    match = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", proc.stdout)
    assert match, proc.stdout + proc.stderr
    exposure = float(match.group(1))
    assert exposure <= MAX_EXPOSURE, proc.stdout
    assert proc.returncode == 0, proc.stderr


MUST_HAVE = {
    "Type": "notify",
    "NotifyAccess": "main",
    "ExecReload": "/bin/kill -HUP $MAINPID",
    "Restart": "on-failure",
    "KillMode": "mixed",
    "User": "inboxd",
    "DevicePolicy": "closed",
    "ProtectSystem": "strict",
    "ReadWritePaths": "/var/lib/inboxd",
    "PrivateNetwork": "yes",
    "RestrictAddressFamilies": "AF_UNIX",
    "NoNewPrivileges": "yes",
    "CapabilityBoundingSet": "",
}
# Both break CUDA/PyTorch: PrivateDevices hides /dev/nvidia*, MemoryDenyWriteExecute forbids
# the JIT's writable+executable pages. ProcSubset=pid hides /proc/cpuinfo and
# /proc/driver/nvidia (torch falls back to its slow DEFAULT CPU kernels).
MUST_NOT_HAVE = {"PrivateDevices", "MemoryDenyWriteExecute", "ProcSubset"}


@pytest.mark.parametrize("unit", [SERVICE, TEMPLATE], ids=lambda p: p.name)
def test_required_directives(unit: Path) -> None:
    found = directives(unit)
    for key, value in MUST_HAVE.items():
        assert found.get(key) == [value], f"{key}= should be {value!r}, is {found.get(key)}"
    assert not MUST_NOT_HAVE & found.keys()
    # 78 (a bad config) must not restart-loop; 76 (a poisoned CUDA context) must restart.
    assert found["RestartPreventExitStatus"] == ["78"]
    assert found["Restart"] == ["on-failure"]
    # torch.compile's Inductor/Triton caches survive restarts (PrivateTmp would empty them).
    assert "TORCHINDUCTOR_CACHE_DIR=/var/lib/inboxd/cache/inductor" in found["Environment"]
    assert "TRITON_CACHE_DIR=/var/lib/inboxd/cache/triton" in found["Environment"]
    assert _seconds(found["WatchdogSec"][0]) > 0
    # The watchdog's SIGABRT is answered by the event loop; a stuck loop is killed this soon.
    assert 0 < _seconds(found["TimeoutAbortSec"][0]) < _seconds(found["TimeoutStopSec"][0])
    assert "PYTHONUNBUFFERED=1" in found["Environment"]
    assert found["MemoryHigh"] and found["MemoryMax"]
    assert found["ExecStart"][0].startswith(f"{EXEC} run -c /etc/inboxd/inboxd.yaml")

    devices = [value.split()[0] for value in found["DeviceAllow"]]
    if unit == TEMPLATE:  # its own GPU only, plus what every CUDA process needs
        assert {"/dev/nvidia%i", "/dev/nvidiactl", "char-nvidia-uvm"} <= set(devices)
        assert not {"char-nvidia", "char-nvidia-frontend"} & set(devices), "every GPU"
    else:
        assert {"char-nvidia-frontend", "char-nvidia", "char-nvidiactl",
                "char-nvidia-uvm"} <= set(devices)
    # A literal path never matches more than itself: /dev/nvidia* would allow nothing.
    assert not [d for d in devices if d.startswith("/dev/") and any(c in d for c in "*?[")]


@pytest.mark.parametrize("unit", [SERVICE, TEMPLATE], ids=lambda p: p.name)
def test_stop_timeout_outlasts_the_drain(unit: Path) -> None:
    config = yaml.safe_load(EXAMPLE_CONFIG.read_text())
    grace_s = float(config["shutdown"]["grace_s"])
    assert grace_s == 30
    assert _seconds(directives(unit)["TimeoutStopSec"][0]) > grace_s


def test_template_gives_each_instance_its_gpu() -> None:
    found = directives(TEMPLATE)
    assert "CUDA_VISIBLE_DEVICES=%i" in found["Environment"]
    assert "CUDA_DEVICE_ORDER=PCI_BUS_ID" in found["Environment"]
    assert found["ExecStart"][0].endswith("--instance gpu%i")


def test_example_config_matches_the_unit_layout() -> None:
    config = yaml.safe_load(EXAMPLE_CONFIG.read_text())
    writable = directives(SERVICE)["ReadWritePaths"][0]
    folders = [*config["inbox"]["paths"], config["results_dir"], config["done_dir"]]
    folders.append(config["failed_dir"])
    tmpfiles = (UNITS / "inboxd.tmpfiles").read_text()
    for folder in folders:
        assert folder.startswith(writable + "/"), folder
        assert re.search(rf"^d\s+{re.escape(folder)}\s", tmpfiles, re.MULTILINE), folder


@pytest.mark.skipif(os.geteuid() != 0, reason="chown in the scratch root needs root")
def test_sysusers_and_tmpfiles_create_the_layout(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    for tool, conf in (
        ("systemd-sysusers", "inboxd.sysusers"),
        ("systemd-tmpfiles", "inboxd.tmpfiles"),
    ):
        args = [_tool(tool), f"--root={root}"]
        if tool == "systemd-tmpfiles":
            args.append("--create")
        proc = subprocess.run(
            [*args, str(UNITS / conf)], capture_output=True, text=True, timeout=60, check=False
        )
        assert proc.returncode == 0, proc.stderr
    passwd = (root / "etc" / "passwd").read_text()
    entry = next(line for line in passwd.splitlines() if line.startswith("inboxd:"))
    uid, gid, home, shell = (entry.split(":")[i] for i in (2, 3, 5, 6))
    assert (home, shell) == ("/var/lib/inboxd", "/usr/sbin/nologin")
    for name, mode in (
        ("inbox", 0o2770),
        ("results", 0o2750),
        ("done", 0o2750),
        ("failed", 0o2750),
    ):
        st = (root / "var/lib/inboxd" / name).stat()
        assert (st.st_mode & 0o7777, st.st_uid, st.st_gid) == (mode, int(uid), int(gid)), name


METRICS_DROPIN = UNITS / "inboxd-metrics-http.conf"


def _exposure(*args: str) -> float:
    proc = subprocess.run([_tool("systemd-analyze"), "security", "--offline=true", *args],
                          capture_output=True, text=True, timeout=120, check=False)
    match = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", proc.stdout)
    assert match, proc.stdout + proc.stderr
    return float(match.group(1))


def test_the_metrics_http_dropin_opens_only_loopback_and_stays_within_target(
        tmp_path: Path) -> None:
    """metrics.listen needs the README's drop-in; applied as systemd applies it (a drop-in
    folder under --root), the unit stays within MAX_EXPOSURE and still denies every IP address
    but localhost."""
    system = tmp_path / "etc" / "systemd" / "system"
    (system / "inboxd.service.d").mkdir(parents=True)
    shutil.copy(SERVICE, system / "inboxd.service")
    shutil.copy(METRICS_DROPIN, system / "inboxd.service.d" / "metrics-http.conf")
    without = _exposure(str(SERVICE))
    with_dropin = _exposure(f"--root={tmp_path}", "inboxd.service")
    print(f"\nexposure: {without} without the drop-in, {with_dropin} with it")
    assert without < with_dropin <= MAX_EXPOSURE
    dropin = directives(METRICS_DROPIN)
    assert dropin["PrivateNetwork"] == ["no"]
    assert dropin["IPAddressAllow"] == ["localhost"]
    assert "IPAddressDeny" in directives(SERVICE)  # the deny-all the allow list punches through
