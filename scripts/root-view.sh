#!/usr/bin/env bash
# Usage (as root): bash scripts/root-view.sh CMD ARG...
#
# Runs CMD in a private mount namespace whose /root any user may pass through: the lab hosts'
# /root (agent/fleetctl/lab/host.py root_binds: a 0711 tmpfs showing /root/.pyenv, /root/.cache
# and each entry others may not read, bind-mounted), so that the uid a child of fleetctl drops to
# (probes/runas.py: nobody, for a root-owned install) can start this machine's pyenv Python, as it
# starts /usr/bin/python3 or /opt/conda/bin/python on a host. No permission on this machine
# changes: the mounts live in the namespace alone. scripts/test.sh runs tests/machine so.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "root-view.sh: needs root (to make a mount namespace)" >&2; exit 2; }
[ $# -ge 1 ] || { echo "usage: bash scripts/root-view.sh CMD ARG..." >&2; exit 2; }
PY=${PYTHON:-python3}
# in such a view already (or on a machine whose /root others may pass through): nothing to do
if [ "$(( 0$(stat -c %a /root) & 1 ))" = 1 ]; then exec "$@"; fi
hd=$(mktemp -d /tmp/fleetctl-rootview.XXXXXX)
# the mount point is only an emptied directory out here: removed with rmdir, never recursively
trap 'rmdir "$hd/real-root" "$hd" 2>/dev/null || true' EXIT
mkdir "$hd/real-root"
binds=$(PYTHONPATH=agent "$PY" -I -c 'import sys; sys.path.insert(0, "agent")
from pathlib import Path
from fleetctl.lab.host import root_binds
print(" && ".join(root_binds(Path(sys.argv[1]))))' "$hd")
unshare --mount sh -c "mount --make-rprivate / && $binds && exec \"\$@\"" root-view "$@"
