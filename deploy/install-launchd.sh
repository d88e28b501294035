#!/usr/bin/env bash
# Install a kvmesh role as a launchd daemon (macOS): writes
# /usr/local/etc/kvmesh/kvmesh.toml (if absent), the plist, and bootstraps it.
#   sudo deploy/install-launchd.sh peer|head [CONFIG.toml]
# DESTDIR=/some/root and DRY_RUN=1 write into another root and skip launchctl (tests use both).
set -euo pipefail
role=${1:-}
case "$role" in peer|head) ;; *) echo "usage: $0 peer|head [CONFIG.toml]" >&2; exit 2 ;; esac
here=$(cd "$(dirname "$0")" && pwd)
config=${2:-$here/kvmesh.example.toml}
root=${DESTDIR:-}
bin=$(command -v kvmesh || true)
[ -n "$bin" ] || { echo "kvmesh is not on PATH: pip install kvmesh first" >&2; exit 1; }
kvmesh --config "$config" config show >/dev/null  # refuse a bad config before installing it
install -d "$root/usr/local/etc/kvmesh" "$root/usr/local/var/kvmesh" "$root/usr/local/var/log" "$root/Library/LaunchDaemons"
if [ ! -e "$root/usr/local/etc/kvmesh/kvmesh.toml" ]; then
  install -m 0640 "$config" "$root/usr/local/etc/kvmesh/kvmesh.toml"
fi
plist="$root/Library/LaunchDaemons/ai.kvmesh.$role.plist"
sed "s#/usr/local/bin/kvmesh#$bin#" "$here/launchd/ai.kvmesh.$role.plist" > "$plist"
if [ -n "${DRY_RUN:-}" ]; then
  echo "would bootstrap ai.kvmesh.$role"; exit 0
fi
launchctl bootout "system/ai.kvmesh.$role" 2>/dev/null || true
launchctl bootstrap system "$plist"
launchctl print "system/ai.kvmesh.$role" | head -5
