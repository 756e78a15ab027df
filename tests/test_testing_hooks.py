"""The test-only hooks (``inboxd/testing.py``): one prefix, declared once. A test that set a
hook under a name the daemon does not read would run the real daemon without its fault and
could pass for the wrong reason; so every ``INBOXD_TEST_*`` name in tests/ and bench/ must be
one the daemon declares, and no old name may linger."""

from __future__ import annotations

import re
from pathlib import Path

from inboxd import testing

ROOT = Path(__file__).resolve().parent.parent
# The hooks' names before they shared a prefix: nothing reads them any more.
OLD_NAMES = re.compile(r"\bINBOXD_(FAULTS|DECODE_FAULTS|RAY_REPLICA_DELAY_S)\b")
HOOK_NAME = re.compile(r"\bINBOXD_TEST_[A-Z0-9_]+\b")
NOT_HOOKS = {"INBOXD_TEST_RUN"}  # a journal field tests/service/test_journal.py tags records with


def _sources() -> list[Path]:
    found = [p for folder in ("tests", "bench", "daemon") for p in (ROOT / folder).rglob("*")
             if p.suffix in {".py", ".sh", ".md"} and p.is_file()]
    assert len(found) > 100, f"the scan must see the tree, found {len(found)} files"
    return found


def test_every_hook_has_the_prefix() -> None:
    assert testing.HOOKS and all(name.startswith(testing.PREFIX) for name in testing.HOOKS)


def test_every_hook_named_anywhere_is_one_the_daemon_reads() -> None:
    unknown, old = [], []
    for path in _sources():
        text = path.read_text(errors="replace")
        where = path.relative_to(ROOT)
        unknown += [f"{where}: {name}" for name in HOOK_NAME.findall(text)
                    if name not in {*testing.HOOKS, *NOT_HOOKS}]
        old += [f"{where}: {m.group(0)}" for m in OLD_NAMES.finditer(text)]
    assert unknown == [], "hooks the daemon does not declare (inboxd/testing.py)"
    assert old == [], "old hook names: nothing reads them"
