"""fleetctl's host-key policy for both SSH connection kinds, whatever the inventory says (security
review turn 3, N3): the known-hosts sources come only from ssh_config (inventory args that name
them are exit 4 with the variable, the host and the file:line), `StrictHostKeyChecking no/off`
from anywhere is accept-new, and on every `ssh` command line fleetctl's own host-key option comes
before the host's args (OpenSSH keeps the first value, so the inventory cannot weaken it).

Nothing here dials a host: `.invalid` names are only handed to `ssh -G`; the command lines the
ssh connection runs are seen by a `ssh` on PATH that records its argv and execs the real one,
against a closed port on 127.0.0.1."""

from __future__ import annotations

import json
import socket
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from fleetctl import inventory
from fleetctl.connection import Session, Settings, Unreachable
from fleetctl.errors import EXIT_PARSE, SshConfigError

pytestmark = pytest.mark.skipif(shutil.which("ssh") is None, reason="needs the OpenSSH client (ssh -G)")

REAL_SSH = shutil.which("ssh")
# Each option that names where host keys are looked up or by what name, with a value to give it.
SOURCES = {"UserKnownHostsFile": "/dev/null", "GlobalKnownHostsFile": "/dev/null",
           "KnownHostsCommand": "/bin/true", "HostKeyAlias": "other", "CheckHostIP": "no",
           "VerifyHostKeyDNS": "yes"}
# The ways one `-o` can be written on ssh's command line (ssh(1): -o takes ssh_config's `Keyword
# value` or `Keyword=value`, keywords in any case; getopt allows `-oARG` and clustered flags).
SPELLINGS = {
    "-o Name=value": lambda k, v: f"-o {k}={v}",
    "-oName=value": lambda k, v: f"-o{k}={v}",
    '-o "Name value"': lambda k, v: f'-o "{k} {v}"',
    "lower case": lambda k, v: f"-o {k.lower()}={v}",
    "clustered -vo": lambda k, v: f"-Cvo {k}={v}",
}


def write_inventory(path: Path, var: str, args: str, kind: str = "ssh") -> tuple[Path, int]:
    """A one-host inventory whose host gpu-01 sets `var` to `args`; -> (path, the line of `var`)."""
    path.write_text("all:\n  hosts:\n    gpu-01:\n      ansible_host: gpu-01.example.invalid\n"
                    f"      ansible_connection: {kind}\n      {var}: {json.dumps(args)}\n")
    return path, 6


def resolve(tmp_path: Path, inv: Path, ssh_config: str = "", **settings):
    cfg = tmp_path / "ssh_config"
    cfg.write_text(ssh_config)
    host = inventory.load(inv).select("all")[0]
    return Session(Settings(ssh_config=cfg, **settings)).resolver.resolve_host(host, time.monotonic() + 20)


@pytest.mark.parametrize("spelling", SPELLINGS)
@pytest.mark.parametrize("option", SOURCES)
@pytest.mark.parametrize("var", ["ansible_ssh_common_args", "ansible_ssh_extra_args"])
def test_inventory_args_naming_a_known_hosts_source_are_refused(tmp_path, var, option, spelling):
    args = "-o ServerAliveInterval=5 " + SPELLINGS[spelling](option, SOURCES[option])
    inv, line = write_inventory(tmp_path / "hosts.yaml", var, args)
    with pytest.raises(SshConfigError) as e:
        resolve(tmp_path, inv)
    msg = str(e.value)
    assert e.value.exit_code == EXIT_PARSE == 4
    assert msg.startswith(f"{inv}:{line}: host gpu-01: {var} sets {option} "), msg
    assert "put it in ssh_config (--ssh-config FILE" in msg


def test_a_group_var_is_refused_at_the_line_that_sets_it(tmp_path):
    inv = tmp_path / "hosts.yaml"
    inv.write_text("all:\n  vars:\n    ansible_ssh_common_args: -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null\n"
                   "  hosts:\n    gpu-01:\n      ansible_host: gpu-01.example.invalid\n")
    with pytest.raises(SshConfigError, match=rf"^{inv}:3: host gpu-01: ansible_ssh_common_args sets "
                                             r"UserKnownHostsFile \(`-o UserKnownHostsFile=/dev/null`\)"):
        resolve(tmp_path, inv)


@pytest.mark.parametrize("args", ["-o StrictHostKeyChecking=no", "-F /etc/ssh/ssh_config", "-J root@bastion.invalid",
                                  "-o ProxyCommand='ssh -o UserKnownHostsFile=/dev/null -W %h:%p b.invalid'",
                                  "-i -oUserKnownHostsFile=x"])
def test_args_that_name_no_known_hosts_source_are_read(tmp_path, args):
    """StrictHostKeyChecking, a host's own `-F FILE`, a bastion, a ProxyCommand (its own ssh is the
    user's), and a word that is the argument of another option (`-i FILE`) are not refused."""
    inv, _ = write_inventory(tmp_path / "hosts.yaml", "ansible_ssh_common_args", args)
    assert resolve(tmp_path, inv).hostname == "gpu-01.example.invalid"


