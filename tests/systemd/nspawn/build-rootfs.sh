#!/usr/bin/env bash
# Build once, then reuse: a minimal Debian bookworm root with systemd as init, for booting a real
# systemd (PID 1) with systemd-nspawn (see boot.sh). Prints the rootfs path as its last line.
#   tests/systemd/nspawn/build-rootfs.sh            # ~80 s the first time, instant when cached
# The cache lives outside the repo (INBOXD_ROOTFS_CACHE, default /var/cache/inboxd-test-rootfs);
# boot.sh never writes into it (--volatile=overlay). Needs root and Debian's apt sources.
set -euo pipefail

CACHE=${INBOXD_ROOTFS_CACHE:-/var/cache/inboxd-test-rootfs}
SUITE=bookworm
# procps: /bin/kill, which the units' ExecReload= runs (minbase lacks it).
PACKAGES=systemd,systemd-sysv,dbus,procps,libsqlite3-0
VERSION=3  # bump when PACKAGES or the recipe change: the next run rebuilds
ROOTFS=$CACHE/$SUITE
STAMP=$ROOTFS/.inboxd-rootfs-v$VERSION

say() { echo "build-rootfs: $*" >&2; }

[[ "$(id -u)" == 0 ]] || { say "needs root (debootstrap, systemd-nspawn)"; exit 1; }
mkdir -p "$CACHE"
exec 9>"$CACHE/.lock"
flock 9  # two builds at once would fight over the same folder

if [[ -f "$STAMP" ]]; then
    say "cached: $ROOTFS"
    echo "$ROOTFS"
    exit 0
fi

if ! command -v debootstrap >/dev/null || ! command -v systemd-nspawn >/dev/null; then
    say "installing debootstrap and systemd-container"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap systemd-container >/dev/null
fi

# The mirror this machine's apt already uses (deb822 debian.sources or a one-line sources.list),
# so it works wherever apt works; INBOXD_DEBIAN_MIRROR overrides.
mirror=${INBOXD_DEBIAN_MIRROR:-}
if [[ -z "$mirror" ]]; then
    mirror=$(cat /etc/apt/sources.list.d/*.sources 2>/dev/null \
        | sed -n 's/^URIs:[[:space:]]*\([^[:space:]]*\).*/\1/p' \
        | grep -E '/debian/?$' | head -n 1 || true)
fi
if [[ -z "$mirror" ]]; then
    mirror=$(cat /etc/apt/sources.list 2>/dev/null \
        | sed -n 's/^deb[[:space:]]\+\(\[[^]]*\][[:space:]]\+\)\?\([^[:space:]]*\/debian\/\?\)[[:space:]].*/\2/p' \
        | head -n 1 || true)
fi
mirror=${mirror:-http://deb.debian.org/debian}

tmp="$CACHE/.$SUITE.tmp.$$"
rm -rf "$tmp"
trap 'rm -rf "$tmp"' EXIT
say "debootstrap --variant=minbase --include=$PACKAGES $SUITE from $mirror"
start=$SECONDS
debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$tmp" "$mirror" \
    >"$CACHE/debootstrap.log" 2>&1 \
    || { say "debootstrap failed, see $CACHE/debootstrap.log"; tail -n 20 "$CACHE/debootstrap.log" >&2; exit 1; }
rm -rf "$ROOTFS"
mv "$tmp" "$ROOTFS"
trap - EXIT
touch "$STAMP"
say "built $ROOTFS in $((SECONDS - start)) s ($(du -sh "$ROOTFS" | cut -f1))"
echo "$ROOTFS"
