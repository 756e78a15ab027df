"""The inboxd scenario, run *inside* the container by its probe unit, as root, under a real
systemd as PID 1 (see inboxd-scenario.sh and tests/systemd/test_systemd_nspawn.py).

    python scenario.py OUTDIR

Installs the shipped unit (only its paths changed) with a test drop-in, the sysusers and
tmpfiles files and a config, then: start -> READY (and the sandbox as the kernel applies it:
ids, capabilities, seccomp, mounts, namespaces, cgroup device/IP filters) -> results -> journal
stats -> reload -> watchdog restart -> stop. Everything it sees goes to OUTDIR/scenario.json,
rewritten after every step so a failure still says how far it got; the pytest side asserts on
it. It asserts nothing itself and always exits 0 unless it crashes.

Runs with the checkout's own venv interpreter (bound into the container read-only), so it has
PyYAML and Pillow; it never imports inboxd.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import yaml
from PIL import Image

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))
from support.waiting import wait_until  # noqa: E402 (found through REPO, just above)

OUT = Path(sys.argv[1] if len(sys.argv) > 1 else "/probe-out")
UNIT = "inboxd.service"
DATA = Path("/var/lib/inboxd")
INBOX, RESULTS, DONE = DATA / "inbox", DATA / "results", DATA / "done"
CONFIG = Path("/etc/inboxd/inboxd.yaml")
FAILED = DATA / "failed"
METRICS_TEXTFILE = DATA / "metrics" / "inboxd.prom"
PREFIX = Path("/opt/inboxd")  # the same checkout, bound there too (inboxd-scenario.sh)
MEMBER_UID, STRANGER_UID = 4242, 4343
WATCHDOG_SEC = 6
HANG_ON_CALL = 3  # model calls 1 and 2 (one file each) succeed, the 3rd hangs
QUEUE_BEFORE, QUEUE_AFTER = 2, 5

report: dict[str, Any] = {"steps": {}, "timings_s": {}, "errors": []}
T0 = time.monotonic()


def save() -> None:
    report["timings_s"]["total"] = round(time.monotonic() - T0, 2)
    tmp = OUT / ".scenario.json.tmp"
    tmp.write_text(json.dumps(report, indent=2, sort_keys=True))
    os.replace(tmp, OUT / "scenario.json")


def log(message: str) -> None:
    print(f"[{time.monotonic() - T0:7.2f} s] {message}", flush=True)


def run(*argv: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)


def show(*props: str) -> dict[str, str]:
    out = run("systemctl", "show", UNIT, "-p", ",".join(props)).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def journal(*matches: str) -> list[dict[str, Any]]:
    out = run("journalctl", "-u", UNIT, *matches, "-o", "json", "--no-pager").stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def events(name: str, since_us: int = 0) -> list[dict[str, Any]]:
    return [r for r in journal(f"INBOXD_EVENT={name}")
            if int(r["__REALTIME_TIMESTAMP"]) >= since_us]


def now_us() -> int:
    return time.time_ns() // 1000


# The tests' own wait, from the checkout bound into the container (standard library only);
# polling systemctl and journalctl, every 0.1 s is often enough.
wait_for = partial(wait_until, every_s=0.1)


def drop(name: str, color: tuple[int, int, int]) -> None:
    """Drop an image the way well-behaved writers do: a hidden temp name, then a rename."""
    tmp = INBOX / f".{name}.part"
    Image.new("RGB", (96, 64), color).save(tmp, format="JPEG")
    os.rename(tmp, INBOX / name)


def result_of(name: str) -> dict[str, Any] | None:
    path = RESULTS / f"{name}.json"
    try:
        document: dict[str, Any] = json.loads(path.read_text())  # atomic: complete or absent
        return document
    except FileNotFoundError:
        return None


def proc_status(pid: int) -> dict[str, str]:
    keep = {"Uid", "Gid", "NoNewPrivs", "Seccomp", "CapEff", "CapBnd", "CapAmb"}
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError as exc:
        return {"error": str(exc)}
    fields = dict(line.split(":", 1) for line in lines if ":" in line)
    return {k: v.strip() for k, v in fields.items() if k in keep}


def step(name: str) -> Callable[[Callable[[dict[str, Any]], None]], Callable[[], bool]]:
    """Run a step, recording its duration and any exception; False stops the scenario."""
    def wrap(body: Callable[[dict[str, Any]], None]) -> Callable[[], bool]:
        def runner() -> bool:
            data: dict[str, Any] = {}
            report["steps"][name] = data
            log(f"--- {name}")
            started = time.monotonic()
            try:
                body(data)
                ok = True
            except Exception as exc:
                data["error"] = f"{type(exc).__name__}: {exc}"
                report["errors"].append(f"{name}: {data['error']}")
                log(traceback.format_exc())
                ok = False
            report["timings_s"][name] = round(time.monotonic() - started, 2)
            save()
            return ok
        return runner
    return wrap


# --- the steps ---------------------------------------------------------------------------------

@step("install")
def install(data: dict[str, Any]) -> None:
    data["pid1"] = Path("/proc/1/comm").read_text().strip()
    data["systemd_version"] = run("systemctl", "--version").stdout.splitlines()[0]

    # The shipped unit with only its paths changed: the venv is this checkout's.
    shipped = (REPO / "systemd" / UNIT).read_text()
    unit = (shipped
            .replace("/opt/inboxd/.venv/bin/inboxd", f"{REPO}/.venv/bin/inboxd")
            .replace("file:///opt/inboxd/README.md", f"file://{REPO}/README.md"))
    data["changed_lines"] = [
        [old, new] for old, new in zip(shipped.splitlines(), unit.splitlines(), strict=True)
        if old != new]
    Path("/etc/systemd/system", UNIT).write_text(unit)

    # The test drop-in: a short watchdog, a model call that hangs, a quick restart. And the
    # venv's base interpreter (or the checkout): when it lives under /root or /home (a pyenv),
    # ProtectHome=yes hides it (203/EXEC), so this one directive is relaxed to tmpfs with just
    # those folders bound back in, read-only. Every other directive stays as shipped.
    hidden = [str(path) for path in (Path(sys.base_prefix), REPO)
              if any(path.is_relative_to(p) for p in ("/root", "/home", "/run/user"))]
    dropin = [
        "[Service]",
        f"WatchdogSec={WATCHDOG_SEC}",
        "RestartSec=1",
        f"Environment=INBOXD_TEST_MODEL_FAULTS=hang_on_batch={HANG_ON_CALL}",
    ]
    if hidden:
        dropin += ["ProtectHome=tmpfs", f"BindReadOnlyPaths={' '.join(hidden)}"]
    # A checkout under /tmp (CI may clone there) is hidden by PrivateTmp=yes: bind it back
    # into the private /tmp, read-only; PrivateTmp itself stays.
    in_tmp = [str(path) for path in (Path(sys.base_prefix), REPO)
              if any(path.is_relative_to(p) for p in ("/tmp", "/var/tmp"))]
    if in_tmp:
        dropin += [f"BindReadOnlyPaths={' '.join(in_tmp)}"]
    dropin_dir = Path("/etc/systemd/system", UNIT + ".d")
    dropin_dir.mkdir(exist_ok=True)
    (dropin_dir / "nspawn-test.conf").write_text("\n".join(dropin) + "\n")
    data["dropin"] = dropin

    # The inboxd user and its folders, installed as the README says.
    for folder in ("/etc/sysusers.d", "/etc/tmpfiles.d"):
        Path(folder).mkdir(exist_ok=True)
    shutil.copy(REPO / "systemd/inboxd.sysusers", "/etc/sysusers.d/inboxd.conf")
    shutil.copy(REPO / "systemd/inboxd.tmpfiles", "/etc/tmpfiles.d/inboxd.conf")
    for argv in (("systemd-sysusers", "/etc/sysusers.d/inboxd.conf"),
                 ("systemd-tmpfiles", "--create", "/etc/tmpfiles.d/inboxd.conf")):
        done = run(*argv)
        if done.returncode != 0:
            raise RuntimeError(f"{argv}: {done.stderr.strip()}")
    data["inboxd_user"] = run("getent", "passwd", "inboxd").stdout.strip()
    data["folders"] = {p.name: oct(p.stat().st_mode & 0o7777) for p in (DATA, INBOX, RESULTS)}

    # The packaged example config, made quick: stats every second, fast settle and rescan.
    config = yaml.safe_load((REPO / "config/inboxd.example.yaml").read_text())
    config["inbox"].update(settle_ms=50, rescan_interval_s=2)
    config["stats"]["interval_s"] = 1
    config["shutdown"]["grace_s"] = 10
    config["capacity"]["queue"] = QUEUE_BEFORE
    # Metrics through the shipped sandbox: a textfile is just a file under /var/lib/inboxd.
    config["metrics"] = {"textfile": str(METRICS_TEXTFILE)}
    CONFIG.parent.mkdir(parents=True, exist_ok=True)
    CONFIG.write_text(yaml.safe_dump(config, sort_keys=False))
    CONFIG.chmod(0o644)

    # Enabled, as installed for real; it also keeps the unit loaded after it stops, so its
    # ExecMain*/Result/NRestarts can still be read then.
    for argv in (("systemctl", "daemon-reload"), ("systemctl", "enable", UNIT)):
        done = run(*argv)
        if done.returncode != 0:
            raise RuntimeError(f"{argv}: {done.stderr.strip()}")
    verify = run("systemd-analyze", "verify", UNIT)
    data["verify"] = {"rc": verify.returncode, "output": (verify.stdout + verify.stderr).strip()}
    security = run("systemd-analyze", "security", "--no-pager", UNIT)
    lines = security.stdout.strip().splitlines()
    data["security_overall"] = lines[-1] if lines else security.stderr.strip()


@step("start")
def start(data: dict[str, Any]) -> None:
    # While `systemctl start` blocks, sample the unit: it must stay "activating" until the
    # daemon's READY=1 (sent only after the model is loaded and warmed up).
    begin_us = now_us()
    began = time.monotonic()
    starting = subprocess.Popen(["systemctl", "start", UNIT], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    samples: list[list[Any]] = []
    while starting.poll() is None:
        state = show("ActiveState", "SubState")
        if starting.poll() is not None:
            break  # sampled after it returned: not evidence either way
        samples.append([round(time.monotonic() - began, 2), state["ActiveState"],
                        state["SubState"]])
        time.sleep(0.2)
    _, stderr = starting.communicate(timeout=150)
    returned_us = now_us()
    data["systemctl_start_s"] = round(time.monotonic() - began, 2)
    data["rc"] = starting.returncode
    data["stderr"] = stderr.strip()
    data["states_while_starting"] = sorted({f"{a}/{b}" for _, a, b in samples})
    data["samples_while_starting"] = len(samples)
    data["last_activating_at_s"] = max((t for t, a, _ in samples if a == "activating"),
                                       default=None)
    data["show"] = show("ActiveState", "SubState", "StatusText", "MainPID", "NRestarts",
                        "Result", "WatchdogUSec", "User", "MemoryMax", "MemoryHigh")
    if starting.returncode != 0:
        data["journal_tail"] = run("journalctl", "-u", UNIT, "-n", "40", "--no-pager").stdout
        raise RuntimeError(f"systemctl start failed: {stderr.strip()}")
    # "started" is logged once the model is loaded and warmed up, just before READY=1.
    started, ready = events("started", begin_us), events("ready", begin_us)
    data["started_records"] = len(started)
    data["ready_records"] = len(ready)
    if started:
        started_us = int(started[0]["__REALTIME_TIMESTAMP"])
        data["model_loaded_after_s"] = round((started_us - begin_us) / 1e6, 2)
        data["start_returned_after_model_loaded_s"] = round((returned_us - started_us) / 1e6, 2)
        data["model_device"] = started[0].get("DEVICE")
        data["warmup_s"] = started[0].get("WARMUP_S")
    pid = int(data["show"]["MainPID"])
    report["first_pid"] = pid
    # The sandbox as the kernel sees it, not as the unit file says it.
    data["proc_status"] = proc_status(pid)
    data["uid_map"] = Path(f"/proc/{pid}/uid_map").read_text().split()
    data["private_network"] = os.readlink(f"/proc/{pid}/ns/net") != os.readlink("/proc/1/ns/net")
    mounts = {}
    for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines():
        fields = line.split()
        mounts[fields[4]] = fields[5].split(",")[0] + " " + line.split(" - ")[1].split()[0]
    data["mounts"] = {p: mounts.get(p) for p in ("/", "/var/lib/inboxd", "/root", str(REPO),
                                                  "/tmp", "/home")}


# Run inside a given cgroup: try a device that DevicePolicy=closed denies (nspawn's own
# /dev/net/tun: opening works, reading says EBADFD) and an IP packet that IPAddressDeny=any drops.
CGROUP_PROBE = """
import errno, socket, sys
if sys.argv[1]:
    with open(sys.argv[1] + "/cgroup.procs", "w") as procs:
        procs.write("0")
