#!/usr/bin/env bash
# The test suite, in three rooms (tests/conftest.py says what goes where):
#
#   bash scripts/test.sh --fast   tests/unit alone, as whoever runs it: no install, no root, no
#                                 sshd, no compiler, no network (SGLang wheels are read from the
#                                 wheel cache that scripts/setup.sh fills). Minutes.
#   bash scripts/test.sh          everything (as root): scripts/setup.sh, then tests/unit as an
#                                 unprivileged user (nobody, by setpriv: "without root" is shown
#                                 on every full run) beside tests/machine as root, then tests/fleet.
#
# Arguments after the mode go to pytest (each phase): -k inventory, -m "not slow", -x ...
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PYTEST_ARGS=(-q -ra -p no:cacheprovider --durations=15)

if [ "${1:-}" = "--fast" ]; then
    shift
    # the unit tests never reach the network: a wheel missing from the cache is an error (pip's
    # "no matching distribution"), not a download
    PIP_NO_INDEX=1 exec "$PY" -m pytest "${PYTEST_ARGS[@]}" tests/unit "$@"
fi

bash scripts/setup.sh
if [ "$(id -u)" != 0 ]; then
    exec "$PY" -m pytest "${PYTEST_ARGS[@]}" tests "$@"
fi

# a phase that -k or -m leaves without tests (pytest's exit 5) is no failure when arguments were given
phase() {
    local rc=0
    "$@" || rc=$?
    if [ "$rc" = 5 ] && [ "$EXTRA" -gt 0 ]; then rc=0; fi
    return "$rc"
}
EXTRA=$#
status=0
# tests/unit (as nobody) and tests/machine (as root) share no fixture, port, lab or directory:
# they run side by side, the machine room's output held until it ends; then tests/fleet. The
# machine room runs at nice 19: on 2 cores the unit room (the fast path, whose time is printed)
# then takes the CPU it would take alone, and the machine room the rest and all of it after.
# The machine room runs in scripts/root-view.sh's mount namespace: the uid fleetctl's children
# drop to can start this machine's Python under /root/.pyenv there (probes/runas.py)
machine_log=$(mktemp /tmp/fleetctl-machine-tests.XXXXXX.log)
trap 'rm -f "$machine_log"' EXIT
start=$(date +%s)
phase nice -n 19 bash scripts/root-view.sh "$PY" -m pytest "${PYTEST_ARGS[@]}" tests/machine "$@" >"$machine_log" 2>&1 &
machine=$!
phase env PIP_NO_INDEX=1 bash scripts/as-nobody.sh "$PY" -m pytest "${PYTEST_ARGS[@]}" tests/unit "$@" || status=$?
echo "fast path: tests/unit as nobody (setpriv --reuid=65534 --regid=65534 --clear-groups)" \
     "in $(( $(date +%s) - start )) s, exit ${status} (beside tests/machine)"
machine_status=0
wait "$machine" || machine_status=$?
echo "== tests/machine (as root), $(( $(date +%s) - start )) s from the start, exit ${machine_status}"
cat "$machine_log"
[ "$machine_status" = 0 ] || status=$machine_status
phase "$PY" -m pytest "${PYTEST_ARGS[@]}" tests/fleet "$@" || status=$?
exit "$status"
