"""``inboxd retry``: failed inputs back into their inbox, once their cause is fixed.

Each failed file ``failed/<key>`` has its report ``failed/<key>.error.json`` (source key, the
inbox it came from, reason, reason class, instance). A retry returns the file to the inbox it
came from, under its original relative path, with the same unique naming as every other move
(a file of that name already there is never overwritten, a link there is a taken name, never
followed), and removes the report. The inbox is a folder others can write: its folders are
walked without following links (one replaced by a link fails that file's retry, and the file
stays in failed/). Safe while
the daemon runs: the report is first moved aside, so a retried file that fails again at once
gets a fresh report that is never the one deleted here; a retry killed half-way leaves the
report aside, and the next retry puts it back.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inboxd.config import Config
from inboxd.files.durable import TmpDir, fsync_dir, json_bytes, move
from inboxd.files.layout import PROCESSING_DIRNAME, TMP_DIRNAME
from inboxd.files.names import output_path
from inboxd.files.renames import rename_noreplace, time_token

REPORT_SUFFIX = ".error.json"
ASIDE_PREFIX = "retry-"


@dataclass
class Failed:
    key: str
    input_path: Path
    report_path: Path
    report: dict[str, Any]
    inbox: Path | None  # None: not one of this config's inboxes
    rel: str

    @property
    def destination(self) -> Path:
        """Where it goes back to (or a unique sibling of it)."""
        assert self.inbox is not None, "select() only returns files of this config's inboxes"
        return self.inbox / self.rel

    @property
    def reason(self) -> str:
        return str(self.report.get("reason", ""))

    @property
    def instance(self) -> str:
        return str(self.report.get("instance", ""))

    def matches(self, reason: str) -> bool:
        """``--reason``: a reason class (``decode``) or a piece of the reason's text."""
        wanted = reason.lower()
        return wanted == str(self.report.get("reason_class", "")) or wanted in self.reason.lower()


def failed_files(config: Config) -> Iterator[Failed]:
    """Every failed input with its report, in name order."""
    root = config.failed_dir
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))  # .tmp/: not failures
        for name in sorted(files):
            if not name.endswith(REPORT_SUFFIX):
                continue
            report_path = Path(folder) / name
            try:
                report = json.loads(report_path.read_text(encoding="utf-8"))
                source = str(report["source"])
            except (OSError, ValueError, KeyError, TypeError):
                continue  # not a report of ours
            # The name it was filed under: its key, or a variant when that name was taken.
            filed = report_path.relative_to(root).as_posix()[: -len(REPORT_SUFFIX)]
            with contextlib.suppress(ValueError):  # ValueError: an unsafe key, not ours
                if output_path(root, source, REPORT_SUFFIX) == report_path:
                    # Filed under its own key: a long name's report was shortened to fit
                    # NAME_MAX (name~hash.error.json) where the file's own name was not.
                    filed = output_path(root, source).relative_to(root).as_posix()
            inbox, rel = _origin(config, source, report)
            yield Failed(filed, root / filed, report_path, report, inbox, rel)


def _origin(config: Config, key: str, report: dict[str, Any]) -> tuple[Path | None, str]:
    """The inbox a failed file came from and its path there. Reports name their inbox; older
    ones only have the key, which starts with the inbox's folder name when there are several."""
    inboxes = config.inbox.paths
    recorded = report.get("inbox")
    several = len(inboxes) > 1
    rel = key.split("/", 1)[1] if several and "/" in key else key
    if isinstance(recorded, str):
        matching = [p for p in inboxes if str(p) == recorded]
        recorded_rel = report.get("rel", rel)
        return (matching[0] if matching else None), (
            recorded_rel if isinstance(recorded_rel, str) else "")
    if not several:
        return inboxes[0], key
    by_name = {p.name: p for p in inboxes}
    return by_name.get(key.split("/", 1)[0]), rel