def attempt(action):
    try:
        action()
        return "allowed"
    except OSError as exc:
        return "allowed" if exc.errno == errno.EBADFD else errno.errorcode.get(exc.errno, "?")
print(attempt(lambda: open("/dev/net/tun", "rb").read(1)))
udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
print(attempt(lambda: udp.sendto(b"x", ("127.0.0.1", 9))))
"""


@step("cgroup")
def cgroup(data: dict[str, Any]) -> None:
    """Whether the unit's cgroup directives are enforced: the kernel's answers from inside the
    running service's own cgroup, next to a control outside it (the probe's own cgroup)."""
    pid = report["first_pid"]
    fs = run("stat", "-f", "-c", "%T", "/sys/fs/cgroup").stdout.strip()
    data["cgroup_fs"] = fs
    path = next(line.split("::", 1)[1] for line in
                Path(f"/proc/{pid}/cgroup").read_text().splitlines() if line.startswith("0::"))
    root = Path("/sys/fs/cgroup" if fs == "cgroup2fs" else "/sys/fs/cgroup/unified")
    folder = root / path.lstrip("/")
    data["cgroup"] = str(folder)
    for name in ("memory.max", "memory.high"):
        file = folder / name
        data[name] = file.read_text().strip() if file.exists() else None
    for where, arg in (("outside", ""), ("inside", str(folder))):
        done = run(sys.executable, "-c", CGROUP_PROBE, arg)
        answers = [*done.stdout.split(), "?", "?"]
        data[f"device_{where}"], data[f"ip_{where}"] = answers[:2]
        if done.returncode != 0:
            data[f"error_{where}"] = done.stderr.strip()[-300:]
    # The same check with a throwaway unit that only has DevicePolicy=closed: tells "not
    # enforced for inboxd" from "this container cannot enforce it at all".
    control = run("systemd-run", "--wait", "--quiet", "--pipe", "-p", "DevicePolicy=closed",
                  "cat", "/dev/net/tun")
    data["device_control"] = ("EPERM" if "Operation not permitted" in control.stderr
                              else control.stderr.strip()[-200:] or "allowed")


@step("results")
def results(data: dict[str, Any]) -> None:
    # One file at a time: each is its own model call (calls 1 and 2 succeed).
    for name, color in (("one.jpg", (200, 30, 30)), ("two.jpg", (30, 30, 200))):
        began = time.monotonic()
        drop(name, color)
        result = wait_for(partial(result_of, name), 30, f"the result of {name}")
        data[name] = {
            "latency_s": round(time.monotonic() - began, 2),
            "top1": result["top_k"][0] if result.get("top_k") else None,
            "done": (DONE / name).exists(),
            "keys": sorted(result),
        }


@step("stats")
def stats(data: dict[str, Any]) -> None:
    records = wait_for(lambda: [r for r in events("stats") if int(r.get("COMPLETED", 0)) >= 2],
                       15, "a stats record counting both files")
    wait_for(lambda: len(events("stats")) >= 2, 15, "a second stats record")
    latest = records[-1]
    data["records"] = len(events("stats"))
    data["latest"] = {k: latest.get(k) for k in (
        "COMPLETED", "ACCEPTED", "ENQUEUED", "FAILED", "QUEUE_CAPACITY", "QUEUE_SIZE",
        "SYSLOG_IDENTIFIER", "_SYSTEMD_UNIT", "PRIORITY")}
    data["fields"] = sorted(k for k in latest if not k.startswith("_") and k.isupper())


@step("reload")
def reload(data: dict[str, Any]) -> None:
    pid_before = show("MainPID")["MainPID"]
    config = yaml.safe_load(CONFIG.read_text())
    config["capacity"]["queue"] = QUEUE_AFTER
    CONFIG.write_text(yaml.safe_dump(config, sort_keys=False))
    since_us = now_us()
    done = run("systemctl", "reload", UNIT)
    data["rc"] = done.returncode
    data["stderr"] = done.stderr.strip()
    reloaded = wait_for(lambda: events("reloaded", since_us), 15, "a reloaded record")
    data["reloaded_message"] = reloaded[0].get("MESSAGE")
    data["changed_live"] = reloaded[0].get("CHANGED_LIVE")
    after = wait_for(lambda: [r for r in events("stats", since_us)
                              if r.get("QUEUE_CAPACITY") == str(QUEUE_AFTER)],
                     15, f"a stats record with QUEUE_CAPACITY={QUEUE_AFTER}")
    data["stats_queue_capacity"] = after[0].get("QUEUE_CAPACITY")
    after_us = int(after[0]["__REALTIME_TIMESTAMP"])
    data["stats_after_reload_s"] = round((after_us - since_us) / 1e6, 2)
    # STATUS= is refreshed every few seconds: give it time to show the new capacity too.
    with contextlib.suppress(TimeoutError):  # recorded below; the pytest side judges it
        wait_for(lambda: f"/{QUEUE_AFTER}," in show("StatusText")["StatusText"], 10,
                 "STATUS= with the new queue capacity")
    data["show"] = show("ActiveState", "SubState", "MainPID", "StatusText")
    data["same_pid"] = data["show"]["MainPID"] == pid_before


@step("watchdog")
def watchdog(data: dict[str, Any]) -> None:
    old_pid = int(show("MainPID")["MainPID"])
    since_us = now_us()
    began = time.monotonic()
    drop("three.jpg", (30, 200, 30))  # model call 3: hangs for ever
    seen: list[dict[str, str]] = []

    def restarted() -> bool:
        state = show("ActiveState", "SubState", "Result", "NRestarts", "MainPID",
                     "ExecMainCode", "ExecMainStatus")
        if not seen or state != seen[-1]:
            seen.append(state)
            log(f"{state}")
        return (int(state["NRestarts"]) >= 1 and state["SubState"] == "running"
                and int(state["MainPID"]) not in (0, old_pid))

    wait_for(restarted, 60, "the watchdog restart", every_s=0.05)
    data["restarted_after_s"] = round(time.monotonic() - began, 2)
    data["states_seen"] = seen
    data["old_pid"], data["new_pid"] = old_pid, int(seen[-1]["MainPID"])
    result = wait_for(lambda: result_of("three.jpg"), 30, "the result of three.jpg")
    data["result_after_s"] = round(time.monotonic() - began, 2)
    data["top1"] = result["top_k"][0] if result.get("top_k") else None
    data["daemon_watchdog_records"] = [r.get("MESSAGE") for r in events("watchdog", since_us)]
    data["recovered"] = [r.get("RECOVERED") for r in events("recovered", since_us)]
    unit_msgs = [r for r in journal() if int(r["__REALTIME_TIMESTAMP"]) >= since_us
                 and r.get("_PID") == "1"]
    data["systemd_messages"] = [r.get("MESSAGE") for r in unit_msgs]
    data["unit_results"] = [r["UNIT_RESULT"] for r in unit_msgs if "UNIT_RESULT" in r]
    data["show"] = show("ActiveState", "SubState", "NRestarts", "MainPID", "StatusText")


@step("stop")
def stop(data: dict[str, Any]) -> None:
    pid = int(show("MainPID")["MainPID"])
    since_us = now_us()
    began = time.monotonic()
    done = run("systemctl", "stop", UNIT, timeout_s=90)
    data["systemctl_stop_s"] = round(time.monotonic() - began, 2)
    data["rc"] = done.returncode
    data["show"] = show("ActiveState", "SubState", "Result", "ExecMainStatus", "ExecMainCode",
                        "ExecMainPID", "NRestarts")
    data["pid"] = pid
    data["stopping_records"] = len(events("stopping", since_us))
    data["stopped_records"] = [r.get("_PID") for r in events("stopped", since_us)]
    data["systemd_messages"] = [r.get("MESSAGE") for r in journal()
                                if int(r["__REALTIME_TIMESTAMP"]) >= since_us
                                and r.get("_PID") == "1"]
    data["inbox_left"] = sorted(str(p.relative_to(INBOX)) for p in INBOX.rglob("*")
                                if p.is_file() and not p.name.endswith(".lock"))


# --- make install, as a user would run it ---------------------------------------------------

def hidden_python_dropin() -> list[str]:
    """The one concession to this test machine: the venv's base Python may live in a pyenv under
    /root, which ProtectHome=yes hides (README: build the venv from /usr/bin/python3); and a
    checkout cloned under /tmp (its venv's scripts name their interpreter there) is hidden by
    PrivateTmp=yes: both bound back in, read-only, as the scenario's own drop-in does."""
    hidden = [str(path) for path in (Path(sys.base_prefix), REPO)
              if any(path.is_relative_to(p) for p in ("/root", "/home", "/run/user"))]
    in_tmp = [str(path) for path in (Path(sys.base_prefix), REPO)
              if any(path.is_relative_to(p) for p in ("/tmp", "/var/tmp"))]
    dropin = ["ProtectHome=tmpfs", f"BindReadOnlyPaths={' '.join(hidden)}"] if hidden else []
    dropin += [f"BindReadOnlyPaths={' '.join(in_tmp)}"] if in_tmp else []
    return ["[Service]", *dropin] if dropin else []


def as_uid(uid: int, groups: str, *argv: str) -> subprocess.CompletedProcess[str]:
    """A process of an unprivileged user whose only extra right is ``groups`` (or none)."""
    group_arg = f"--groups={groups}" if groups else "--clear-groups"
    return run("setpriv", f"--reuid={uid}", f"--regid={uid}", group_arg, "--", *argv)


def member_drops(name: str, data: bytes) -> subprocess.CompletedProcess[str]:
    staged = Path("/tmp") / name
    staged.write_bytes(data)
    staged.chmod(0o644)
    gid = run("getent", "group", "inboxd").stdout.split(":")[2]
    return as_uid(MEMBER_UID, gid, "sh", "-c", f"cp {staged} {INBOX}/.{name}.part && "
                  f"mv {INBOX}/.{name}.part {INBOX}/{name}")


def jpeg(color: tuple[int, int, int]) -> bytes:
    buffer = OUT / ".jpeg.tmp"
    Image.new("RGB", (96, 64), color).save(buffer, format="JPEG")
    return buffer.read_bytes()


def installed_files() -> dict[str, bool]:
    return {str(p): p.exists() for p in (
        Path("/etc/systemd/system/inboxd.service"), Path("/etc/systemd/system/inboxd@.service"),
        Path("/usr/lib/sysusers.d/inboxd.conf"), Path("/usr/lib/tmpfiles.d/inboxd.conf"),
        CONFIG, PREFIX / ".venv" / "bin" / "inboxd")}


@step("make_install")
def make_install(data: dict[str, Any]) -> None:
    # Clear away the hand-made install of the steps above; the data and the config stay (the
    # config to see that make install never overwrites one).
    run("systemctl", "disable", UNIT)
    shutil.rmtree(Path("/etc/systemd/system", UNIT + ".d"), ignore_errors=True)
    for path in (Path("/etc/systemd/system", UNIT), Path("/etc/sysusers.d/inboxd.conf"),
                 Path("/etc/tmpfiles.d/inboxd.conf")):
        path.unlink(missing_ok=True)
    run("systemctl", "daemon-reload")
    data["before"] = installed_files()
    config_before = CONFIG.read_bytes()
    for attempt in ("first", "second"):  # idempotent: the second run changes nothing
        done = run("make", "-C", str(PREFIX), "install", timeout_s=180)
        data[attempt] = {"rc": done.returncode, "output": (done.stdout + done.stderr).strip()}
        if done.returncode != 0:
            raise RuntimeError(f"make install ({attempt}) failed: {data[attempt]['output']}")
    data["after"] = installed_files()
    data["config_kept"] = CONFIG.read_bytes() == config_before
    data["unit_as_shipped"] = (Path("/etc/systemd/system", UNIT).read_text()
                               == (REPO / "systemd" / UNIT).read_text())
    data["exec_start"] = show("ExecStart")["ExecStart"]
    data["inboxd_user"] = run("getent", "passwd", "inboxd").stdout.strip()
    dropin = hidden_python_dropin()
    if dropin:
        folder = Path("/etc/systemd/system", UNIT + ".d")
        folder.mkdir(exist_ok=True)
        (folder / "test-python.conf").write_text("\n".join(dropin) + "\n")
        run("systemctl", "daemon-reload")
    data["dropin"] = dropin
    began = time.monotonic()
    done = run("systemctl", "enable", "--now", UNIT, timeout_s=150)
    data["enable_now"] = {"rc": done.returncode, "stderr": done.stderr.strip(),
                          "s": round(time.monotonic() - began, 2)}
    data["show"] = show("ActiveState", "SubState", "UnitFileState", "User", "FragmentPath")
    if done.returncode != 0:
        data["journal_tail"] = run("journalctl", "-u", UNIT, "-n", "40", "--no-pager").stdout
        raise RuntimeError(f"systemctl enable --now failed: {done.stderr.strip()}")


@step("group_drop")
def group_drop(data: dict[str, Any]) -> None:
    done = member_drops("member.jpg", jpeg((200, 120, 30)))
    data["drop_rc"], data["drop_stderr"] = done.returncode, done.stderr.strip()
    result = wait_for(partial(result_of, "member.jpg"), 60, "the result of member.jpg")
    data["top1"] = result["top_k"][0] if result.get("top_k") else None
    path = str(RESULTS / "member.jpg.json")
    gid = run("getent", "group", "inboxd").stdout.split(":")[2]
    data["member_reads_result"] = as_uid(MEMBER_UID, gid, "cat", path).returncode == 0
    data["stranger_reads_result"] = as_uid(STRANGER_UID, "", "cat", path).returncode == 0
    data["stranger_drop_rc"] = as_uid(STRANGER_UID, "", "sh", "-c",
                                      f"echo x > {INBOX}/stranger.jpg").returncode


@step("retry")
def retry(data: dict[str, Any]) -> None:
    done = member_drops("broken.jpg", b"not a jpeg at all" * 10)
    data["drop_rc"] = done.returncode
    report_path = FAILED / "broken.jpg.error.json"
    report_doc = json.loads(wait_for(lambda: report_path.exists() and report_path.read_text(),
                                     60, "broken.jpg to fail"))
    data["reason_class"] = report_doc.get("reason_class")
    (FAILED / "broken.jpg").write_bytes(jpeg((30, 160, 90)))  # the cause fixed: a real photo
    done = run(str(PREFIX / ".venv" / "bin" / "inboxd"), "retry", "-c", str(CONFIG),
               str(FAILED / "broken.jpg"))
    data["rc"], data["stdout"], data["stderr"] = (done.returncode, done.stdout.strip(),
                                                  done.stderr.strip())
    result = wait_for(partial(result_of, "broken.jpg"), 60, "the result of the retried file")
    data["top1"] = result["top_k"][0] if result.get("top_k") else None
    data["report_left"] = report_path.exists()
    data["done"] = (DONE / "broken.jpg").exists()


@step("metrics_textfile")
def metrics_textfile(data: dict[str, Any]) -> None:
    def written() -> str | None:
        text = METRICS_TEXTFILE.read_text() if METRICS_TEXTFILE.exists() else ""
        return text if 'inboxd_completed_total{instance="default"} 2.0' in text else None

    text = wait_for(written, 15, "a textfile counting the two files of this start")
    data["mode"] = oct(METRICS_TEXTFILE.stat().st_mode & 0o777)
    data["lines"] = [line for line in text.splitlines()
                     if line.startswith(("inboxd_completed_total", "inboxd_failed_total",
                                         "inboxd_layer_capacity_items"))]


@step("make_uninstall")
def make_uninstall(data: dict[str, Any]) -> None:
    for attempt in ("first", "second"):
        done = run("make", "-C", str(PREFIX), "uninstall", timeout_s=120)
        data[attempt] = {"rc": done.returncode, "output": (done.stdout + done.stderr).strip()}
    data["after"] = installed_files()
    data["show"] = show("LoadState", "ActiveState")
    data["inboxd_processes"] = run("pgrep", "-u", "inboxd").stdout.split()
    data["data_kept"] = {str(p): p.exists() for p in (
        RESULTS / "member.jpg.json", RESULTS / "broken.jpg.json", DONE / "member.jpg")}
    data["user_kept"] = bool(run("getent", "passwd", "inboxd").stdout.strip())


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    for body in (install, start, cgroup, results, stats, reload, watchdog, stop,
                 make_install, group_drop, retry, metrics_textfile, make_uninstall):
        if not body():
            break
    # For whoever reads a failure: the whole unit journal, as systemd and inboxd wrote it.
    (OUT / "inboxd-journal.txt").write_text(
        run("journalctl", "-u", UNIT, "-o", "short-monotonic", "--no-pager").stdout)
    # Anything the whole boot complained about (a directive the sandbox cannot apply shows up
    # here as a warning from systemd or from the unit's own set-up).
    warnings = run("journalctl", "-b", "-p", "warning", "-o", "short-monotonic",
                   "--no-pager").stdout
    (OUT / "boot-warnings.txt").write_text(warnings)
    report["boot_warnings"] = warnings.splitlines()[-60:]
    save()
    log(f"scenario done, errors: {report['errors'] or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
