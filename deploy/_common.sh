# Sourced by the install scripts: arguments, paths, and a config check.
# Sets: role, here, config, root, bin.
set -euo pipefail
role=${1:-}
case "$role" in peer|head) ;; *) echo "usage: $0 peer|head [CONFIG.toml]" >&2; exit 2 ;; esac
here=$(cd "$(dirname "$0")" && pwd)
config=${2:-$here/kvmesh.example.toml}
root=${DESTDIR:-}
bin=$(command -v kvmesh || true)
[ -n "$bin" ] || { echo "kvmesh is not on PATH: pip install kvmesh first" >&2; exit 1; }
kvmesh --config "$config" config show >/dev/null  # refuse a bad config before installing it
