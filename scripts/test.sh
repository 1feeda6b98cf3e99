#!/usr/bin/env bash
# Install what the tests need (idempotent), then run the whole test suite: unit tests and fleet
# tests against real sshd hosts in network namespaces (needs root).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec python3 -m pytest -q -ra --durations=15 "$@"
