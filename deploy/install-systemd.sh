#!/usr/bin/env bash
# Install a kvmesh role as a systemd service: writes /etc/kvmesh/kvmesh.toml (if absent),
# the unit, a `kvmesh` system user, and enables the service.
#   sudo deploy/install-systemd.sh peer|head [CONFIG.toml]
# DESTDIR=/some/root and DRY_RUN=1 write into another root and skip systemctl (tests use both).
source "$(dirname "$0")/_common.sh"
install -d "$root/etc/kvmesh" "$root/etc/systemd/system" "$root/var/lib/kvmesh"
if [ ! -e "$root/etc/kvmesh/kvmesh.toml" ]; then
  install -m 0640 "$config" "$root/etc/kvmesh/kvmesh.toml"
fi
sed "s#/usr/local/bin/kvmesh#$bin#" "$here/systemd/kvmesh-$role.service" > "$root/etc/systemd/system/kvmesh-$role.service"
if [ -n "${DRY_RUN:-}" ]; then
  echo "would enable kvmesh-$role.service"; exit 0
fi
id kvmesh >/dev/null 2>&1 || useradd --system --home /var/lib/kvmesh --shell /usr/sbin/nologin kvmesh
chown -R kvmesh:kvmesh "$root/var/lib/kvmesh"
chgrp kvmesh "$root/etc/kvmesh/kvmesh.toml"
systemctl daemon-reload
systemctl enable --now "kvmesh-$role.service"
systemctl --no-pager status "kvmesh-$role.service" | head -5
