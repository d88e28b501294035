#!/usr/bin/env bash
# Install a kvmesh role as a launchd daemon (macOS): writes
# /usr/local/etc/kvmesh/kvmesh.toml (if absent), the plist, and bootstraps it.
#   sudo deploy/install-launchd.sh peer|head [CONFIG.toml]
# DESTDIR=/some/root and DRY_RUN=1 write into another root and skip launchctl (tests use both).
source "$(dirname "$0")/_common.sh"
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
