"""A model-based test of the file guarantees: a seeded random sequence of what users and the
system do, against the real daemon, checked against a reference model of where every input's
bytes must end up.

What users and the system do: drop (temp + rename), drop under a name that is in use, write in
place without a temp name, drop the same bytes again, replace or delete a file still waiting,
rename it inside the inbox, move a whole folder in, put a link in (to a file and to a folder
outside), drop with a future mtime, drop a corrupt file, fill the output disk and free it,
SIGKILL the daemon and start it again, stop a helper process (or the daemon with all of them)
for a while and continue it, reload a config file that cannot be used and then the fixed one;
and what a member of the inbox's group can do (issue
33): a folder named like a done file or a result (its files can never be filed there: they
end in failed/), links planted in the inbox's hidden folders (``.processing``, its ``.tmp``,
the temp names ``inboxd submit`` used to use) and ``inboxd submit`` beside them,
``.processing`` swapped for a folder of the neighbour's own for a moment, and (issue 36)
``.processing`` renamed away for good and replaced by one of the neighbour's. The model (issue
36) is a bring-your-own ``.onnx`` that answers some batch sizes with the wrong number of rows.

The reference model only tracks bytes (by sha256): every input must end exactly once in done/
(with ``results/<its name>.json`` describing those bytes, or — for a byte-identical re-drop — an
earlier result of the same bytes) or in failed/ with its ``.error.json``; an input the *user*
replaced or deleted before it was claimed may instead vanish. A good photo (one that decodes,
under a name that can be filed) never ends in failed/: not for a full disk, a kill, a stopped
helper or anything else that is not its own problem. Nothing outside the inbox may
change, and after the drain nothing is left in ``.processing/`` or in a temp folder, and the
search index holds exactly the result files (names and sha256s).

CI runs ``STEPS_CI`` steps; ``make soak`` runs ``STEPS_SOAK`` with ≥ 20 kills. The seed is
printed; replay with ``INBOXD_MODEL_SEED=N``.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from inboxd import cli
from PIL import Image

from support.harness import sha256_hex as sha
from tests.byo_models import labels_file, onnx_wrong_rows
from tests.conftest import DaemonProcess, read_json, write_config
from tests.guarantees.test_stuck_helpers import helper_pids
from tests.index_check import assert_index_matches_results

STEPS_CI = 320
STEPS_SOAK = 2000
KILL_EVERY_STEPS = 60  # on average: 5 kills in CI, ~33 in the soak
NAMES = ["scan.png", "a.png", "b.png", "deep/c.png", "deep/er/d.png"]
ROOT = os.geteuid() == 0
NEIGHBOUR_UID = 42_421  # the owner of a .processing the neighbour made


_LIBC = ctypes.CDLL(None, use_errno=True)
RENAME_EXCHANGE = 2


RENAME_NOREPLACE = 1


def rename_noreplace(a: Path, b: Path) -> None:
    """``mv -n``: ``FileExistsError`` when ``b`` exists (``renameat2(RENAME_NOREPLACE)``)."""
    if _LIBC.renameat2(-100, os.fsencode(a), -100, os.fsencode(b), RENAME_NOREPLACE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(b))


def exchange(a: Path, b: Path) -> None:
    """Swap two paths atomically (``renameat2(RENAME_EXCHANGE)``)."""
    if _LIBC.renameat2(-100, os.fsencode(a), -100, os.fsencode(b), RENAME_EXCHANGE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(a))


def claim_area_at(folder: Path) -> bool:
    """Whether ``folder`` is one of the daemon's claim areas (held or former): a ``*.lock`` in
    it. Links are never areas."""
    if folder.is_symlink():
        return False
    try:
        return any(entry.endswith(".lock") for entry in os.listdir(folder))
    except OSError:
        return False


@dataclass
class Reference:
    """Where the bytes of every input must end up."""

    must_end: collections.Counter[str] = field(default_factory=collections.Counter)
    may_vanish: collections.Counter[str] = field(default_factory=collections.Counter)
    corrupt: set[str] = field(default_factory=set)
    # Good photos that may still fail: their name can never be filed (a folder named like an
    # outcome). Any other good photo in failed/ is a guarantee broken.
    unfileable: set[str] = field(default_factory=set)
    unfileable_folders: set[Path] = field(default_factory=set)  # what is dropped there, too
    outside: dict[Path, str] = field(default_factory=dict)  # files that must not change
    origin: dict[str, str] = field(default_factory=dict)  # sha256 → how it came, for a report

    def added(self, data: bytes, how: str = "") -> None:
        self.must_end[sha(data)] += 1
        self.origin.setdefault(sha(data), how)

    def vanished_maybe(self, digest: str) -> None:
        """The user replaced or deleted it: if nobody had claimed it yet, it is gone."""
        if self.must_end[digest] > 0:
            self.must_end[digest] -= 1
            self.may_vanish[digest] += 1


class World:
    def __init__(self, root: Path, seed: int, models: dict[str, Any] | None = None) -> None:
        self.root = root
        self.rng = random.Random(seed)
        self.inbox = root / "inbox"
        self.outputs = root / "out"
        self.elsewhere = root / "elsewhere"
        self.elsewhere.mkdir()
        self.ref = Reference()
        self.counter = 0
        self.ballast: Path | None = None
        if models:
            chosen: dict[str, Any] = {"model": None, "models": models}
        else:
            # The model answers batches of 3 to 7 with one row too few (issue 36): sizes the
            # CPU's warm-up (1 and 8) and the start-up probe (2) never try, which batches
            # gathered for up to 200 ms come in. Each such batch must be split until every
            # photo has its own answer, and no photo may fail for its batch-mates.
            wrong = onnx_wrong_rows(root / "wrong-rows.onnx", set(range(3, 8)))
            chosen = {"model": {"onnx": str(wrong), "labels": str(labels_file(root, 3))},
                      "batch": {"max_size": 8, "max_delay_ms": 200}}
        self.config = write_config(
            root, inbox={"settle_ms": 100, "rescan_interval_s": 2},
            results_dir=str(self.outputs / "results"), done_dir=str(self.outputs / "done"),
            failed_dir=str(self.outputs / "failed"),
            capacity={"event_buffer": 32, "queue": 2, "preprocess_cache": 4, "retry_list": 64},
            retry={"max_attempts": 200, "backoff_initial_ms": 50, "backoff_max_ms": 400},
            shutdown={"grace_s": 5}, **chosen)
        self.daemon: DaemonProcess | None = None
        self.batch_splits = 0  # of the daemons before this one
        self.kills = 0
        self.helper_stops = 0
        self.broken_reloads = 0

    # -- bytes ---------------------------------------------------------------------------

    def image_bytes(self) -> bytes:
        self.counter += 1
        n = self.counter
        image = Image.new("RGB", (24 + n % 9, 20), (n % 251, (n * 7) % 253, (n * 13) % 255))
        path = self.root / "tmp.png"
        image.save(path)
        return path.read_bytes()

    def waiting(self, touchable: bool = False) -> list[Path]:
        """Files in the inbox not yet claimed, links and what lies behind linked folders left
        out. ``touchable``: only what a user could still touch, so not what is in one of the
        daemon's claim areas renamed away (a folder of its own at the top of the inbox holding
        a ``*.lock``, as ``claim_area.moved_areas`` finds them): the group may rename the area
        but not the daemon's entries in it (0755), and the daemon may still hold claims there
        (its own original area back at ``.processing`` is still locked by its helpers, so the
        put-back waits). This test runs as root: without this, its "user" replaced a claimed
        file after its decode, which no member can, and saw a result of other bytes."""
        found = []
        for folder, dirs, files in os.walk(self.inbox):  # never follows links
            dirs[:] = [d for d in dirs if d != ".processing" and not (
                touchable and folder == str(self.inbox) and claim_area_at(Path(folder) / d))]
            found += [Path(folder) / f for f in files
                      if f.endswith(".png") and not os.path.islink(os.path.join(folder, f))]
        return found

    # -- what users do ---------------------------------------------------------------------

    def drop(self, data: bytes | None = None, name: str | None = None) -> None:
        data = data if data is not None else self.image_bytes()
        target = self.inbox / (name or self.rng.choice(NAMES))
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.part")
        tmp.write_bytes(data)
        while True:
            # Never over a file there: the user's own rename would replace it, not ours. No
            # replace, atomically: a file given back to the inbox (a stop, a full disk) can
            # take the name between a check and a plain rename.
            try:
                rename_noreplace(tmp, target)
                break
            except FileExistsError:
                self.counter += 1
                target = target.with_name(f"n{self.counter}-{target.name}")
        self.ref.added(data, f"drop {target.relative_to(self.inbox)}")

    def write_in_place(self) -> None:
        data = self.image_bytes()
        target = self.inbox / f"inplace{self.counter}.png"
        with open(target, "wb") as handle:
            handle.write(data[:20])
            handle.flush()
            time.sleep(self.rng.choice([0, 0.05, 0.3]))
            handle.write(data[20:])
        self.ref.added(data, f"in place {target.name}")

    def drop_again(self) -> None:
        done = [p for p in (self.outputs / "done").rglob("*.png") if p.is_file()]
        if done:
            self.drop(self.rng.choice(done).read_bytes())

    def replace_or_delete(self) -> None:
        waiting = self.waiting(touchable=True)
        if not waiting:
            return
        victim = self.rng.choice(waiting)
        try:
            old = victim.read_bytes()
        except OSError:
            return  # claimed in between
        if self.rng.random() < 0.5:
            data = self.image_bytes()
            tmp = victim.with_name(f".{victim.name}.new")
            tmp.write_bytes(data)
            os.replace(tmp, victim)  # the user's own overwrite
            self.ref.added(data, f"replaced {victim.relative_to(self.inbox)}")
            if victim.parent in self.ref.unfileable_folders:
                self.ref.unfileable.add(sha(data))
        else:
            with contextlib.suppress(FileNotFoundError):  # claimed in between
                victim.unlink()
        self.ref.vanished_maybe(sha(old))

    def rename_inside(self) -> None:
        waiting = self.waiting(touchable=True)
        if waiting:
            source = self.rng.choice(waiting)
            target = self.inbox / "moved" / f"r{self.counter}-{source.name}"
            target.parent.mkdir(exist_ok=True)
            self.counter += 1
            # Claimed first: the daemon has it, the reference is unchanged.
            with contextlib.suppress(FileNotFoundError):
                os.rename(source, target)

    def move_folder_in(self) -> None:
        folder = self.root / f"batch{self.counter}"
        for rel in ("x.png", "sub/y.png", "sub/deeper/z.png"):
            data = self.image_bytes()
            (folder / rel).parent.mkdir(parents=True, exist_ok=True)
            (folder / rel).write_bytes(data)
            self.ref.added(data, f"folder {folder.name}/{rel}")
        os.rename(folder, self.inbox / folder.name)

    def link_in(self) -> None:
        target = self.elsewhere / f"private{self.counter}.png"
        target.write_bytes(self.image_bytes())
        self.ref.outside[target] = sha(target.read_bytes())
        if self.rng.random() < 0.5:
            (self.inbox / f"link{self.counter}.png").symlink_to(target)
        else:
            (self.inbox / f"linkdir{self.counter}").symlink_to(self.elsewhere)

    def future_mtime(self) -> None:
        data = self.image_bytes()
        target = self.inbox / f"future{self.counter}.png"
        tmp = target.with_name(f".{target.name}.part")
        tmp.write_bytes(data)
        ahead = time.time() + 86400 * 365
        os.utime(tmp, (ahead, ahead))
        os.rename(tmp, target)
        self.ref.added(data, f"future {target.name}")

    def corrupt(self) -> None:
        data = self.image_bytes()[: self.rng.randint(0, 60)] + os.urandom(8)
        self.drop(data, f"bad{self.counter}.png")
        self.ref.corrupt.add(sha(data))

    def fill_or_free_disk(self) -> None:
        """The output disk full for a while: filled to its last page now, freed some steps
        later (this action again). The daemon must wait, failing no good photo."""
        if self.ballast is None:
            ballast = self.outputs / "ballast"
            # Full is the point: ENOSPC ends the filling (also at the open, if the daemon's
            # own files filled the disk first), chunk by smaller chunk down to one page.
            with contextlib.suppress(OSError):
                fd = os.open(ballast, os.O_WRONLY | os.O_CREAT, 0o600)
                try:
                    for chunk in (1 << 16, 1 << 12):
                        with contextlib.suppress(OSError):
                            while True:
                                os.write(fd, bytes(chunk))
                finally:
                    os.close(fd)
            self.ballast = ballast if ballast.exists() else None
        else:
            self.ballast.unlink()
            self.ballast = None

    # -- what a member of the inbox's group does --------------------------------------------

    def folder_like_an_outcome(self) -> None:
        """A folder named like a done file (``x.png/``) or like its result (``x.png.json/``),
        with a photo in it: done/x.png/ or results/x.png.json/ can never be made."""
        done = [p for p in (self.outputs / "done").glob("*.png") if p.is_file()]
        if not done:
            return
        name = self.rng.choice(done).name + self.rng.choice(["", ".json"])
        if os.path.lexists(self.inbox / name):
            return
        folder = self.root / f"like{self.counter}"
        folder.mkdir()
        data = self.image_bytes()
        (folder / "p.png").write_bytes(data)
        os.rename(folder, self.inbox / name)
        self.ref.added(data, f"folder like an outcome {name}/p.png")
        self.ref.unfileable.add(sha(data))
        self.ref.unfileable_folders.add(self.inbox / name)

    def _outside_file(self, what: str) -> Path:
        target = self.elsewhere / f"{what}{self.counter}.png"
        target.write_bytes(self.image_bytes())
        self.ref.outside[target] = sha(target.read_bytes())
        return target

    def plant_links(self) -> None:
        """Links in the hidden folders: none is followed, emptied through or moved."""
        processing = self.inbox / ".processing"
        target = self._outside_file("planted")
        where = self.rng.choice([
            self.inbox / f".a.png.{os.getpid()}.submit.tmp",
            processing / ".tmp" / f"other{self.counter}",
            processing / ".tmp" / "default" / f"left{self.counter}",
            processing / f"ghost{self.counter}",
            processing / "default" / f"claimed{self.counter}.png",
        ])
        if where.parent.is_dir() and not where.parent.is_symlink():
            with contextlib.suppress(FileExistsError):
                where.symlink_to(target if "ghost" not in where.name else self.elsewhere)

    def submit(self) -> None:
        """``inboxd submit`` (in this process), with links planted at the temp names it used
        to write to: ``.NAME.PID.submit.tmp``."""
        data = self.image_bytes()
        source = self.root / "submitted" / f"sub{self.counter}.png"
        source.parent.mkdir(exist_ok=True)
        source.write_bytes(data)
        victim = self._outside_file("victim")
        with contextlib.suppress(FileExistsError):
            (self.inbox / f".{source.name}.{os.getpid()}.submit.tmp").symlink_to(victim)
        cli.submit_file(source, self.inbox)
        self.ref.added(data, f"submit {source.name}")

    def swap_processing(self) -> None:
        """The group can rename ``.processing`` away and make one of its own (with links
        inside): here swapped in one step (RENAME_EXCHANGE) and back a moment later. Nothing
        goes through the neighbour's folder; the daemon may put its area back meanwhile
        (issue 36: the neighbour's folder renamed aside, a fresh one made), and then the swap
        back moves the daemon's folders about, which it puts right again."""
        processing = self.inbox / ".processing"
        self.counter += 1
        planted = self.inbox / f".processing-planted{self.counter}"
        planted.mkdir()
        (planted / "default").symlink_to(self.elsewhere)
        (planted / ".tmp").mkdir()
        (planted / ".tmp" / "default").symlink_to(self.outputs / "done")
        os.chown(planted, NEIGHBOUR_UID, NEIGHBOUR_UID)
        exchange(processing, planted)
        time.sleep(self.rng.choice([0.05, 0.3, 1.0]))
        with contextlib.suppress(FileNotFoundError):  # the daemon renamed it aside meanwhile
            exchange(processing, planted)
        try:
            if os.lstat(planted).st_uid != NEIGHBOUR_UID:
                return  # a former area of the daemon's now, its to take back
        except FileNotFoundError:
            return  # that former area, emptied and removed by the daemon already
        for link in (planted / "default", planted / ".tmp" / "default"):
            link.unlink()
        (planted / ".tmp").rmdir()
        planted.rmdir()

    def replace_processing(self) -> None:
        """Renamed away for good (not swapped back) and replaced by a folder of the
        neighbour's own, with links inside, while files are in flight (issue 36): the daemon
        puts its area back, takes every claimed file back from the renamed folder by
        descriptor and goes on; a kill before it noticed leaves them for the restart's
        takeover. Whatever is left in the renamed folder counts as waiting (``waiting``)."""
        processing = self.inbox / ".processing"
        self.counter += 1
        planted = self.inbox / f".processing-planted{self.counter}"
        planted.mkdir()
        (planted / "default").symlink_to(self.elsewhere)
        (planted / ".tmp").mkdir()
        (planted / ".tmp" / "default").symlink_to(self.outputs / "done")
        os.chown(planted, NEIGHBOUR_UID, NEIGHBOUR_UID)
        with contextlib.suppress(FileNotFoundError):  # not there: the daemon makes it again
            os.rename(processing, self.inbox / f".processing-moved{self.counter}")
        try:
            os.rename(planted, processing)
        except OSError:  # the daemon made its own again first (not empty): nothing to replace
            for link in (planted / "default", planted / ".tmp" / "default"):
                link.unlink()
            (planted / ".tmp").rmdir()
            planted.rmdir()

    # -- what the system does --------------------------------------------------------------

    def start(self) -> None:
        if self.daemon is not None:
            self.batch_splits += len(self.daemon.records("batch_split"))
            self.keep_log()
        self.daemon = DaemonProcess(self.config)
        self.daemon.wait_for("ready", 180)

    def keep_log(self) -> None:
        """Each daemon's records, appended to ``daemon.log`` beside the inbox: what a failure
        is read from (a kill replaces the process and its collected output)."""
        if self.daemon is not None:
            with open(self.root / "daemon.log", "a", encoding="utf-8") as log:
                log.write(self.daemon.output() + "\n")

    def kill_and_restart(self) -> None:
        assert self.daemon is not None
        self.daemon.proc.send_signal(signal.SIGKILL)
        self.daemon.proc.wait(30)
        self.kills += 1
        self.start()

    # -- helpers that stop, reloads that fail (issue 33, classes 5 and 6) ------------------

    def stop_a_helper(self) -> None:
        """SIGSTOP a decode worker or the commit process (a hung disk, a debugger) — or the
        daemon with all of them, as a cgroup freeze does — for a while, then SIGCONT."""
        assert self.daemon is not None
        daemon_pid = self.daemon.proc.pid
        helpers = [pid for module in ("inboxd.decode.worker_child", "inboxd.files.commit_child")
                   for pid in helper_pids(daemon_pid, module)]
        if not helpers:
            return
        stopped = ([*helpers, daemon_pid] if self.rng.random() < 0.3
                   else [self.rng.choice(helpers)])
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(self.rng.choice([0.2, 1.0, 3.0]))
        finally:
            for pid in stopped:  # the daemon last
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
        self.helper_stops += 1

    def reload_broken(self) -> None:
        """SIGHUP with a file that cannot be used (not UTF-8, or invalid), then with it fixed."""
        assert self.daemon is not None
        good = self.config.read_bytes()
        broken = self.rng.choice([good + b"\n# caf\xe9\n", b"capacity:\n  queue: zero\n"])
        try:
            for text in (broken, good):
                seen = len(self.daemon.records("reloaded"))
                self.config.write_bytes(text)
                self.daemon.proc.send_signal(signal.SIGHUP)
                self.daemon.wait_for("reloaded", 60, count=seen + 1)
        finally:
            self.config.write_bytes(good)
        assert "reload refused" in self.daemon.records("reloaded")[-2]
        self.broken_reloads += 1

    def stuck_helper_actions(self) -> list[tuple[Callable[[], None], int]]:
        return [(self.stop_a_helper, 2), (self.reload_broken, 1)]

    def step(self) -> str:
        actions = [(self.drop, 30), (self.write_in_place, 6), (self.drop_again, 5),
                   (self.replace_or_delete, 8), (self.rename_inside, 5),
                   (self.move_folder_in, 3), (self.link_in, 3), (self.future_mtime, 3),
                   (self.corrupt, 4)]
        actions += self.stuck_helper_actions()
        actions += [(self.folder_like_an_outcome, 2), (self.plant_links, 2), (self.submit, 2)]
        if ROOT:
            actions += [(self.fill_or_free_disk, 2), (self.swap_processing, 1),
                        (self.replace_processing, 1)]
        if self.rng.random() < 1 / KILL_EVERY_STEPS:
            self.kill_and_restart()
            return "kill"
        action = self.rng.choices([a for a, _ in actions], [w for _, w in actions])[0]
        action()
        time.sleep(self.rng.choice([0, 0.01, 0.05]))
        return action.__name__


def outcomes(out: Path) -> tuple[collections.Counter[str], set[str], dict[str, str],
                                 dict[str, str]]:
    """sha256 → how many times those bytes ended in done/ or failed/; the sha256s in done/;
    failed name → its reason; sha256 → its name in failed/. Checks on the way that every done
    file's result, found by its name, describes its bytes."""
    ended: collections.Counter[str] = collections.Counter()
    in_done: set[str] = set()
    failed_reasons = {}
    failed_shas = {}
    for folder in ("done", "failed"):
        for path in (out / folder).rglob("*"):
            if not path.is_file() and not path.is_symlink():
                continue
            if ".tmp" in path.relative_to(out).parts or path.name.endswith(".error.json"):
                continue
            name = path.relative_to(out / folder).as_posix()
            if folder == "failed":
                failed_reasons[name] = read_json(out / "failed" / f"{name}.error.json")["reason"]
                if path.is_symlink():
                    continue  # a refused link: not an input's bytes
            digest = sha(path.read_bytes())
            ended[digest] += 1
            if folder == "failed":
                failed_shas[digest] = name
            if folder == "done":
                in_done.add(digest)
                by_name = out / "results" / f"{name}.json"
                if by_name.exists():
                    assert read_json(by_name)["sha256"] == digest, (
                        f"done/{name}: other bytes; its records:\n{records_of(out.parent, name)}")
    return ended, in_done, failed_reasons, failed_shas


def records_of(root: Path, name: str) -> str:
    """The daemons' records (``World.keep_log``) that name ``name``."""
    log = root / "daemon.log"
    lines = log.read_text(encoding="utf-8").splitlines() if log.exists() else []
    return "\n".join(line for line in lines if name in line)[-6000:]


def where_are(root: Path, digest: str) -> list[str]:
    """Every file under ``root`` holding these bytes (for the report of a lost input)."""
    found = []
    for folder, _, files in os.walk(root):
        for name in files:
            path = Path(folder) / name
            with contextlib.suppress(OSError):
                if not path.is_symlink() and sha(path.read_bytes()) == digest:
                    found.append(str(path.relative_to(root)))
    return found


def run_model(tmp_path: Path, steps: int, seed: int,
              models: dict[str, Any] | None = None) -> dict[str, int]:
    """``models``: a ``models:`` block (several tasks per photo) in place of the default model;
    every result must then hold each task's section."""
    print(f"model-based: {steps} steps, seed {seed} (replay: INBOXD_MODEL_SEED={seed})")
    world = World(tmp_path, seed, models)
    mount = ROOT
    if mount:
        world.outputs.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(world.outputs)],
                       check=True)
    try:
        world.start()
        done_actions = collections.Counter(world.step() for _ in range(steps))
        if world.ballast is not None:
            world.fill_or_free_disk()
        assert world.daemon is not None
        stopped = world.daemon.stop(timeout_s=90)
        world.keep_log()
        assert stopped == 0
        batch_splits = world.batch_splits + len(world.daemon.records("batch_split"))
        drained = subprocess.run([sys.executable, "-m", "inboxd", "once", "-c",
                                  str(world.config)], cwd=tmp_path, capture_output=True,
                                 text=True, timeout=600)
        with open(tmp_path / "daemon.log", "a", encoding="utf-8") as log:
            log.write(drained.stderr)
        assert drained.returncode in (0, 1), drained.stderr[-3000:]
        ended, in_done, failed_reasons, failed_shas = outcomes(world.outputs)
        ref = world.ref
        lost = {d: (n, ref.origin.get(d), where_are(tmp_path, d))
                for d, n in ref.must_end.items() if ended[d] < n}
        doubled = {d: (ended[d], ref.origin.get(d), where_are(tmp_path, d)) for d in ended
                   if ended[d] > ref.must_end[d] + ref.may_vanish[d]}
        assert lost == {}, f"inputs without an outcome: {lost}"
        assert doubled == {}, f"inputs with two outcomes: {doubled}"
        results = [read_json(r) for r in (world.outputs / "results").rglob("*.json")
                   if ".tmp" not in r.parts]
        result_shas = {result["sha256"] for result in results}
        for task in models or {}:
            assert all(task in result for result in results), f"a result without {task}"
        assert in_done <= result_shas, "bytes in done/ without any result"
        # Kills, a full disk (the index shares it), stopped helpers: the index still follows.
        assert_index_matches_results(world.outputs / "results")
        assert not (ref.corrupt & in_done), "a corrupt input was filed as a success"
        good_failed = {failed_shas[d]: failed_reasons[failed_shas[d]] for d in ref.must_end
                       if d in failed_shas and d not in ref.corrupt | ref.unfileable}
        assert good_failed == {}, f"good photos failed: {good_failed}"
        for path, digest in ref.outside.items():
            assert sha(path.read_bytes()) == digest, f"{path} outside the inbox changed"
        processing = tmp_path / "inbox" / ".processing" / "default"
        assert not [p for p in processing.rglob("*") if p.is_file()], "left in .processing/"
        temps = [p for p in world.outputs.rglob("*") if ".tmp" in p.parts and p.is_file()]
        assert temps == [], f"temp files outlived their operation: {temps}"
        waiting = world.waiting()
        assert waiting == [], f"still in the inbox after the drain: {waiting}"
        # The model fails no input on its own: a failure of the model's is a batch-mate's doing.
        blamed = {name: reason for name, reason in failed_reasons.items()
                  if "the model failed" in reason or "the daemon crashed" in reason}
        assert blamed == {}, f"failed for another photo's batch: {blamed}"
        figures = {"steps": steps, "kills": world.kills, "helper_stops": world.helper_stops,
                   "broken_reloads": world.broken_reloads,
                   "inputs": sum(ref.must_end.values()),
                   "vanishable": sum(ref.may_vanish.values()), "lost": 0, "doubled": 0,
                   "good_failed": 0,
                   "failed": len(failed_reasons), "batch_splits": batch_splits,
                   **{f"op_{k}": v for k, v in
                                                     done_actions.items()}}
        print("model-based figures:", figures)
        return figures
    finally:
        if world.daemon is not None:
            world.daemon.kill()
        if mount:
            subprocess.run(["umount", "-l", str(world.outputs)], check=False)


