"""The commit process: each batch's results filed durably, then its sources moved
(``files.commits``), in a process of its own. Started by ``files/commit_process.py`` as
``python -m inboxd.files.commit_child``.

Why a process: a group commit is a few hundred short syscalls (per file a create, a write, a
rename, a move, a few lookups), and CPython lets go of the GIL around every one. Inside the
daemon each of those handed the GIL to another of its threads, and the commit waited to get it
back, many times longer than the syscalls themselves took (docs/decisions.md, "The group
commit in a process of its own"). Here it has an interpreter to itself.

It runs the very functions the daemon would, in the same order (every result durable before
any source moves), so a kill at any instant leaves what a kill of the daemon always left. It
holds the daemon's instance locks (the daemon passes their descriptors), so a new daemon of the
same instance cannot start while it still runs; and the kernel kills it when the daemon dies
(``inboxd.children``).
"""

from __future__ import annotations

import os
import traceback

from inboxd import wire
from inboxd.children import die_with_parent, protocol_fds
from inboxd.files.commits import (
    Outputs,
    commit,
    config_from_json,
    entries_from,
    reply_header,
)
from inboxd.files.lifecycle import Lifecycle
from inboxd.heap import freeze_startup_heap

# A batch's documents and paths (hex, up to PATH_MAX each), from the daemon, which is trusted:
# as large as the batch and top_k it was configured with (1,000 of each make 75 MB).
MAX_HEADER_BYTES = 1 << 30


def main() -> None:
    requests, replies = protocol_fds()
    reader = wire.Reader(requests, MAX_HEADER_BYTES)
    init, _ = reader.recv()
    die_with_parent(init["parent_pid"])
    lifecycle = Lifecycle(config_from_json(init["config"]))
    outputs = Outputs.of(lifecycle)
    index_note = outputs.start()
    freeze_startup_heap()
    wire.send(replies, {"ready": True, "pid": os.getpid(), "index": index_note})
    while True:
        try:
            request, payload = reader.recv()
        except EOFError:
            outputs.close()
            return  # the daemon is done with us
        try:
            committed = commit(lifecycle, entries_from(request["entries"], payload),
                               outputs.index, outputs.sidecars)
        except Exception:
            # A bug, not a disk (those come back as OSErrors in the reply): the daemon's stage
            # crashes with this traceback, as it did when the commit ran in the daemon.
            wire.send(replies, {"request": request["request"], "crash": traceback.format_exc()})
            return
        wire.send(replies, {"request": request["request"], **reply_header(committed)})


if __name__ == "__main__":
    main()
