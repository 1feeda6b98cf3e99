"""Reaching hosts as OpenSSH would, through real sshd, under both SSH connections: a host
reachable only through a bastion (one bastion session shared by the hosts behind it), a host
whose key a host CA signed, an RSA-only host, a revoked key. What was dialled is asserted on
the server side: each sshd runs with LogLevel VERBOSE, and its "Accepted publickey for USER from
ADDRESS ... SHA256:..." line must name the user and key that `ssh -G` resolved (as `fleetctl
hosts` shows them) and, behind the bastion, the bastion's address.

The hosts are added to the session's lab once for this module (fleetctl.lab.lab_add_reach_hosts)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from fleetctl import lab as labmod

ACCEPTED = re.compile(r"Accepted publickey for (\S+) from (\S+) port \d+ ssh2: \S+ (SHA256:\S+)")


@pytest.fixture(scope="module")
def reach(lab, tmp_path_factory):
    """(the reach hosts, an ssh_config that names them, the lab's names, a directory)."""
    hosts = labmod.lab_add_reach_hosts(lab.lab_id, lab.state_dir, lab.known_hosts)
    d = tmp_path_factory.mktemp("reach")
    cfg = d / "ssh_config"
    cfg.write_text(ssh_config(lab, hosts, lab.known_hosts))
    return hosts, cfg, d


def ssh_config(lab, hosts: dict, known: Path) -> str:
    return (f"Host bastion\n  HostName {lab.address('lab-01')}\n  ProxyJump none\n"
            f"Host lab-hidden lab-hidden-again\n  HostName {hosts['lab-hidden']['address']}\n"
            f"Host lab-ca\n  HostName {hosts['lab-ca']['address']}\n"
            f"Host lab-rsa\n  HostName {hosts['lab-rsa']['address']}\n"
            f"Host lab-hidden*\n  ProxyJump bastion\n"
            f"Host *\n  User root\n  IdentityFile {lab.state_dir / 'client_ed25519'}\n  IdentitiesOnly yes\n"
            f"  UserKnownHostsFile {known}\n")


def inventory(d: Path, kind: str, names: list[str]) -> Path:
    path = d / f"hosts-{kind}.yaml"
    path.write_text(yaml.safe_dump({"all": {"vars": {"ansible_connection": kind}, "hosts": dict.fromkeys(names)}}))
    return path


def run(lab, cmd: str, inv: Path, cfg: Path, pattern: str = "all"):
    r = lab.cli(cmd, pattern, "-i", str(inv), "--ssh-config", str(cfg), "--json", timeout=180)
    try:
        return r, {h["host"]: h for h in json.loads(r.stdout)["hosts"]}
    except json.JSONDecodeError:
        raise AssertionError(f"no JSON (exit {r.returncode}): {r.stdout[-2000:]} {r.stderr[-2000:]}") from None


def accepted(log: Path, since: int) -> list[tuple[str, str, str]]:
    """(user, from address, key fingerprint) of each login the sshd logged after byte `since`."""
    return ACCEPTED.findall(log.read_bytes()[since:].decode(errors="replace"))


def fingerprint(path: str) -> str:
    return subprocess.run(["ssh-keygen", "-lf", path], capture_output=True, text=True, check=True).stdout.split()[1]


@pytest.mark.parametrize("kind", ["paramiko", "ssh"])
def test_bastion_and_rsa_only_hosts_reached_with_the_resolved_user_and_key(lab, reach, kind):
    hosts, cfg, d = reach
    names = ["lab-hidden", "lab-hidden-again", "lab-rsa"]
    inv = inventory(d, kind, names)
    _, resolved = run(lab, "hosts", inv, cfg)
    assert resolved["lab-hidden"]["jump"] == [f"root@{lab.address('lab-01')}:22"]
    bastion_log = labmod.state_dir_for(lab.lab_id, lab.state_dir) / "hosts" / "lab-01" / "sshd.log"
    marks = {n: hosts[n]["log"].stat().st_size for n in ("lab-hidden", "lab-rsa")}
    bastion_mark = bastion_log.stat().st_size
    r, got = run(lab, "inspect", inv, cfg)
    assert r.returncode == 0, {n: got[n]["error"] for n in names}
    assert all(got[n]["status"] == "ok" for n in names)
    for name, behind in (("lab-hidden", True), ("lab-rsa", False)):
        want = resolved[name]
        logins = accepted(hosts[name]["log"], marks[name])
        assert logins and all(user == want["user"] and fp == fingerprint(want["identity_files"][0])
                              for user, _, fp in logins), logins
        if behind:  # came from the bastion's end of the only link to it
            assert {src for _, src, _ in logins} == {f"10.214.{lab.lab_id}.1"} and len(logins) == 2
    # both hosts behind the bastion shared one session to it
    assert len(accepted(bastion_log, bastion_mark)) == 1


def test_ca_signed_host_ssh_verifies_it_paramiko_says_why_not(lab, reach):
    hosts, cfg, d = reach
    mark = hosts["lab-ca"]["log"].stat().st_size
    r, got = run(lab, "inspect", inventory(d, "ssh", ["lab-ca"]), cfg)
    assert r.returncode == 0 and got["lab-ca"]["status"] == "ok", got["lab-ca"]["error"]
    assert [u for u, _, _ in accepted(hosts["lab-ca"]["log"], mark)] == ["root"]
    r, got = run(lab, "inspect", inventory(d, "paramiko", ["lab-ca"]), cfg)
    assert r.returncode == 3 and got["lab-ca"]["status"] == "unreachable"
    assert "@cert-authority" in got["lab-ca"]["error"] and "cannot verify host certificates" in got["lab-ca"]["error"]


@pytest.mark.parametrize("kind", ["paramiko", "ssh"])
def test_a_revoked_host_key_is_refused(lab, reach, kind, tmp_path):
    hosts, _, d = reach
    known = tmp_path / "known_hosts"
    rsa = " ".join(hosts["lab-rsa"]["key"].read_text().split()[:2])
    known.write_text(lab.known_hosts.read_text() + f"@revoked * {rsa}\n")
    cfg = tmp_path / "ssh_config"
    cfg.write_text(ssh_config(lab, hosts, known))
    mark = hosts["lab-rsa"]["log"].stat().st_size
    r, got = run(lab, "inspect", inventory(tmp_path, kind, ["lab-rsa"]), cfg)
    assert r.returncode == 3 and got["lab-rsa"]["status"] == "unreachable"
    assert "revoked" in got["lab-rsa"]["error"].lower()
    assert accepted(hosts["lab-rsa"]["log"], mark) == []


@pytest.mark.parametrize("kind, args", [
    ("paramiko", "-J root@{bastion}"),
    ("ssh", "-J root@{bastion}"),
    ("ssh", "-o ProxyCommand=\"ssh -F {cfg} -W %h:%p -q root@{bastion}\""),
])
def test_a_bastion_named_only_in_ansible_ssh_common_args(lab, reach, kind, args):
    """Case turn2/06 through real sshd: the private address is ansible_host, the bastion is named
    only in the inventory's ansible_ssh_common_args (no ProxyJump for it in any ssh_config); the
    host is reached through the bastion, never dialled directly (it has no route from here)."""
    hosts, cfg, d = reach
    bastion = lab.address("lab-01")
    inv = d / f"hosts-common-args-{kind}-{len(args)}.yaml"
    inv.write_text(yaml.safe_dump({"all": {"hosts": {"gpu-node-01": {
        "ansible_host": hosts["lab-hidden"]["address"], "ansible_connection": kind,
        "ansible_ssh_common_args": args.format(bastion=bastion, cfg=cfg)}}}}))
    _, resolved = run(lab, "hosts", inv, cfg)
    assert resolved["gpu-node-01"]["address"] == hosts["lab-hidden"]["address"]
    if args.startswith("-J"):
        assert resolved["gpu-node-01"]["jump"] == [f"root@{bastion}:22"]
    mark = hosts["lab-hidden"]["log"].stat().st_size
    r, got = run(lab, "inspect", inv, cfg)
    assert r.returncode == 0 and got["gpu-node-01"]["status"] == "ok", got["gpu-node-01"]["error"]
    logins = accepted(hosts["lab-hidden"]["log"], mark)
    assert logins and {src for _, src, _ in logins} == {f"10.214.{lab.lab_id}.1"}, logins
