#!/usr/bin/env bash
# Make sure a systemd-journald is listening, for the tests that read the real journal back.
# Idempotent: does nothing when one already answers. Without systemd as PID 1 (CI, containers)
# and as root it starts /lib/systemd/systemd-journald on its own, which works fine standalone,
# and leaves it running. Exit status: 0 when journald works (or, outside CI, when it cannot be
# had: the journal tests then skip); 1 when CI is set and it cannot be had.
set -euo pipefail

SOCKET=/run/systemd/journal/socket
JOURNALD=/lib/systemd/systemd-journald

say() { echo "journald.sh: $*"; }
give_up() {
    say "$*"
    if [[ -n "${CI:-}" ]]; then exit 1; fi
    say "journal tests will be skipped"
    exit 0
}

accepting() {  # a datagram connect() fails with ENOENT or ECONNREFUSED when nobody listens
    python3 -c 'import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
try:
    s.connect(sys.argv[1])
except OSError:
    sys.exit(1)' "$SOCKET"
}

command -v journalctl >/dev/null || give_up "journalctl not found (Debian package: systemd)"

if accepting; then
    say "journald already listening on $SOCKET"
else
    [[ "$(id -u)" == 0 ]] || give_up "no journald on $SOCKET, and not root to start one"
    [[ -x "$JOURNALD" ]] || give_up "no journald on $SOCKET, and $JOURNALD is missing"
    mkdir -p /run/systemd/journal
    # Its own session, no inherited descriptors: it must outlive this script and the CI step.
    setsid "$JOURNALD" </dev/null >/dev/null 2>&1 &
    disown
    for _ in $(seq 100); do accepting && break; sleep 0.1; done
    accepting || give_up "started $JOURNALD, but $SOCKET never accepted"
    say "started $JOURNALD (pid $(pgrep -n -x systemd-journal || echo '?'))"
fi

# journald accepting is not enough: the tests read back with journalctl.
probe="inboxd-ci-probe-$$-$RANDOM"
echo "probe" | systemd-cat -t "$probe"
for _ in $(seq 100); do
    if [[ -n "$(journalctl --no-pager -q -o cat SYSLOG_IDENTIFIER="$probe" 2>/dev/null)" ]]; then
        say "journalctl reads records back: ok"
        exit 0
    fi
    sleep 0.1
done
give_up "journald accepts records but journalctl does not show them"
