"""A login that is not root, without become: the shape of the shipped hosts.yaml (`ansible_user:
sglang`, no `ansible_become`, the group `gpu`), through real sshd against a lab host whose server
(the SGLang stand-in) runs as root (issue 50; review newcomer-turn4 items 1 and 4). inspect lists
the server it cannot read with its pid, owner and the fix instead of "servers: none"; status,
apply --check and apply name fleetctl's state dir, the login and the fix (no bare
PermissionError, no traceback)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from fleetctl import lab as labmod

HOST = "lab-02"
STATE_DIR = "/var/lib/fleetctl"


@pytest.fixture(scope="module")
def nonroot(server_lab, tmp_path_factory):
    """(inventory path, login): HOST in a group `gpu` reached as the lab's login without sudo
    rights, no become (hosts.yaml's shape); the host's state dir made as a root run makes it."""
    login = labmod.become_users(server_lab.lab_id)["nosudo"]
    hosts = yaml.safe_load(server_lab.inventory.read_text())["all"]["children"]["lab"]["hosts"]
    doc = {"all": {"vars": {"ansible_user": login},
                   "children": {"gpu": {"hosts": {HOST: {k: v for k, v in hosts[HOST].items()
                                                         if k != "ansible_user"}}}}}}
    path = tmp_path_factory.mktemp("nonroot") / "hosts.yaml"
    path.write_text(yaml.safe_dump(doc))
    r = server_lab.ssh(HOST, f"mkdir -p -m 700 {STATE_DIR} && chmod 700 {STATE_DIR}")
    assert r.returncode == 0, r.stderr
    return str(path), login


def cli(lab, *args, columns=80):
    return subprocess.run([sys.executable, "-m", "fleetctl.cli", *args], capture_output=True, text=True,
                          env={**lab.env, "COLUMNS": str(columns)}, timeout=300)


def flat(text: str) -> str:
    return " ".join(text.split())


def test_inspect_lists_the_server_it_cannot_read_with_its_owner_and_the_fix(server_lab, nonroot):
    inv, login = nonroot
    root_pid = json.loads(cli(server_lab, "inspect", HOST, "--json").stdout)["hosts"][0]["facts"]["servers"][0]["pid"]
    r = cli(server_lab, "inspect", "gpu", "-i", inv, "--json")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    facts = json.loads(r.stdout)["hosts"][0]["facts"]
    assert facts["servers"] == []
    [u] = facts["servers_unreadable"]
    assert (u["pid"], u["uid"], u["user"], u["port"]) == (root_pid, 0, "root", 30000)
    assert u["reason"] == f"not readable as {login}: set ansible_become: true for this host " \
                          "(and pass -K if sudo asks for a password)"
    shown = cli(server_lab, "inspect", "gpu", "-i", inv)
    assert shown.returncode == 0, shown.stderr
    assert f"pid {root_pid} (root's) :30000: not readable as {login}: set ansible_become: true" in flat(shown.stdout)
    assert "servers: none" not in shown.stdout and "Traceback" not in shown.stderr


@pytest.mark.parametrize("args", [["status", "gpu"], ["apply", "defrag-tier0", "gpu", "--check"],
                                  ["apply", "defrag-tier0", "gpu", "--yes"]])
def test_changing_and_status_name_the_state_dir_the_login_and_the_fix(server_lab, nonroot, args):
    inv, login = nonroot
    r = cli(server_lab, *args, "-i", inv, "--json")
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    [h] = json.loads(r.stdout)["hosts"]
    assert h["status"] == "failed" and STATE_DIR in h["error"] and login in h["error"], h["error"]
    assert "set ansible_become: true for this host" in h["error"], h["error"]
    assert "PermissionError" not in h["error"] and "Traceback" not in r.stderr
    shown = cli(server_lab, *args, "-i", inv, columns=120)
    assert "ansible_become: true" in flat(shown.stdout) and "PermissionError" not in shown.stdout
