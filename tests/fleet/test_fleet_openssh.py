"""Both SSH connections through real sshd: `paramiko` and `ssh` (the system OpenSSH client over a
ControlMaster). One inspect smoke under both; the ssh connection's own promises: a command's exit
status in-band (255 is the command's, not a lost connection), host keys as OpenSSH decides,
masters closed at the end of the run; and the host-key policy, fleetctl's for both kinds whatever
the inventory's ansible_ssh_common_args say (security review turn 3, N3). Whether anything ran on
a host is read from its sshd's log (LogLevel VERBOSE: one "Accepted publickey" line a login)."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import yaml

from conftest import write_ssh_config
from fleetctl import lab as labmod
from fleetctl.connection import HostKeyRefused, Settings
from fleetctl.engine.fleet import Fleet
from fleetctl.vocab import HostStatus
from fleetctl.inventory import load


# An ed25519 key no lab host has (case 01's CA), to pin a host under another key.
FAKE = "AAAAC3NzaC1lZDI1NTE5AAAAIKtZZipMIFKufYYiG98eBzugs9Xw6YwLoWhGGtpp7Rrn"
ACCEPTED = re.compile(r"Accepted publickey for (\S+) from ")


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


def test_a_control_path_socket_another_user_could_have_planted_is_never_spoken_to(lab, tmp_path):
    """Security review turn 3, N9: the user's ControlPath holds a socket that is not this user's,
    or lies in a directory others can write. fleetctl says so and opens its own master; the
    socket (a listener that counts who connects) is never connected to (OpenSSH's client would:
    it checks no owner)."""
    cm = Path(tempfile.mkdtemp(prefix="cm-", dir="/tmp"))
    config = write_ssh_config(tmp_path / "ssh_config", lab.known_hosts, f"Host *\n  ControlPath {cm}/%C\n")
    addr = lab.address("lab-02")
    g = subprocess.run(["ssh", "-F", str(config), "-o", "User=root", "-G", "--", addr], capture_output=True, text=True,
                       timeout=30, check=True).stdout
    path = next(line.split(None, 1)[1] for line in g.splitlines() if line.startswith("controlpath "))
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen(8)
    listener.settimeout(0.2)
    accepted, stop = [], threading.Event()

    def count():
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except OSError:
                continue
    threading.Thread(target=count, daemon=True).start()
    try:
        for owner, mode, said in ((65534, 0o700, "is not a socket of uid 0 (owner uid 65534): not used"),
                                  (0, 0o777, "others could replace the socket")):
            os.chown(path, owner, owner)
            cm.chmod(mode)
            r, _, hosts = lab.cli_json("inspect", "lab-02", "-c", "ssh", env={"FLEETCTL_SSH_CONFIG": str(config)}, rc=0)
            assert hosts["lab-02"]["facts"]["hostname"] == "lab-02"
            assert said in r.stderr and path in r.stderr, r.stderr[-2000:]
            assert accepted == [], f"fleetctl's ssh spoke to the planted socket ({oct(mode)}, uid {owner})"
    finally:
        stop.set()
        listener.close()
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
    assert "StrictHostKeyChecking no/off (ssh_config or the inventory's ssh args) is treated as accept-new" in r.stderr
    assert known.read_text().split()[0] == lab.address("lab-02")
    known.write_text(f"{lab.address('lab-02')} ssh-ed25519 {FAKE}\n")
    r, _, hosts = lab.cli_json("inspect", "lab-02", "-c", kind, "--ssh-config", str(cfg))
    assert r.returncode == 3 and hosts["lab-02"]["status"] == HostStatus.UNREACHABLE
    assert known.read_text() == f"{lab.address('lab-02')} ssh-ed25519 {FAKE}\n"


# ------------------------------------------------------------------ the inventory's ssh args (N3)

def inventory_with_args(lab, tmp_path: Path, host: str, kind: str, args: str) -> tuple[Path, int]:
    """A one-host inventory: `host` with its lab vars, `kind`, and ansible_ssh_common_args `args`;
    -> (its path, the line of ansible_ssh_common_args)."""
    own = yaml.safe_load(lab.inventory.read_text())["all"]["children"]["lab"]["hosts"][host]
    lines = ["all:", "  hosts:", f"    {host}:", f"      ansible_connection: {kind}",
             *(f"      {k}: {json.dumps(v)}" for k, v in own.items()), f"      ansible_ssh_common_args: {json.dumps(args)}"]
    path = tmp_path / f"hosts-{kind}-args.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path, len(lines)


def sshd_log(lab, host: str) -> Path:
    return labmod.state_dir_for(lab.lab_id, lab.state_dir) / "hosts" / host / "sshd.log"


def logins(log: Path, since: int) -> list[str]:
    """The users the host's sshd let in after byte `since` of its log."""
    return ACCEPTED.findall(log.read_bytes()[since:].decode(errors="replace"))