def seed_from_env() -> int:
    return int(os.environ.get("INBOXD_MODEL_SEED") or random.SystemRandom().randrange(10**9))


@pytest.mark.daemon
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_model_based_user_and_system_actions(tmp_path: Path) -> None:
    figures = run_model(tmp_path, STEPS_CI, int(os.environ.get("INBOXD_MODEL_SEED", "20261201")))
    assert figures["kills"] >= 1
    assert figures["helper_stops"] >= 1 and figures["broken_reloads"] >= 1
    assert figures["batch_splits"] >= 1, "no batch came back with the wrong row count"


@pytest.mark.daemon
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_model_based_with_several_tasks_per_photo(tmp_path: Path) -> None:
    """The same guarantees with two tasks per photo (each its own batcher, batch size, model
    thread and calls out): kill -9 mid-flood loses nothing and doubles nothing."""
    from tests import detectors

    (tmp_path / "models").mkdir()
    labels = tmp_path / "models" / "labels.txt"
    labels.write_text("\n".join(detectors.LABELS) + "\n")
    onnx = detectors.yolo_onnx(tmp_path / "models" / "yolo.onnx")
    figures = run_model(tmp_path, STEPS_CI,
                        int(os.environ.get("INBOXD_MODEL_SEED", "20261201")), models={
                            "labels": {"name": "efficientnet_lite0", "runtime": "torch",
                                       "precision": "fp32"},
                            "things": {"onnx": str(onnx), "output": "detect",
                                       "labels": str(labels),
                                       "batch": {"max_size": 2}}})
    assert figures["kills"] >= 1  # as the one-task run: this seed kills once in its steps


@pytest.mark.daemon
@pytest.mark.soak
@pytest.mark.timeout(3600)
def test_model_based_soak(tmp_path: Path) -> None:
    figures = run_model(tmp_path, STEPS_SOAK, seed_from_env())
    assert figures["kills"] >= 20
