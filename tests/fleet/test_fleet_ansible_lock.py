"""The collection's lease on fleetctl's host lock in plays run by ansible-core against the lab's real
sshd hosts (security review turn 3, N12): a play without the lock task is leased by
fleetctl.sglang.patch itself from the write to the gate's commit, so `fleetctl recover` cannot undo
its pending change meanwhile, and patch refuses to write while another run holds the lock.

The lab is `lab` (no servers): the gate's smoke is an offline command. ansible-core, the collection
build and the exported inventory are as in tests/fleet/test_fleet_ansible.py.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.ledger import over_ssh as ledger

BIN = Path(sys.executable).parent


def tool(name: str) -> str:
    """The ansible-core program `name` next to this interpreter (else on PATH)."""
    path = BIN / name
    found = str(path) if path.exists() else shutil.which(name)
    assert found, f"{name} not found: install the test extra (scripts/setup.sh)"
    return found


class Ansible:
    """ansible / ansible-playbook against one lab, with the collection built for this checkout."""

    def __init__(self, lab, tmp: Path):
        self.lab, self.tmp = lab, tmp
        r = lab.cli("collection", "build", "--out", str(tmp / "collections"))
        assert r.returncode == 0, r.stderr
        r = lab.cli("inventory", "export")
        assert r.returncode == 0, r.stderr
        self.inventory = tmp / "inventory.yml"
        self.inventory.write_text(r.stdout)
        self.env = dict(lab.env, ANSIBLE_COLLECTIONS_PATH=str(tmp / "collections"),
                        ANSIBLE_PYTHON_INTERPRETER="/usr/bin/python3", ANSIBLE_LOCAL_TEMP=str(tmp / "atmp"),
                        ANSIBLE_SSH_CONTROL_PATH_DIR=str(tmp / "cp"), ANSIBLE_NOCOLOR="1",
                        ANSIBLE_RETRY_FILES_ENABLED="0")

    def run(self, prog: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        return subprocess.run([tool(prog), "-i", str(self.inventory), *args], capture_output=True, text=True,
                              env=self.env, timeout=timeout, cwd=self.tmp)

    def play(self, text: str, host: str, *args: str) -> subprocess.CompletedProcess:
        path = self.tmp / f"play-{host}.yml"
        path.write_text(text)
        return self.run("ansible-playbook", str(path), "--limit", host, "-e", f"out={self.tmp}",
                        "-e", f"python={sys.executable}", *args)


@pytest.fixture(scope="module")
def ansible(lab, tmp_path_factory) -> Ansible:
    return Ansible(lab, tmp_path_factory.mktemp("ansible-lock"))


NO_LOCK_PLAY = """
- hosts: all
  gather_facts: false
  tasks:
    - name: Baseline (an offline check)
      fleetctl.sglang.smoke:
        offline_cmd: "true"
      register: baseline
    - name: Patch, with no lock task before it
      fleetctl.sglang.patch:
        playbook: defrag-tier0
      register: patch
    - name: fleetctl recover from the control node while the change is pending
      ansible.builtin.command:
        argv: ["{{ python }}", "-m", "fleetctl.cli", "recover", "{{ inventory_hostname }}", "--yes", "--json"]
      delegate_to: localhost
      register: recover
      failed_when: false
      changed_when: false
    - name: Gate and commit
      fleetctl.sglang.smoke:
        offline_cmd: "true"
        baseline: "{{ baseline.smoke }}"
        change_id: "{{ patch.change_id }}"
      register: gate
    - name: Keep what the play saw
      ansible.builtin.copy:
        content: "{{ {'patch': patch, 'recover': recover.stdout, 'gate': gate,
                      'lease': ansible_facts.fleetctl_lease | default('unset')} | to_json }}"
        dest: "{{ out }}/{{ inventory_hostname }}.json"
        mode: "0600"
      delegate_to: localhost
"""


def test_patch_leases_the_lock_itself_until_the_gate_commits(ansible, lab):
    """A play with no lock task: patch takes the lease, so a `fleetctl recover` run between the patch
    and the gate fails naming the holder and undoes nothing; the gate commits the change and ends the
    lease patch took, so after the play the lock is free and `fleetctl rollback` runs."""
    host = "lab-02"
    r = ansible.play(NO_LOCK_PLAY, host)
    log = r.stdout[-5000:] + r.stderr[-2000:]
    assert r.returncode == 0, log
    seen = json.loads((ansible.tmp / f"{host}.json").read_text())
    cid = seen["patch"]["change_id"]
    assert seen["patch"]["changed"] and seen["patch"]["ansible_facts"]["fleetctl_lease"]["auto"] is True, log
    [mid] = json.loads(seen["recover"])["hosts"]
    assert mid["status"] == "failed", mid
    assert "another fleetctl run is changing this host (ansible-playbook (fleetctl.sglang) since" in mid["error"], mid
    assert seen["gate"]["changed"] and seen["gate"]["validation"]["failed"] is False, seen["gate"]
    assert seen["lease"] == {}, seen["lease"]
    assert ledger(lab, host)[cid] == "applied"
    assert lab.ssh(host, "cat /var/lib/fleetctl/lock.lease").stdout == ""
    lab.cli_json("rollback", cid, host, "--yes", rc=0)
    assert ledger(lab, host)[cid] == "rolled-back"


PATCH_PLAY = """
- hosts: all
  gather_facts: false
  tasks:
    - fleetctl.sglang.patch:
        playbook: defrag-tier0
"""


def test_patch_refuses_to_write_while_another_run_holds_the_lock(ansible, lab):
    """While another run holds fleetctl's lock (here a lease of another holder), patch writes
    nothing and fails naming that holder."""
    host = "lab-03"
    r = ansible.run("ansible", host, "-m", "fleetctl.sglang.lock", "-a", "holder=other-run lease_s=120")
    assert r.returncode == 0 and '"changed": true' in r.stdout, r.stdout[-2000:]
    try:
        before = ledger(lab, host)
        r = ansible.play(PATCH_PLAY, host)
        assert r.returncode == 2, r.stdout[-4000:]
        assert "no lease on fleetctl's host lock: another fleetctl run is changing this host (other-run since" \
            in r.stdout, r.stdout[-4000:]
        assert ledger(lab, host) == before
    finally:
        r = ansible.run("ansible", host, "-m", "fleetctl.sglang.lock", "-a", "state=released")
    assert r.returncode == 0 and '"changed": true' in r.stdout, r.stdout[-2000:]
