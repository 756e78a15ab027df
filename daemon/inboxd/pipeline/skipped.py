"""Files left where they are, each said once: a name the daemon cannot claim (permissions, a
linked folder, a path too long) or has to wait for (a future mtime) is logged once with the
reason and what to do, not once per scan.

The memory of what was said is bounded (``REMEMBERED_PATHS``, oldest forgotten first): at worst
a path forgotten is said once more, it never costs memory that grows with the inbox.
"""

from __future__ import annotations

import collections
import logging

from inboxd import logs

REMEMBERED_PATHS = 4096


class SkippedPaths:
    def __init__(self, capacity: int = REMEMBERED_PATHS) -> None:
        self.capacity = capacity
        self._said: collections.OrderedDict[str, str] = collections.OrderedDict()

    def note(self, path: str, reason: str, level: int = logging.WARNING) -> bool:
        """Log ``reason`` for ``path`` unless just that was said; True when it was logged."""
        if self._said.get(path) == reason:
            self._said.move_to_end(path)
            return False
        self._said[path] = reason
        if len(self._said) > self.capacity:
            self._said.popitem(last=False)
        logs.emit(level, "skipped", f"{path}: {reason}", path=str(path), reason=reason)
        return True
