#!/usr/bin/env bash
# The test suite, in three rooms (tests/conftest.py says what goes where):
#
#   bash scripts/test.sh --fast   tests/unit alone, as whoever runs it: no install, no root, no
#                                 sshd, no compiler, no network (SGLang wheels are read from the
#                                 wheel cache that scripts/setup.sh fills). Minutes.
#   bash scripts/test.sh          everything (as root): scripts/setup.sh, then tests/unit as an
#                                 unprivileged user (nobody, by setpriv: "without root" is shown
#                                 on every full run), then tests/fleet and tests/machine as root.
#
# Arguments after the mode go to pytest (each phase): -k inventory, -m "not slow", -x ...
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PYTEST_ARGS=(-q -ra -p no:cacheprovider --durations=15)

if [ "${1:-}" = "--fast" ]; then
    shift
    exec "$PY" -m pytest "${PYTEST_ARGS[@]}" tests/unit "$@"
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
start=$(date +%s)
phase bash scripts/as-nobody.sh "$PY" -m pytest "${PYTEST_ARGS[@]}" tests/unit "$@" || status=$?
echo "fast path: tests/unit as nobody (setpriv --reuid=65534 --regid=65534 --clear-groups)" \
     "in $(( $(date +%s) - start )) s, exit ${status}"
phase "$PY" -m pytest "${PYTEST_ARGS[@]}" tests/fleet tests/machine "$@" || status=$?
exit "$status"
