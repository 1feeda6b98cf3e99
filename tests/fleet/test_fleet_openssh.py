"""Both SSH connections through real sshd: `paramiko` and `ssh` (the system OpenSSH client over a
ControlMaster). One inspect smoke under both; the ssh connection's own promises: a command's exit
status in-band (255 is the command's, not a lost connection), host keys as OpenSSH decides,
masters closed at the end of the run."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import yaml

from conftest import write_ssh_config
from fleetctl.connection import Settings
from fleetctl.engine.fleet import Fleet
from fleetctl.vocab import HostStatus
from fleetctl.inventory import load


def inventory_with(lab, tmp_path: Path, kind: str) -> Path:
    """The lab's inventory with every host on `kind`."""
    doc = yaml.safe_load(lab.inventory.read_text())
    doc["all"]["vars"] = {"ansible_connection": kind}
    path = tmp_path / f"hosts-{kind}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def processes_naming(text: str) -> list[str]:
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            out.append(cmdline)
    return out


@pytest.mark.parametrize("kind", ["paramiko", "ssh"])
def test_inspect_through_both_connections(lab, tmp_path, kind):
    r, _, hosts = lab.cli_json("inspect", "lab-01:lab-02", "-c", kind)  # the lab's inventory sets no kind
    assert r.returncode == 0, (hosts, r.stderr[-2000:])
    for name in ("lab-01", "lab-02"):
        assert hosts[name]["status"] == HostStatus.OK and hosts[name]["address"] == lab.address(name)
        assert hosts[name]["facts"]["hostname"] == name


def test_ssh_connection_exit_status_in_band_and_masters_closed(lab, tmp_path):
    host = load(inventory_with(lab, tmp_path, "ssh")).select("lab-03")[0]
    settings = Settings(ssh_config=lab.ssh_config)
    seen = {}

    def job(ctx):
        r = ctx.run(["sh", "-c", "printf out; printf err >&2; exit 255"])
        seen["sockets"] = [p.name for p in ctx.conn.session.control_files.dir.iterdir() if p.is_socket()]
        return ctx.result(HostStatus.OK, data={"code": r.exit_code, "out": r.stdout.decode(), "err": r.stderr.decode()})

    with Fleet(settings) as fleet:
        result = fleet.run([host], job)[0]
        control = fleet.session.control_files.dir
        assert result.status == HostStatus.OK, result.error
        assert result.data == {"code": 255, "out": "out", "err": "err"}
        assert [bool(re.fullmatch(r"[0-9a-f]{40}", s)) for s in seen["sockets"]] == [True]  # %C
        assert (control.stat().st_mode & 0o777) == 0o700 and len(str(control / seen["sockets"][0])) < 108
    assert not control.exists()
    assert processes_naming(str(control)) == []


