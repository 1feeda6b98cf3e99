#!/usr/bin/env bash
# Usage (as root, from anywhere): bash scripts/as-nobody.sh PYTHON ARG...
#
# Runs `PYTHON ARG...` in this checkout as the unprivileged user nobody with no groups
# (`setpriv --reuid=65534 --regid=65534 --clear-groups`), with an empty HOME of its own and the
# SGLang wheel cache to read (FLEETCTL_WHEEL_CACHE). scripts/test.sh runs the unit tests so.
#
# Where a directory nobody may not pass through hides the interpreter, the checkout or the wheel
# cache (pyenv under root's 0700 home, say), the command runs in a private mount namespace that
# shows each of them read-only under a fresh directory: no permission on this machine changes.
# A venv whose base interpreter is hidden cannot be shown so: that is an error that says so.
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
# the mount points are only emptied directories out here (the mounts live in the namespace alone):
# removed with rmdir, never recursively
trap 'rm -rf "$view/home"; rmdir "$view"/python "$view"/src "$view"/wheels 2>/dev/null; rmdir "$view"' EXIT
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
if [ "$prefix" != "$base" ]; then
    echo "as-nobody.sh: $PY is a venv whose base interpreter ($base) nobody cannot reach;" \
         "run with PYTHON= naming that base interpreter, or a venv nobody can read" >&2
    exit 2
fi
case "$exe" in
    "$base"/*) ;;
    *) echo "as-nobody.sh: $exe lies outside its prefix $base; cannot show it to nobody" >&2; exit 2 ;;
esac
echo "as-nobody.sh: nobody cannot reach ${hidden[*]}: showing the interpreter, the checkout and the" \
     "wheel cache read-only under $view in a private mount namespace" >&2
unshare --mount --propagation private -- bash -c '
    set -euo pipefail
    view=$1 base=$2 exe=$3 checkout=$4 wheels=$5; shift 5
    for pair in "python:$base" "src:$checkout" "wheels:$wheels"; do
        mkdir "$view/${pair%%:*}"
        mount --bind "${pair#*:}" "$view/${pair%%:*}"
        mount -o remount,bind,ro "$view/${pair%%:*}"
    done
    cd "$view/src"
    # its libpython too: the interpreter'"'"'s RUNPATH names the hidden tree, and the loader would
    # fall back to the system'"'"'s libpython (another build)
    exec env HOME="$view/home" FLEETCTL_WHEEL_CACHE="$view/wheels" PATH="$view/python/bin:/usr/bin:/bin" \
        LD_LIBRARY_PATH="$view/python/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
        setpriv --reuid=65534 --regid=65534 --clear-groups "$view/python/${exe#"$base"/}" "$@"
' as-nobody "$view" "$base" "$exe" "$checkout" "$wheels" "$@"