def host_key_line(lab, host: str) -> list[str]:
    """[address, key type, base64 key] of `host`'s real key, from the lab's known_hosts."""
    return next(line.split()[:3] for line in lab.known_hosts.read_text().splitlines()
                if line.split()[0] == lab.address(host))


@pytest.mark.parametrize("kind", ["paramiko", "ssh"])
@pytest.mark.parametrize("args, rc", [("-o StrictHostKeyChecking=no", 3),
                                      ("-o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null", 4)],
                         ids=["no", "no-and-dev-null"])
def test_inventory_ssh_args_never_get_a_changed_host_key_accepted(lab, tmp_path, kind, args, rc):
    """lab-03 pinned under another key; the inventory's ansible_ssh_common_args say `no` (exit 3:
    accept-new, and a changed key is refused, as unreachable) or give the usual pair with
    UserKnownHostsFile=/dev/null (exit 4: fleetctl takes no known_hosts file from the inventory,
    refused before any connect, naming the variable, host and file:line). Both kinds; nothing
    logs in, and known_hosts is unchanged."""
    name, addr = "lab-03", lab.address("lab-03")
    known = tmp_path / "known_hosts"
    known.write_text(f"{addr} ssh-ed25519 {FAKE}\n")
    cfg = write_ssh_config(tmp_path / "config", known)
    inv, line = inventory_with_args(lab, tmp_path, name, kind, args)
    log = sshd_log(lab, name)
    mark = log.stat().st_size
    r, _, hosts = lab.cli_json("inspect", name, "-i", str(inv), "--ssh-config", str(cfg))
    error = hosts[name]["error"] or ""
    assert r.returncode == rc, (hosts[name]["status"], error)
    if rc == 3:
        assert hosts[name]["status"] == HostStatus.UNREACHABLE
        assert ("REMOTE HOST IDENTIFICATION HAS CHANGED" if kind == "ssh" else "HOST KEY CHANGED") in error, error
    else:
        assert hosts[name]["status"] == HostStatus.FAILED
        assert error.startswith(f"{inv}:{line}: host {name}: ansible_ssh_common_args sets UserKnownHostsFile "), error
    assert known.read_text() == f"{addr} ssh-ed25519 {FAKE}\n"
    assert logins(log, mark) == []


def ssh_spy(tmp_path: Path) -> tuple[dict, Path]:
    """An env whose `ssh` on PATH records its argv (a JSON list a line, in the returned log) and
    then runs the real OpenSSH client."""
    real = shutil.which("ssh")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    log = tmp_path / "ssh-argv.log"
    (bindir / "ssh").write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                                f"with open({str(log)!r}, 'a') as f:\n    f.write(json.dumps(sys.argv[1:]) + '\\n')\n"
                                f"os.execv({real!r}, [{real!r}, *sys.argv[1:]])\n")
    (bindir / "ssh").chmod(0o755)
    return {"PATH": f"{bindir}:{os.environ['PATH']}"}, log


