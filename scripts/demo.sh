#!/usr/bin/env bash
# The main job on the embedded lab fleet, from a fresh Debian machine (as root):
# install, start four real sshd hosts with real SGLang releases and the SGLang stand-in server,
# then inspect, apply defrag-tier0 (check + diff first), validate, show status.
# The lab stays up afterwards (`fleetctl lab down` removes it).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$(python3 -c 'import sysconfig; print(sysconfig.get_path("scripts"))'):$PATH"

step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

step "fleetctl lab up --with-server"
INV=$(fleetctl lab up --with-server | tail -n 1)
export FLEETCTL_INVENTORY="$INV"
echo "inventory: $INV"

step "fleetctl inspect all"
fleetctl inspect all

step "fleetctl apply defrag-tier0 all --check --diff"
fleetctl apply defrag-tier0 all --check --diff

# The lab inventory sets fleetctl_latency_slack: 0.25 (the stand-in decodes in milliseconds on
# shared cores, so the latency gate allows 250 ms of scheduling noise there).
step "fleetctl apply defrag-tier0 all --serial 1,100% --yes"
fleetctl apply defrag-tier0 all --serial 1,100% --yes

step "fleetctl apply defrag-tier0 all --yes (again: nothing to change)"
fleetctl apply defrag-tier0 all --yes

step "fleetctl validate all"
fleetctl validate all

step "fleetctl status all"
fleetctl status all

echo
echo "The lab is still up: try 'fleetctl rollback --last all', 'fleetctl deploy kernel verify_attention all',"
echo "'fleetctl lab fault lab-02 freeze' ... with FLEETCTL_INVENTORY=$INV; 'fleetctl lab down' removes it."