def select(config: Config, paths: list[Path], everything: bool,
           reason: str | None) -> tuple[list[Failed], list[str]]:
    """The failed files a retry would return, and what could not be matched or is not ours."""
    problems: list[str] = []
    candidates = list(failed_files(config))
    if paths:
        by_key = {f.key: f for f in candidates}
        chosen = []
        for path in paths:
            found = by_key.get(_key_of(config, path))
            if found is None:
                problems.append(f"{path}: no failed file of that name in {config.failed_dir}")
            else:
                chosen.append(found)
        candidates = chosen
    if reason is not None:
        candidates = [f for f in candidates if f.matches(reason)]
    ours = []
    for failed in candidates:
        if failed.instance and failed.instance != config.instance:
            problems.append(f"{failed.key}: failed in instance {failed.instance!r}, not "
                            f"{config.instance!r}: retry it with --instance {failed.instance}")
        elif not plain_rel(failed.rel):
            problems.append(f"{failed.key}: its report gives {failed.rel!r} as its path in the "
                            f"inbox, which no file the daemon takes has; left in "
                            f"{config.failed_dir}")
        elif failed.inbox is None or not os.path.lexists(failed.input_path):
            what = ("its inbox is not in this configuration" if failed.inbox is None
                    else "only its report is left")
            problems.append(f"{failed.key}: {what}; left in {config.failed_dir}")
        else:
            ours.append(failed)
    return ours, problems


def plain_rel(rel: str) -> bool:
    """A path the daemon could have taken a file from: visible, plain names. A report is only
    a file in failed/, so what it says is checked: ``sub/..`` or ``.`` would return the file
    under a hidden name the daemon never takes, ``.processing/...`` into its own claims, a NUL
    to a name cut short."""
    return all(part and not part.startswith(".") and "\0" not in part
               for part in rel.split("/"))


def _key_of(config: Config, path: Path) -> str:
    """A PATH argument: the failed file, its report, or its key (relative to failed_dir)."""
    text = str(path)
    if text.endswith(REPORT_SUFFIX):
        text = text[: -len(REPORT_SUFFIX)]
    absolute = Path(os.path.abspath(text))
    with contextlib.suppress(ValueError):
        return absolute.relative_to(config.failed_dir).as_posix()
    return Path(text).as_posix()


def put_back_stranded(config: Config) -> int:
    """Reports a killed retry left aside go back next to their file (if it is still there)."""
    aside_dir = config.failed_dir / TMP_DIRNAME
    restored = 0
    for aside in sorted(aside_dir.glob(f"{ASIDE_PREFIX}*{REPORT_SUFFIX}")):
        try:
            report = json.loads(aside.read_text(encoding="utf-8"))
            key = str(report.get("filed_as") or report["source"])
            report_path = output_path(config.failed_dir, key, REPORT_SUFFIX)
            if not os.path.lexists(output_path(config.failed_dir, key)):
                aside.unlink()  # its file was returned
                continue
            try:
                rename_noreplace(aside, report_path)
                restored += 1
            except FileExistsError:
                aside.unlink()  # it failed again meanwhile: its new report stands
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return restored


def retry(config: Config, failed: Failed) -> Path:
    """Return one failed file to its inbox; its new path there."""
    aside_dir = config.failed_dir / TMP_DIRNAME
    aside_dir.mkdir(parents=True, exist_ok=True)
    aside = aside_dir / f"{ASIDE_PREFIX}{os.getpid()}-{abs(hash(failed.key)):x}{REPORT_SUFFIX}"
    # Aside with the name it was filed under, so a killed retry can put it back there.
    aside.write_bytes(json_bytes({**failed.report, "filed_as": failed.key}))
    failed.report_path.unlink()
    assert failed.inbox is not None
    try:
        # Walked from the inbox without following links (a member of its group may have
        # replaced a folder with one), across filesystems by way of our own .processing/.tmp.
        target = move(failed.input_path, failed.inbox, failed.rel, time_token(),
                      TmpDir(failed.inbox, (PROCESSING_DIRNAME, TMP_DIRNAME, config.instance),
                             own=True))
    except OSError:
        rename_noreplace(aside, failed.report_path)  # nothing moved: the failure stays
        raise
    aside.unlink(missing_ok=True)
    fsync_dir(failed.report_path.parent)
    return Path(target)
