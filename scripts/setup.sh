#!/usr/bin/env bash
# Install everything fleetctl, its lab and its tests need on a fresh Debian machine (as root).
# Idempotent: a second run installs nothing new.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v sshd >/dev/null 2>&1 || [ -x /usr/sbin/sshd ] || need_apt+=(openssh-server)
command -v ssh >/dev/null 2>&1 || need_apt+=(openssh-client)
command -v ip >/dev/null 2>&1 || need_apt+=(iproute2)
command -v flock >/dev/null 2>&1 || need_apt+=(util-linux)
command -v sudo >/dev/null 2>&1 || need_apt+=(sudo)  # become (ansible_become) and its lab users
command -v g++ >/dev/null 2>&1 || need_apt+=(g++)
# a compiler cache: torch.utils.cpp_extension puts ccache before the compiler when it is on PATH,
# so the same kernel sources built again (other build keys, other lab hosts, later runs) compile once
command -v ccache >/dev/null 2>&1 || need_apt+=(ccache)
[ -x /usr/bin/ninja ] || need_apt+=(ninja-build)  # on the PATH of SSH sessions (lab hosts)
# the lab's container host (lab.add_container_host): rootful Podman on runc (this machine's cgroups
# are in hybrid mode, which crun refuses)
command -v podman >/dev/null 2>&1 || need_apt+=(podman)
[ -x /usr/sbin/runc ] || command -v runc >/dev/null 2>&1 || need_apt+=(runc)
if [ ${#need_apt[@]} -gt 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi

PY=${PYTHON:-python3}
# tests/machine/test_inventory_ansible.py makes a venv for the ansible extra (Debian's python3 needs python3-venv)
if ! "$PY" -c 'import ensurepip, venv' >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends python3-venv >/dev/null
fi
# torch==2.13.0 is a CPU build that pip takes from this machine's own disk. The test extra holds
# ansible-core (ansible-playbook, ansible-test) for the fleetctl.sglang collection's tests.
"$PY" -m pip install -q --disable-pip-version-check -e '.[kernel,test]'

# The SGLang releases the lab and the tests use, downloaded once into the shared wheel cache.
"$PY" - <<'PYEOF'
from fleetctl.wheels import ensure_wheel
for v in ("0.4.6.post5", "0.5.2", "0.5.10", "0.5.23"):
    print("wheel cache:", ensure_wheel(v).name)
PYEOF
