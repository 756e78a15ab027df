#!/usr/bin/env bash
# Boot the cached rootfs (build-rootfs.sh) with a real systemd as PID 1 in systemd-nspawn, run
# one probe script inside as a service once the system is up, then power the container off.
#
#   tests/systemd/nspawn/boot.sh [-t TIMEOUT_S] [-o OUTDIR] PROBE_SCRIPT [NSPAWN_ARG...]
#
# PROBE_SCRIPT runs as root with /bin/sh inside the container; its stdout+stderr end up in
# OUTDIR/probe.log (printed at the end) and this script exits with its exit status (124 when
# the container had to be killed). OUTDIR is also writable inside at /probe-out. Extra
# arguments go to systemd-nspawn, e.g. --bind-ro=/work/main:/opt/inboxd.
#
# Pitfalls this handles:
# - With --console=pipe systemd writes nothing to our stdout (no /dev/console for it there), so
#   results come back through the bound OUTDIR, not the console.
# - --volatile=overlay: / is an overlay over the cached rootfs with a tmpfs on top, so every
#   boot starts clean and the cache is never written.
# - No systemd on the host (not PID 1, no machined, no bus): --register=no --keep-unit.
# - "Attempted to remove disk file system under /run/systemd/nspawn/propagate/..." at exit is
#   harmless.
set -euo pipefail

timeout_s=300
outdir=
while getopts "t:o:" opt; do
    case $opt in
        t) timeout_s=$OPTARG ;;
        o) outdir=$OPTARG ;;
        *) sed -n '2,12p' "$0" >&2; exit 2 ;;
    esac
done
shift $((OPTIND - 1))
[[ $# -ge 1 ]] || { sed -n '2,12p' "$0" >&2; exit 2; }
probe=$(realpath "$1")
shift

here=$(dirname "$(realpath "$0")")
rootfs=$("$here/build-rootfs.sh" | tail -n 1)
outdir=${outdir:-$(mktemp -d /tmp/inboxd-nspawn.XXXXXX)}
mkdir -p "$outdir"
rm -f "$outdir/probe.log" "$outdir/rc"
work=$(mktemp -d /tmp/inboxd-nspawn-unit.XXXXXX)
trap 'rm -rf "$work"' EXIT

cat >"$work/inboxd-probe.service" <<UNIT
[Unit]
Description=inboxd nspawn probe
After=multi-user.target

[Service]
Type=oneshot
TimeoutStartSec=${timeout_s}s
ExecStart=/bin/sh -c '/bin/sh /probe/run.sh >/probe-out/probe.log 2>&1; echo \$\$? >/probe-out/rc'
ExecStopPost=/bin/systemctl poweroff --no-block
UNIT

start=$SECONDS
set +e
# PID 1 in a container reads its own argv as the kernel command line: systemd.wants= pulls the
# probe into the boot transaction without touching the image.
timeout --kill-after=15 "$((timeout_s + 60))" \
    systemd-nspawn -D "$rootfs" --register=no --keep-unit --boot --console=pipe \
    --volatile=overlay \
    --bind-ro="$work/inboxd-probe.service:/etc/systemd/system/inboxd-probe.service" \
    --bind-ro="$probe:/probe/run.sh" \
    --bind="$outdir:/probe-out" \
    "$@" \
    systemd.wants=inboxd-probe.service </dev/null >"$outdir/nspawn.log" 2>&1
nspawn_rc=$?
set -e

echo "--- probe output ($outdir/probe.log) ---"
cat "$outdir/probe.log" 2>/dev/null || echo "(none)"
echo "--- nspawn exited $nspawn_rc after $((SECONDS - start)) s ---"
if [[ $nspawn_rc == 124 || $nspawn_rc == 137 ]]; then
    exit 124
fi
if [[ ! -s "$outdir/rc" ]]; then
    echo "the probe never finished; nspawn said:" >&2
    tail -n 20 "$outdir/nspawn.log" >&2
    exit 1
fi
exit "$(cat "$outdir/rc")"