@pytest.mark.parametrize("kind", ["paramiko", "ssh"])
def test_strict_host_key_checking_no_in_inventory_args_stores_an_unknown_key_on_first_use(lab, tmp_path, kind):
    """`-o StrictHostKeyChecking=no` in ansible_ssh_common_args, lab-03 unknown, no --accept-new:
    accept-new (a warning; the host's real key stored on first use; the inspect runs). Every ssh
    the ssh connection runs to the host (master, check, each command, -O exit) starts with
    fleetctl's `-o StrictHostKeyChecking=accept-new`; paramiko runs only `ssh -G`."""
    name = "lab-03"
    known = tmp_path / "known_hosts"
    cfg = write_ssh_config(tmp_path / "config", known)
    inv, _ = inventory_with_args(lab, tmp_path, name, kind, "-o StrictHostKeyChecking=no")
    env, argv_log = ssh_spy(tmp_path)
    r, _, hosts = lab.cli_json("inspect", name, "-i", str(inv), "--ssh-config", str(cfg), env=env, rc=0)
    assert hosts[name]["status"] == HostStatus.OK and hosts[name]["facts"]["hostname"] == name
    assert f"{name}: StrictHostKeyChecking no/off (ssh_config or the inventory's ssh args) is treated as " \
           "accept-new (a changed key is still refused)" in r.stderr
    assert [line.split() for line in known.read_text().splitlines()] == [host_key_line(lab, name)]
    runs = [json.loads(line) for line in argv_log.read_text().splitlines()]
    dialling = [a for a in runs if "-G" not in a and a[-2:] != ["exit", "fleetctl-master"]]
    if kind == "paramiko":
        assert dialling == [] and runs
    else:
        modes = [next(w for w in a if w in ("-M", "-T", "-O")) for a in dialling]
        assert modes[0] == "-M" and "-T" in modes and "-O" in modes, dialling  # master, command(s), check/exit
        assert all(a[:2] == ["-o", "StrictHostKeyChecking=accept-new"] for a in dialling), dialling


def test_a_master_that_connected_past_a_changed_host_key_is_stopped_and_refused(lab, tmp_path):
    """The review's other half of N3: should ssh ever connect although the host identification
    changed (StrictHostKeyChecking=no put first on its command line here, by hand), open_master
    reads OpenSSH's warning on exit 0 too, stops the master and raises HostKeyRefused."""
    from fleetctl.connection.openssh import open_master
    name, addr = "lab-03", lab.address("lab-03")
    known = tmp_path / "known_hosts"
    known.write_text(f"{addr} ssh-ed25519 {FAKE}\n")
    cm = Path(tempfile.mkdtemp(prefix="cm-", dir="/tmp"))  # a socket path has 108 bytes at most
    cfg = write_ssh_config(tmp_path / "config", known, f"Host *\n  ControlPath {cm}/%C\n  User root\n"
                                                       f"  IdentityFile {lab.state_dir / 'client_ed25519'}\n")
    argv = ["ssh", "-o", "StrictHostKeyChecking=no", "-F", str(cfg), "-o", "BatchMode=yes"]
    log = sshd_log(lab, name)
    mark = log.stat().st_size
    try:
        with pytest.raises(HostKeyRefused, match=f"(?s)OpenSSH refused the host key of {name}: .*IDENTIFICATION HAS CHANGED"):
            open_master(argv, addr, time.monotonic() + 30, name, 30)
        assert logins(log, mark) == ["root"]  # OpenSSH did connect: the exit-0 path was taken
        check = subprocess.run([*argv, "-O", "check", "--", addr], capture_output=True, timeout=30)
        assert check.returncode != 0 and not any(cm.iterdir())
    finally:
        subprocess.run([*argv, "-O", "exit", "--", addr], capture_output=True, timeout=30)
        shutil.rmtree(cm, ignore_errors=True)
