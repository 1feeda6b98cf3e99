"""A login shell that prints (issue 52): a host whose SSH user's ~/.bashrc (bash sources it for
sshd's `bash -c`) and ~/.profile (a login shell's, which `sudo -i` starts) echo a banner on
stdout, as shared clusters' do. Every reply fleetctl reads from a command is found by its
marker, so apply and rollback work there as anywhere, over real sshd and real sudo."""

from __future__ import annotations

import json
import time

import pytest
import yaml

from fleetctl.config import LOCK_START_S
from helpers.ledger import from_lab as ledger_states

HOST = "lab-04"
BANNER = "Welcome to rack2 - scratch quota 91% - LOCKED accounts: none"
STARTUP_FILES = ("/root/.bashrc", "/root/.profile")


@pytest.fixture
def banner_host(lab, tmp_path):
    """HOST with the banner in root's ~/.bashrc and ~/.profile (its own /root, lab/host.py
    root_binds), and an inventory of it alone; afterwards both files gone and the host's changes
    rolled back."""
    r = lab.ssh(HOST, " && ".join(f"printf 'echo \"%s\"\\n' '{BANNER}' > {f}" for f in STARTUP_FILES))
    assert r.returncode == 0, r.stderr
    hosts = yaml.safe_load(lab.inventory.read_text())["all"]["children"]["lab"]["hosts"]
    try:
        probe = lab.ssh(HOST, "true")
        assert BANNER in probe.stdout, f"the host's bash printed no banner: {probe.stdout!r}"
        yield lambda **v: _inventory(tmp_path, {**hosts[HOST], **v})
    finally:
        lab.ssh(HOST, "rm -f " + " ".join(STARTUP_FILES))
        lab.cli_json("rollback", "--last", HOST, "--yes", rc=0)


def _inventory(d, host_vars: dict) -> str:
    path = d / "hosts.yaml"
    path.write_text(yaml.safe_dump({"all": {"hosts": {HOST: host_vars}}}))
    return str(path)


@pytest.mark.parametrize("become", [{}, {"ansible_become": True, "ansible_become_flags": "-i"}],
                         ids=["login", "become-i"])
def test_apply_and_rollback_read_their_replies_past_a_login_shells_banner(lab, banner_host, become):
    inv = banner_host(**become)
    t0 = time.monotonic()
    r, doc, hosts = lab.cli_json("apply", "defrag-tier0", HOST, "-i", inv, "--yes")
    applied_s = time.monotonic() - t0
    assert r.returncode == 0 and hosts[HOST]["status"] == "changed", (hosts[HOST]["error"], r.stderr[-2000:])
    assert ledger_states(lab, HOST)[doc["change_id"]] == "applied"
    t0 = time.monotonic()
    r, _, back = lab.cli_json("rollback", "--last", HOST, "-i", inv, "--yes")
    rolled_s = time.monotonic() - t0
    assert r.returncode == 0 and back[HOST]["status"] == "changed", (back[HOST]["error"], r.stderr[-2000:])
    assert ledger_states(lab, HOST)[doc["change_id"]] == "rolled-back"
    # no wait for a reply that had come: each run ends well within the lock's start deadline
    assert applied_s < LOCK_START_S and rolled_s < LOCK_START_S, (applied_s, rolled_s)
    print(json.dumps({"apply_s": round(applied_s, 1), "rollback_s": round(rolled_s, 1)}))
