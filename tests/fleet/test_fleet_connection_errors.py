"""Connection errors that name the fix, against real sshd hosts (issue 50; the review's item 5): a
key file named in the inventory but missing, a closed port, a user sshd refuses, a ProxyCommand
(a real OpenSSH `ssh -W`) that fails, and an sshd that accepts TCP but sends no banner (the lab's
`freeze` fault); with -v, what was dialled and each phase's time up to the one that failed."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import yaml

from conftest import write_ssh_config


def variant(lab, tmp_path: Path, **per_host: dict) -> Path:
    """A copy of the lab's inventory with `per_host` vars (host -> vars) added to its hosts."""
    doc = yaml.safe_load(lab.inventory.read_text())
    for host, hv in per_host.items():
        doc["all"]["children"]["lab"]["hosts"][host].update(hv)
    path = tmp_path / "hosts.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def status(lab, inv: Path, pattern: str, *args: str):
    """`fleetctl -v status PATTERN --json` on `inv` -> (process, {host: its entry})."""
    r = lab.cli("-v", "status", pattern, "-i", str(inv), "--json", "--no-history", *args, timeout=120)
    try:
        return r, {h["host"]: h for h in json.loads(r.stdout)["hosts"]}
    except json.JSONDecodeError:
        raise AssertionError(f"no JSON (exit {r.returncode}): {r.stdout[-2000:]} {r.stderr[-2000:]}") from None


def traced(r, host: str, what: str) -> str:
    """The -v line of `host` that starts with `what` ("dialling", "not connected", "connected")."""
    lines = [x for x in r.stderr.splitlines() if x.startswith(f"fleetctl: {host}: {what}")]
    assert lines, f"no '{host}: {what}' line in: {r.stderr[-3000:]}"
    return lines[0]


def test_a_missing_key_file_names_it_and_the_inventory_line_that_set_it(lab, tmp_path):
    missing = tmp_path / "fleet_ed25519"
    inv = variant(lab, tmp_path, **{"lab-01": {"ansible_ssh_private_key_file": str(missing)}})
    r, hosts = status(lab, inv, "lab-01")
    assert r.returncode == 3
    error = hosts["lab-01"]["error"]
    assert re.match(rf"identity file {re.escape(str(missing))} does not exist: fix ansible_ssh_private_key_file "
                    rf"\({re.escape(str(inv))}:\d+\); authentication failed: no key to offer", error), error
    assert f"named but missing {missing}" in traced(r, "lab-01", "dialling")
    assert "not connected in the auth phase" in traced(r, "lab-01", "not connected")


def test_a_closed_port_says_connection_refused_and_names_ansible_port(lab, tmp_path):
    inv = variant(lab, tmp_path, **{"lab-01": {"ansible_port": 1}})
    r, hosts = status(lab, inv, "lab-01")
    address = lab.address("lab-01")
    assert r.returncode == 3
    assert hosts["lab-01"]["error"] == (f"connection refused on {address}:1: is sshd listening there? "
                                        "check ansible_port (or Port in ssh_config) and ansible_host")
    assert traced(r, "lab-01", "dialling").startswith(f"fleetctl: lab-01: dialling root@{address}:1 over paramiko")
    assert "not connected in the connect phase" in traced(r, "lab-01", "not connected")


def test_a_refused_user_is_named_with_the_identities_tried(lab, tmp_path):
    inv = variant(lab, tmp_path, **{"lab-01": {"ansible_user": "nosuchuser"}})
    r, hosts = status(lab, inv, "lab-01")
    address = lab.address("lab-01")
    assert r.returncode == 3
    error = hosts["lab-01"]["error"]
    assert error.startswith(f"authentication failed: nosuchuser@{address}:22 refused the 1 key(s) offered ("), error
    assert str(lab.state_dir / "client_ed25519") in error
    assert error.endswith(": check ansible_user and ansible_ssh_private_key_file (or User / IdentityFile in ssh_config)")
    line = traced(r, "lab-01", "not connected")
    assert "in the auth phase" in line and ", banner 0." in line and ", kex 0." in line and ", auth 0." in line


def test_a_failing_proxy_command_gives_its_exit_and_stderr(lab, tmp_path):
    address = lab.address("lab-01")
    proxy = f"ssh -o BatchMode=yes -o ConnectTimeout=5 -p 1 -W %h:%p root@{address}"
    cfg = write_ssh_config(tmp_path / "ssh_config", lab.known_hosts, extra=f"Host {address}\n  ProxyCommand {proxy}\n")
    started = time.monotonic()
    r, hosts = status(lab, lab.inventory, "lab-01", "--ssh-config", str(cfg), "--connect-timeout", "20")
    assert time.monotonic() - started < 15  # the proxy's exit ends the connect, not the connect timeout
    assert r.returncode == 3
    expanded = proxy.replace("%h:%p", f"{address}:22")
    assert hosts["lab-01"]["error"] == (
        f"ProxyCommand `{expanded}` exited 255 before an SSH session: ssh: connect to host {address} port 1: "
        "Connection refused: fix ProxyCommand in ssh_config")
    assert f"proxy ProxyCommand {expanded}" in traced(r, "lab-01", "dialling")


def test_an_sshd_that_sends_no_banner_is_named_as_the_banner_phase_with_its_time(lab, tmp_path):
    lab.fault("lab-01", "freeze")
    try:
        r, hosts = status(lab, lab.inventory, "lab-01:lab-02", "--connect-timeout", "3")
    finally:
        lab.fault("lab-01", "thaw")
    address = lab.address("lab-01")
    assert r.returncode == 3 and hosts["lab-02"]["status"] == "ok", r.stderr[-2000:]
    error = hosts["lab-01"]["error"]
    assert re.fullmatch(rf"stalled in the banner phase after [23]\.\d s \(connect timeout 3 s\): TCP to "
                        rf"{re.escape(address)}:22 is open but no SSH banner came .*", error), error
    stalled = traced(r, "lab-01", "not connected")
    assert ", banner " in stalled and "kex" not in stalled
    # a host that connects: every phase's time, then the first session channel's
    connected = traced(r, "lab-02", "connected")
    assert re.search(r"resolve [\d.]+ s, connect [\d.]+ s, banner [\d.]+ s, kex [\d.]+ s, auth [\d.]+ s$", connected)
    assert re.search(r"fleetctl: lab-02: open-session [\d.]+ s", r.stderr)
