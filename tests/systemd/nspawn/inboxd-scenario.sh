#!/usr/bin/env bash
# The shipped inboxd unit under a real systemd (PID 1) in systemd-nspawn: boot the cached
# rootfs (build-rootfs.sh) with this checkout, its .venv and the venv's base Python bound in
# read-only at their own paths, and let scenario.py run start -> READY -> results -> journal
# stats -> reload -> watchdog restart -> stop inside, then power off.
#
#   tests/systemd/nspawn/inboxd-scenario.sh [-t TIMEOUT_S] [-o OUTDIR]
#
# OUTDIR (default: a new /tmp/inboxd-nspawn.XXXXXX) gets scenario.json (what the scenario saw,
# step by step), probe.log, inboxd-journal.txt and nspawn.log. Exits with boot.sh's status
# (the probe's, 124 when the container had to be killed). tests/systemd/test_systemd_nspawn.py runs
# this and asserts on scenario.json; `make nspawn-test` runs that test.
set -euo pipefail

timeout_s=240
outdir=
while getopts "t:o:" opt; do
    case $opt in
        t) timeout_s=$OPTARG ;;
        o) outdir=$OPTARG ;;
        *) sed -n '2,11p' "$0" >&2; exit 2 ;;
    esac
done

here=$(dirname "$(realpath "$0")")
repo=$(realpath "$here/../../..")
python=$repo/.venv/bin/python
[[ -x $python ]] || { echo "inboxd-scenario: no $python (run make setup-test)" >&2; exit 2; }
outdir=${outdir:-$(mktemp -d /tmp/inboxd-nspawn.XXXXXX)}
mkdir -p "$outdir"

# The venv's interpreter is a symlink to its base Python: that must exist inside too, at the
# same path. A pyenv/uv/self-built Python has its own prefix; a distro Python (/usr) is two
# paths that the bookworm container lacks (its libc and libexpat are then the container's).
base=$("$python" -c 'import sys; print(sys.base_prefix)')
binds=(--bind-ro="$repo")
# `make install` runs inside, from the checkout cloned to /opt/inboxd as the README does it:
# the same checkout bound there too (its venv's scripts point at $repo, which is also bound),
# and the host's make (the minimal rootfs has none; both are Debian bookworm).
binds+=(--bind-ro="$repo:/opt/inboxd" --bind-ro="$(command -v make):/usr/bin/make")
if [[ $base == /usr ]]; then
    # Every hop of the symlink chain outside the venv (/usr/bin/python3 -> python3.11) gets
    # the real binary bound onto it, and the standard library goes in beside it.
    ver=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    real=$(realpath "$python")
    hop=$python
    while [[ -L $hop ]]; do
        target=$(readlink "$hop")
        [[ $target == /* ]] || target=$(dirname "$hop")/$target
        hop=$target
        [[ $hop == "$repo"/* ]] || binds+=(--bind-ro="$real:$hop")
    done
    binds+=(--bind-ro="/usr/lib/python$ver")
else
    binds+=(--bind-ro="$base")
fi

work=$(mktemp -d /tmp/inboxd-nspawn-probe.XXXXXX)
trap 'rm -rf "$work"' EXIT
cat >"$work/run.sh" <<EOF
exec "$python" "$repo/tests/systemd/nspawn/scenario.py" /probe-out
EOF

# The unit's cgroup directives (DevicePolicy=closed/DeviceAllow=, IPAddressDeny=) are BPF
# programs on cgroup v2. On a host still on hybrid cgroups nspawn would hand the container v1
# (where they silently do nothing): ask for the unified hierarchy, and let the container's
# systemd call bpf(2), which nspawn's syscall filter blocks by default. (MemoryMax= needs the
# memory controller on v2: a hybrid host keeps it on v1, so it stays unenforced there.)
export SYSTEMD_NSPAWN_UNIFIED_HIERARCHY=1

rc=0
"$here/boot.sh" -t "$timeout_s" -o "$outdir" "$work/run.sh" "${binds[@]}" \
    --system-call-filter=bpf || rc=$?
echo "inboxd-scenario: results in $outdir"
exit $rc