def test_ssh_connection_runs_over_the_users_live_master_and_leaves_it(lab, tmp_path):
    """An operator's own ControlMaster/ControlPath/ControlPersist: with a live master for the host,
    the ssh connection's commands go over it (shown with sshd's listener frozen: no new connection
    can be made) and it is left running; without one, the run opens and closes its own, never in
    the user's ControlPath."""
    cm = Path(tempfile.mkdtemp(prefix="cm-", dir="/tmp"))  # a socket path has 108 bytes: no pytest tmp_path
    config = write_ssh_config(tmp_path / "ssh_config", lab.known_hosts,
                              f"Host *\n  ControlMaster auto\n  ControlPath {cm}/%C\n  ControlPersist 120\n")
    addr, env = lab.address("lab-02"), {"FLEETCTL_SSH_CONFIG": str(config)}
    base = ["ssh", "-F", str(config), "-o", "User=root", "-o", f"IdentityFile={lab.state_dir / 'client_ed25519'}",
            "-o", "BatchMode=yes"]

    def master_alive() -> bool:
        return subprocess.run([*base, "-O", "check", "--", addr], capture_output=True, timeout=30).returncode == 0

    try:
        r = subprocess.run([*base, "-M", "-N", "-f", "--", addr], timeout=60, stdin=subprocess.DEVNULL,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        assert r.returncode == 0, r.stderr
        assert master_alive()
        lab.fault("lab-02", "freeze")
        try:
            _, _, hosts = lab.cli_json("inspect", "lab-02", "-c", "ssh", "--connect-timeout", "5", env=env, rc=0)
        finally:
            lab.fault("lab-02", "thaw")
        assert hosts["lab-02"]["facts"]["hostname"] == "lab-02"
        assert master_alive()  # the user's master is theirs: left running
        subprocess.run([*base, "-O", "exit", "--", addr], capture_output=True, timeout=30)
        assert not master_alive()
        _, _, hosts = lab.cli_json("inspect", "lab-02", "-c", "ssh", env=env, rc=0)
        assert hosts["lab-02"]["facts"]["hostname"] == "lab-02"
        assert not master_alive() and not any(cm.iterdir())  # the run's own master lived in its own dir
    finally:
        subprocess.run([*base, "-O", "exit", "--", addr], capture_output=True, timeout=30)
        shutil.rmtree(cm, ignore_errors=True)


def test_ssh_connection_host_keys_as_openssh_decides(lab, tmp_path):
    known = tmp_path / "known_hosts"
    cfg = write_ssh_config(tmp_path / "config", known)
    inv = inventory_with(lab, tmp_path, "ssh")
    r, _, hosts = lab.cli_json("inspect", "lab-04", "-i", str(inv), "--ssh-config", str(cfg))
    assert r.returncode == 3 and hosts["lab-04"]["status"] == HostStatus.UNREACHABLE
    assert "Host key verification failed" in hosts["lab-04"]["error"] and not known.exists()
    r, _, hosts = lab.cli_json("inspect", "lab-04", "-i", str(inv), "--ssh-config", str(cfg), "--accept-new")
    assert r.returncode == 0, hosts["lab-04"]["error"]
    assert known.read_text().split()[0] == lab.address("lab-04")


def test_apply_and_rollback_through_the_ssh_connection(server_lab, tmp_path):
    """The change engine (lock held over the master, uploads on stdin, the validation gate) under
    the ssh connection, on one host; rolled back to the wheel's bytes."""
    inv = str(inventory_with(server_lab, tmp_path, "ssh"))
    r, doc, hosts = server_lab.cli_json("apply", "defrag-tier0", "lab-02", "-i", inv, "--yes")
    try:
        assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
        assert hosts["lab-02"]["status"] == "changed" and hosts["lab-02"]["validation"]["status"] == "passed"
        files = hosts["lab-02"]["plan"]["files"]
        for f in files:
            got = server_lab.ssh("lab-02", f"sha256sum {f['path']}").stdout.split()[0]
            assert got == f["post_sha256"]
    finally:
        r, _, rolled = server_lab.cli_json("rollback", "--last", "lab-02", "-i", inv, "--yes")
    assert r.returncode == 0 and rolled["lab-02"]["status"] == "changed", rolled
    for f in files:
        got = server_lab.ssh("lab-02", f"sha256sum {f['path']}").stdout.split()[0]
        assert got == f["pre_sha256"]


@pytest.mark.parametrize("kind", ["paramiko", "ssh"])
def test_strict_host_key_checking_no_is_accept_new_never_weaker(lab, tmp_path, kind):
    known = tmp_path / "known_hosts"
    cfg = write_ssh_config(tmp_path / "config", known, "Host *\n  StrictHostKeyChecking no\n")
    r, _, hosts = lab.cli_json("inspect", "lab-02", "-c", kind, "--ssh-config", str(cfg))
    assert r.returncode == 0, hosts["lab-02"]["error"]
    assert "StrictHostKeyChecking no/off in ssh_config is treated as accept-new" in r.stderr
    assert known.read_text().split()[0] == lab.address("lab-02")
    fake = "AAAAC3NzaC1lZDI1NTE5AAAAIKtZZipMIFKufYYiG98eBzugs9Xw6YwLoWhGGtpp7Rrn"  # case 01's CA: not lab-02's key
    known.write_text(f"{lab.address('lab-02')} ssh-ed25519 {fake}\n")
    r, _, hosts = lab.cli_json("inspect", "lab-02", "-c", kind, "--ssh-config", str(cfg))
    assert r.returncode == 3 and hosts["lab-02"]["status"] == HostStatus.UNREACHABLE
    assert known.read_text() == f"{lab.address('lab-02')} ssh-ed25519 {fake}\n"
