#!/usr/bin/env bash
# Usage (as root, from anywhere): bash scripts/as-nobody.sh PYTHON ARG...
#
# Runs `PYTHON ARG...` in this checkout as the unprivileged user nobody with no groups
# (`setpriv --reuid=65534 --regid=65534 --clear-groups`), with an empty HOME of its own and the
# SGLang wheel cache to read (FLEETCTL_WHEEL_CACHE). scripts/test.sh runs the unit tests so.
#
# Where root's 0700 home hides the interpreter or the wheel cache (pyenv under /root, say), the
# command runs in scripts/root-view.sh's private mount namespace, whose /root nobody may pass
# through, the paths unchanged (a child that drops to nobody starts the same interpreter, with
# no LD_LIBRARY_PATH: probes/runas.py): no permission on this machine changes. What stays
# hidden there (a checkout under /root) is an error that says so.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "as-nobody.sh: needs root (to switch to nobody with setpriv)" >&2; exit 2; }
[ $# -ge 1 ] || { echo "usage: bash scripts/as-nobody.sh PYTHON ARG..." >&2; exit 2; }
PY=$(command -v "$1"); shift
NOBODY=(setpriv --reuid=65534 --regid=65534 --clear-groups)

# the interpreter's own tree, its venv's if it is one, the checkout, the wheel cache
read -r prefix base exe < <("$PY" -c 'import os, sys; print(sys.prefix, sys.base_prefix, os.path.realpath(sys.executable))')
checkout=$(pwd -P)
wheels=$(PYTHONPATH=agent "$PY" -c 'from fleetctl.wheels import cache_dir; print(cache_dir())')
view=$(mktemp -d /tmp/fleetctl-nobody.XXXXXX)
trap 'rm -rf "$view"' EXIT
chmod 755 "$view"
install -d -o 65534 -g 65534 -m 700 "$view/home"

reachable() { "${NOBODY[@]}" test -r "$1" -a -x "$1"; }
hidden=()
for d in "$prefix" "$base" "$(dirname "$exe")" "$checkout" "$wheels"; do
    reachable "$d" || [[ " ${hidden[*]} " == *" $d "* ]] || hidden+=("$d")
done
if [ ${#hidden[@]} = 0 ]; then
    env HOME="$view/home" FLEETCTL_WHEEL_CACHE="$wheels" "${NOBODY[@]}" "$PY" "$@"
    exit
fi
# hidden under root's 0700 home (a pyenv Python, root's wheel cache): run again in
# scripts/root-view.sh's mount namespace, where /root may be passed through (nothing changes out here)
if [ -z "${FLEETCTL_IN_ROOT_VIEW:-}" ]; then
    echo "as-nobody.sh: nobody cannot reach ${hidden[*]}: running in scripts/root-view.sh's /root" >&2
    FLEETCTL_IN_ROOT_VIEW=1 bash scripts/root-view.sh bash scripts/as-nobody.sh "$PY" "$@"
    exit
fi
echo "as-nobody.sh: nobody cannot reach ${hidden[*]}, even with /root passable: move the checkout," \
     "or run with PYTHON= naming an interpreter nobody can read" >&2
exit 2
