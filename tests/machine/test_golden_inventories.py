"""Golden outputs of `hosts all --json` and `inventory export` on every inventory under
tests/inventories/ (YAML, INI, a directory, a script, the bastion case; the last three through
ansible-inventory): byte-equal to tests/golden/inventories/ after normalising (tests/golden.py).
Nothing is dialled: `hosts` and `export` only read the inventory and `ssh -G`."""

from __future__ import annotations

import subprocess
import sys

import pytest

from golden import ROOT, check, record

INVENTORIES = ["yaml/hosts.yaml", "ini/hosts.ini", "mixed", "script/inventory.py", "bastion/hosts.yaml"]


@pytest.mark.parametrize("inventory", INVENTORIES, ids=[i.split("/")[0] for i in INVENTORIES])
@pytest.mark.parametrize("command", [["hosts", "all", "--json"], ["inventory", "export"]], ids=["hosts", "export"])
def test_golden_inventory(tmp_path, inventory, command):
    ssh_config = tmp_path / "ssh_config"
    ssh_config.write_text(f"Host *\n  UserKnownHostsFile {tmp_path}/known_hosts\n")
    argv = [*command, "-i", f"tests/inventories/{inventory}", "--ssh-config", str(ssh_config)]
    r = subprocess.run([sys.executable, "-m", "fleetctl.cli", *argv], capture_output=True, text=True, cwd=ROOT,
                       timeout=120)
    name = f"inventories/{'hosts' if command[0] == 'hosts' else 'export'}-{inventory.split('/')[0]}"
    check(name, record(name, argv, r.returncode, r.stdout, r.stderr, {str(ROOT): "<repo>", str(tmp_path): "<tmp>"}))