@pytest.mark.parametrize("kind", ["ssh", "paramiko"])
def test_a_refused_option_is_exit_4_for_both_kinds_and_nothing_is_dialled(tmp_path, kind):
    inv, line = write_inventory(tmp_path / "hosts.yaml", "ansible_ssh_common_args",
                                "-o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null", kind)
    cfg = tmp_path / "ssh_config"
    cfg.write_text("")
    r = subprocess.run([sys.executable, "-m", "fleetctl.cli", "inspect", "all", "-i", str(inv), "--ssh-config",
                        str(cfg), "--json"], capture_output=True, text=True, timeout=120)
    host = json.loads(r.stdout)["hosts"][0]
    assert r.returncode == 4, (r.returncode, host)
    assert host["status"] == "failed" and host["error"].startswith(
        f"{inv}:{line}: host gpu-01: ansible_ssh_common_args sets UserKnownHostsFile"), host["error"]


def test_an_exported_inventory_fed_back_to_fleetctl_is_refused_saying_what_to_do(tmp_path):
    """`inventory export` writes `-o UserKnownHostsFile=...` for ansible-playbook (tests/unit/
    test_collection.py); fleetctl does not take a known_hosts file from it: exit 4 naming the
    export and the inventory to use instead."""
    known = tmp_path / "known_hosts"
    known.write_text("")
    cfg = tmp_path / "ssh_config"
    cfg.write_text(f"Host *\n  UserKnownHostsFile {known}\n")
    inv = tmp_path / "hosts.yaml"
    inv.write_text("all:\n  hosts:\n    gpu-01: {ansible_host: gpu-01.example.invalid}\n")
    cli = [sys.executable, "-m", "fleetctl.cli"]
    r = subprocess.run([*cli, "inventory", "export", "-i", str(inv), "--ssh-config", str(cfg)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    exported = tmp_path / "exported.yaml"
    exported.write_text(r.stdout)
    r = subprocess.run([*cli, "hosts", "all", "-i", str(exported), "--ssh-config", str(cfg), "--json"],
                       capture_output=True, text=True, timeout=120)
    error = json.loads(r.stdout)["hosts"][0]["error"]
    assert r.returncode == 4
    assert error.startswith(f"{exported}:") and "sets UserKnownHostsFile" in error
    assert "written by `fleetctl inventory export` for ansible-playbook" in error


# ------------------------------------------------------------------ how strict

@pytest.mark.parametrize("args, ssh_config, flag, accept", [
    ("-o StrictHostKeyChecking=no", "", False, True),
    ("-o StrictHostKeyChecking=off", "", False, True),
    ("-oStricthostkeychecking=NO", "", False, True),
    ("", "Host *\n  StrictHostKeyChecking no\n", False, True),
    ("-o StrictHostKeyChecking=no", "Host *\n  StrictHostKeyChecking yes\n", False, True),  # first wins, as ssh
    ("-o StrictHostKeyChecking=yes", "Host *\n  StrictHostKeyChecking no\n", False, False),
    ("-o StrictHostKeyChecking=ask", "", False, False),
    ("-o StrictHostKeyChecking=accept-new", "", False, False),
    ("", "", False, False),
    ("", "", True, True),
    ("-o StrictHostKeyChecking=yes", "", True, True),  # --accept-new is fleetctl's own
])
def test_no_or_off_anywhere_is_accept_new(tmp_path, args, ssh_config, flag, accept):
    inv, _ = write_inventory(tmp_path / "hosts.yaml", "ansible_ssh_common_args", args)
    known = tmp_path / "known_hosts"
    r = resolve(tmp_path, inv, ssh_config + f"Host *\n  UserKnownHostsFile {known}\n")
    from fleetctl.connection import hostkey_policy  # here: the other tests run against a tree without it
    assert hostkey_policy.accept_new(r, flag) is accept
    assert hostkey_policy.ssh_options(r, flag) == ["-o", f"StrictHostKeyChecking={'accept-new' if accept else 'yes'}"]


@pytest.mark.parametrize("known", ["/dev/null", "none"])
def test_accept_new_needs_a_known_hosts_file_that_keeps_the_key(tmp_path, known, caplog):
    """The usual pair in ssh_config (`StrictHostKeyChecking no`, `UserKnownHostsFile /dev/null`)
    would trust every host on every connect: with nowhere to keep a key, unknown keys are refused."""
    inv, _ = write_inventory(tmp_path / "hosts.yaml", "ansible_ssh_common_args", "")
    r = resolve(tmp_path, inv, f"Host *\n  StrictHostKeyChecking no\n  UserKnownHostsFile {known}\n")
    from fleetctl.connection import hostkey_policy
    assert hostkey_policy.accept_new(r, True) is False
    assert f"UserKnownHostsFile {known} keeps no host key" in caplog.text


# ------------------------------------------------------------------ the ssh connection's command lines

def spy_path(tmp_path: Path) -> tuple[dict, Path]:
    """An environment whose `ssh` records its argv (one JSON list a line in the returned log) and
    then runs the real OpenSSH client."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    log = tmp_path / "ssh-argv.log"
    spy = bindir / "ssh"
    spy.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                   f"with open({str(log)!r}, 'a') as f:\n    f.write(json.dumps(sys.argv[1:]) + '\\n')\n"
                   f"os.execv({REAL_SSH!r}, [{REAL_SSH!r}, *sys.argv[1:]])\n")
    spy.chmod(0o755)
    return {"PATH": f"{bindir}:{os.environ['PATH']}"}, log


def openssh_decides(argv: list[str]) -> str:
    """What OpenSSH itself makes of `argv` (an `ssh ...` command line fleetctl ran): its
    StrictHostKeyChecking as `ssh -G` prints it (true: yes, false: no, accept-new)."""
    words = [w for w in argv if w not in ("-M", "-N", "-f")]
    if "-O" in words:
        del words[words.index("-O"):words.index("-O") + 2]
    out = subprocess.run([REAL_SSH, "-G", *words], capture_output=True, text=True, timeout=20, check=True).stdout
    return next(line.split()[1] for line in out.splitlines() if line.startswith("stricthostkeychecking "))


def test_the_ssh_connection_puts_its_host_key_option_before_the_hosts_args(tmp_path, monkeypatch):
    """Every ssh the ssh connection runs to open a host (the user's-master `-O check`, a bastion's
    `-O check` and master, the host's master) starts with fleetctl's StrictHostKeyChecking, and
    OpenSSH keeps it whatever the inventory's args say after it. Host a's args say `no`: accept-new;
    host b's say `accept-new` without --accept-new: yes; b's bastion's ssh_config says `no`:
    accept-new for the bastion. Every port is closed, so each connect fails at once."""
    env, log = spy_path(tmp_path)
    monkeypatch.setenv("PATH", env["PATH"])
    cfg = tmp_path / "ssh_config"
    # b's own ControlPath holds a socket of this user (not a live master): its `-O check` is asked
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp_path / "cm-b"))
    cfg.write_text("Host bastion\n  HostName 127.0.0.1\n  Port 1\n  ProxyJump none\n  StrictHostKeyChecking no\n"
                   f"Host b\n  ProxyJump bastion\n  ControlPath {tmp_path}/cm-b\n"
                   f"Host *\n  UserKnownHostsFile {tmp_path}/known_hosts\n  HostName 127.0.0.1\n  Port 1\n")
    inv = tmp_path / "hosts.yaml"
    inv.write_text(yaml.safe_dump({"all": {"vars": {"ansible_connection": "ssh"}, "hosts": {
        "a": {"ansible_ssh_common_args": "-o StrictHostKeyChecking=no -o ConnectTimeout=3"},
        "b": {"ansible_ssh_extra_args": "-o StrictHostKeyChecking=accept-new"}}}}))
    hosts = {h.name: h for h in inventory.load(inv).select("all")}
    with Session(Settings(ssh_config=cfg, connect_timeout=10)) as session:  # its run ssh_config lives as long
        for name in ("a", "b"):
            with pytest.raises(Unreachable):
                session.connect(hosts[name]).open()
        runs = [json.loads(line) for line in log.read_text().splitlines()]
        dialling = [a for a in runs if "-G" not in a]
        assert [("-M" in a, "-O" in a, a[-1]) for a in dialling] == [
            (True, False, "a"), (False, True, "b"), (False, True, "bastion"), (True, False, "bastion")]
        want = {"a": "accept-new", "b": "true", "bastion": "accept-new"}
        for argv in dialling:
            assert argv[:2] == ["-o", f"StrictHostKeyChecking={'yes' if want[argv[-1]] == 'true' else 'accept-new'}"]
            assert openssh_decides(argv) == want[argv[-1]], argv


def test_a_users_master_counts_only_under_directories_no_one_else_can_replace(tmp_path):
    """users_master (security review turn 3, N9, and its red-team follow-up): the socket's own
    directory and every one above it must be this user's or root's, not writable by others
    (unless sticky, as /tmp is)."""
    from fleetctl.connection.openssh import users_master
    top = tmp_path / "top"
    (top / "cm").mkdir(parents=True, mode=0o700)
    top.chmod(0o700)
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(top / "cm" / "m"))
    assert users_master(str(top / "cm" / "m")) is None
    top.chmod(0o777)  # another user could move cm/ away and put a directory of theirs in its place
    assert "which others could replace" in users_master(str(top / "cm" / "m"))
    top.chmod(0o1777)  # sticky: cm/ stays ours
    assert users_master(str(top / "cm" / "m")) is None
    assert users_master(str(top / "cm" / "gone")) == "" and users_master("none") == ""
