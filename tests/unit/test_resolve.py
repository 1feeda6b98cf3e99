"""Resolution as OpenSSH does it (`ssh -G`), and the fallback reader without an OpenSSH client:
cases 02 (Include) and 03 (ProxyJump none, hop order). Nothing here dials: `.invalid` names are
only ever handed to `ssh -G`, which does not look names up (CanonicalizeHostname is off)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fleetctl.connection import resolve
from fleetctl.connection.resolve import passwd_home
from fleetctl.connection.resolve import Hop, Resolver, hop_chain
from fleetctl.errors import SshConfigError

pytestmark = pytest.mark.skipif(shutil.which("ssh") is None, reason="needs the OpenSSH client (ssh -G)")


def resolved(config: Path, address: str, **kw):
    return Resolver(config).resolve(address, time.monotonic() + 20, address, **kw)


def case02(tmp_path: Path) -> Path:
    """Case 02's files; the Include path is absolute because a relative one is relative to the
    passwd home's ~/.ssh (OpenSSH's rule), which a test must not write to."""
    d = tmp_path / "config.d"
    d.mkdir()
    key = tmp_path / "id_fleet"
    key.write_text("not read here\n")
    (d / "gpu.conf").write_text(f"Host gpu-node-*\n    HostName %h.mgmt.example.invalid\n    User sglang\n"
                                f"    Port 2222\n    IdentityFile {tmp_path}/id_%r_missing\n    IdentityFile %d/../{key}\n")
    (d / "z-later.conf").write_text("Host gpu-node-*\n    User later\n")
    config = tmp_path / "config"
    config.write_text(f"Include {d}/*.conf\n\nHost *\n    ServerAliveInterval 30\n")
    return config


def test_case02_include_is_read_as_ssh_reads_it(tmp_path):
    r = resolved(case02(tmp_path), "gpu-node-01")
    assert (r.hostname, r.port, r.user) == ("gpu-node-01.mgmt.example.invalid", 2222, "sglang")
    # id_sglang_missing does not exist and is skipped, as ssh does; %d is the passwd home, through
    # which the key is reached only where that home exists (not nobody's /nonexistent)
    key = Path(f"{passwd_home()}/../{tmp_path}/id_fleet")
    assert r.identity_files == ((key,) if os.path.isdir(passwd_home()) else ())
    assert r.server_alive_interval == 30


def test_inventory_values_win_over_the_config(tmp_path):
    key = tmp_path / "inv_key"
    key.write_text("x\n")
    r = resolved(case02(tmp_path), "gpu-node-01", user="root", port=22, identity_file=str(key))
    assert (r.user, r.port) == ("root", 22)
    assert r.identity_files[0] == key


def case03(tmp_path: Path, text: str) -> Path:
    config = tmp_path / "config"
    config.write_text(text)
    return config


CASE03_A = ("Host bastion\n    HostName bastion.example.invalid\n    User jump\n    ProxyJump none\n\n"
            "Host *\n    User ops\n    ProxyJump bastion\n")
CASE03_B = ("Host bastion\n    HostName bastion.example.invalid\n    User jump\n\n"
            "Host * !bastion !edge\n    ProxyJump ops@edge.example.invalid:2222,bastion\n")


def test_case03a_proxyjump_none_keeps_the_bastion_direct(tmp_path):
    config = case03(tmp_path, CASE03_A)
    bastion = resolved(config, "bastion")
    assert (bastion.hostname, bastion.port, bastion.user, bastion.proxy_jump) == \
        ("bastion.example.invalid", 22, "jump", ())
    node = resolved(config, "gpu-node-01")
    assert node.user == "ops" and node.proxy_jump == (Hop("bastion"),)
    assert [(h.hostname, h.user) for h in hop_chain(node)] == \
        [("bastion.example.invalid", "jump"), ("gpu-node-01", "ops")]


def test_case03a_without_host_star_none_is_never_a_host(tmp_path):
    config = case03(tmp_path, CASE03_A.replace("Host *", "Host gpu-node-*"))
    assert hop_chain(resolved(config, "bastion"))[0].hostname == "bastion.example.invalid"
    assert [h.hostname for h in hop_chain(resolved(config, "gpu-node-01"))] == \
        ["bastion.example.invalid", "gpu-node-01"]


def test_case03b_as_written_is_a_jump_loop_refused_with_exit_4(tmp_path):
    """`!edge` does not exclude the hop `edge.example.invalid`, so the edge host itself would be
    reached through the chain (`ssh -G -p 2222 -l ops edge.example.invalid` prints that ProxyJump):
    OpenSSH would recurse; fleetctl names the loop."""
    with pytest.raises(SshConfigError, match=r"^gpu-node-01: ProxyJump loop: gpu-node-01 -> "
                                             r"ops@edge.example.invalid:2222 -> ops@edge.example.invalid:2222$"):
        resolved(case03(tmp_path, CASE03_B), "gpu-node-01")


def test_case03b_hops_are_dialled_in_the_order_written(tmp_path):
    node = resolved(case03(tmp_path, CASE03_B.replace("!edge", "!edge.example.invalid")), "gpu-node-01")
    assert node.proxy_jump == (Hop("edge.example.invalid", "ops", 2222), Hop("bastion"))
    chain = [(h.hostname, h.port, h.user) for h in hop_chain(node)]
    me = node.user
    assert chain == [("edge.example.invalid", 2222, "ops"), ("bastion.example.invalid", 22, "jump"),
                     ("gpu-node-01", 22, me)]


def test_first_hop_follows_its_own_proxyjump_later_hops_do_not(tmp_path):
    config = case03(tmp_path, "Host a\n  ProxyJump z\nHost b\n  ProxyJump y\nHost t\n  ProxyJump a,b\n")
    assert [h.hostname for h in hop_chain(resolved(config, "t"))] == ["z", "a", "b", "t"]


def test_proxyjump_loop_is_exit_4(tmp_path):
    config = case03(tmp_path, "Host a\n  ProxyJump b\nHost b\n  ProxyJump a\n")
    with pytest.raises(SshConfigError, match="^a: ProxyJump loop: a -> b -> a$") as e:
        resolved(config, "a")
    assert e.value.exit_code == 4


def test_openssh_refusal_is_exit_4_with_its_message(tmp_path):
    config = case03(tmp_path, "Host x\n  Bogus 1\n")
    with pytest.raises(SshConfigError) as e:
        resolved(config, "x")
    assert f"{config}: line 2: Bad configuration option: bogus" in str(e.value) and e.value.exit_code == 4


def test_a_run_resolves_each_command_line_once(tmp_path):
    """Match exec runs a command for every evaluation: once per host per run."""
    count = tmp_path / "count"
    config = case03(tmp_path, f"Match exec \"echo x >> {count}\"\n  User m\n")
    resolver = Resolver(config)
    for _ in range(3):
        assert resolver.resolve("h", time.monotonic() + 20, "h").user == "m"
    assert count.read_text() == "x\n"


def test_ssh_g_argv_puts_extra_args_first_and_the_address_last():
    argv = resolve.ssh_g_argv("a", Path("/c"), "u", 2, "/k", ("-o", "ProxyJump=j"))
    assert argv[:4] == ["ssh", "-G", "-o", "ProxyJump=j"]
    assert argv[4:12] == ["-F", "/c", "-o", "User=u", "-o", "Port=2", "-o", "IdentityFile=/k"]
    assert argv[-2:] == ["--", "a"]


def test_tokens_and_tilde_expand_as_ssh_config_5_says():
    tok = {"%": "%", "h": "host", "r": "me", "p": "22"}
    assert resolve.expand("~/.ssh/id_%r@%h:%p%%", tok, "t") == f"{passwd_home()}/.ssh/id_me@host:22%"
    assert resolve.expand("~root/x", tok, "t") == "/root/x"
    with pytest.raises(SshConfigError, match="unknown token %Q"):
        resolve.expand("a%Q", tok, "t")


def test_percent_C_is_openssh_own(tmp_path):
    config = case03(tmp_path, f"Host h\n  IdentityFile {tmp_path}/%C\n")
    argv = ["ssh", "-G", "-F", str(config), "-o", "ControlPath=%C", "h"]
    want = next(line.split()[1] for line in subprocess.run(argv, capture_output=True, text=True).stdout.splitlines()
                if line.startswith("controlpath "))
    (tmp_path / want).write_text("k\n")
    assert resolved(config, "h").identity_files == (tmp_path / want,)


@pytest.mark.parametrize("value, ok", [("bastion", True), ("u@h:2", True), ("ssh://u@h:2", True),
                                       ("[::1]:22", True), ("h:99999", False), ("h/x", False)])
def test_hop_specs(value, ok):
    if ok:
        assert str(Hop.parse(value, "w")).replace("ssh://", "") == value.replace("ssh://", "").replace("[::1]", "::1")
    else:
        with pytest.raises(SshConfigError, match="w: ProxyJump hop"):
            Hop.parse(value, "w")


# ------------------------------------------------------------------ without an OpenSSH client

def no_ssh(tmp_path: Path, monkeypatch) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))


def test_fallback_refuses_include_with_file_and_line_through_the_cli(tmp_path):
    config = case02(tmp_path)
    inv = tmp_path / "hosts.yaml"
    inv.write_text("all: {hosts: {gpu-node-01: }}\n")
    (tmp_path / "bin").mkdir()
    r = subprocess.run([sys.executable, "-m", "fleetctl.cli", "inspect", "all", "-i", str(inv), "--ssh-config",
                        str(config), "--json"], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PATH=str(tmp_path / "bin")))
    host = json.loads(r.stdout)["hosts"][0]
    assert r.returncode == 4, r.stderr[-2000:]
    assert host["error"].startswith(f"{config}:1: Include needs OpenSSH")


@pytest.mark.parametrize("text, line, what", [
    ("Host *\n  User u\nMatch host x\n  User v\n", 3, "Match"),
    ("Host *\n  ProxyJump a,b\n", 2, "ProxyJump chain"),
    ("Host *\n  HostName %h.%l\n", 2, "HostName token %l"),
    ("Host *\n  User u\n  IdentityFile ~/.ssh/id_%T\n", 3, "identityfile token %T"),
])
def test_fallback_refuses_what_only_openssh_evaluates(tmp_path, monkeypatch, text, line, what):
    no_ssh(tmp_path, monkeypatch)
    config = case03(tmp_path, text)
    with pytest.raises(SshConfigError, match=f"^{config}:{line}: .*{what}"):
        resolved(config, "h")


def test_fallback_reads_first_values_host_patterns_and_hops(tmp_path, monkeypatch):
    no_ssh(tmp_path, monkeypatch)
    config = case03(tmp_path, CASE03_A + "Host gpu-*\n  User late\n  HostName %h.example.invalid\n")
    node = resolved(config, "gpu-1")
    assert (node.user, node.hostname) == ("ops", "gpu-1.example.invalid")
    assert [(h.hostname, h.user) for h in hop_chain(node)] == \
        [("bastion.example.invalid", "jump"), ("gpu-1.example.invalid", "ops")]
    negated = resolved(case03(tmp_path, "Host * !gpu-1\n  User no\n"), "gpu-1")
    assert negated.user != "no" and negated.port == 22


# The fallback reader against `ssh -G` itself: the same Resolved for every destination of one
# config (Host patterns case-sensitive and negated, `=` and tabs, a quoted value, first values
# winning, IdentityFile accumulating without repeats, HostName tokens, the HostName lowercased)
DIFFERENTIAL = """# a comment
Host alpha
  HostName 127.0.0.2
  Port 2222
  User ops
  IdentityFile {d}/id_a
Host beta beta2
  HostName=%h.internal.invalid
  user deploy
Host Up*
  HostName %h.X.invalid
Host *.lab !bad.lab
  User labuser
  StrictHostKeyChecking no
  UserKnownHostsFile {d}/kh1 {d}/kh2
Host Mixed
  HOSTNAME MiXeD.Invalid
Host quoted
  IdentityFile "{d}/id_b"
  ProxyCommand ssh -W %h:%p jump.invalid
Host jumped
  ProxyJump ops@jump.invalid:2022
Host alias
  HostKeyAlias the-alias
  HashKnownHosts yes
  ConnectTimeout 7
  ServerAliveInterval 15
  ServerAliveCountMax 4
  IdentitiesOnly yes
Host multi
  IdentityFile {d}/id_a
  IdentityFile {d}/id_c
  Port 2300
  Port 2400
Host tabbed
\tPort\t2500
Host eq
  Port = 2600
Host *
  User fallbackuser
  IdentityFile {d}/id_c
  StrictHostKeyChecking yes
"""
FIELDS = ("hostname", "port", "user", "identity_files", "identities_only", "proxy_command", "host_key_alias",
          "known_hosts", "global_known_hosts", "host_key_checking_off", "hash_known_hosts", "connect_timeout",
          "server_alive_interval", "server_alive_count_max")


@pytest.mark.parametrize("name", ["alpha", "ALPHA", "beta", "beta2", "UpHost", "x.lab", "X.LAB", "bad.lab", "Mixed",
                                  "mixed", "quoted", "jumped", "alias", "multi", "tabbed", "eq", "other", "10.213.250.11"])
def test_the_fallback_reader_resolves_as_ssh_g_does(tmp_path, name):
    for f in ("id_a", "id_b", "id_c"):
        (tmp_path / f).write_text("not read here\n")
    config = tmp_path / "config"
    config.write_text(DIFFERENTIAL.format(d=tmp_path))
    by_ssh = resolve.resolved_from(name, resolve.run_ssh_g(resolve.ssh_g_argv(name, config), time.monotonic() + 20,
                                                           name), name)
    ours = resolve.resolved_from(name, resolve.fallback_options(name, [config], {}), name)
    assert {f: getattr(ours, f) for f in FIELDS} == {f: getattr(by_ssh, f) for f in FIELDS}
    assert [str(h) for h in ours.proxy_jump] == [str(h) for h in by_ssh.proxy_jump]


# ------------------------------------------------------------------ fleetctl hosts

def test_hosts_shows_what_would_be_dialled_and_the_known_hosts_lines_that_apply(tmp_path):
    import paramiko
    known = tmp_path / "known_hosts"
    key = "AAAAC3NzaC1lZDI1NTE5AAAAIB/R2EBNwSNgM01ZxqKmqKH3/HY4aKPrWNIZZ8vUBvYh"
    known.write_text(f"{paramiko.HostKeys.hash_host('gpu-node-01')} ssh-ed25519 {key}\n"
                     f"other.example.invalid ssh-ed25519 {key}\n")
    config = case03(tmp_path, CASE03_A + f"    UserKnownHostsFile {known}\n")
    inv = tmp_path / "hosts.yaml"
    inv.write_text("all:\n  hosts:\n    gpu-node-01:\n    bastion:\n    bad:\n      ansible_port: 2\n"
                   "    here:\n      ansible_connection: local\n")
    (tmp_path / "bad.conf").write_text("Host bad\n  Nonsense yes\n")
    run = lambda cfg, pattern: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "fleetctl.cli", "hosts", pattern, "-i", str(inv), "--ssh-config", str(cfg), "--json"],
        capture_output=True, text=True, timeout=60)
    r = run(config, "all:!bad")
    assert r.returncode == 0, r.stderr
    hosts = {d["host"]: d for d in json.loads(r.stdout)["hosts"]}
    node = hosts["gpu-node-01"]
    assert (node["connection"], node["address"], node["port"], node["user"]) == ("paramiko", "gpu-node-01", 22, "ops")
    assert node["jump"] == ["jump@bastion.example.invalid:22"] and node["host_key_name"] == "gpu-node-01"
    assert node["known_hosts"][0] == str(known)
    assert [line.split(": ", 1)[0] for line in node["known_hosts_lines"]] == [f"{known}:1"]
    assert hosts["bastion"]["jump"] == [] and hosts["bastion"]["known_hosts_lines"] == []
    assert hosts["here"]["connection"] == "local" and hosts["here"]["address"] == "localhost"
    r = run(tmp_path / "bad.conf", "bad")
    assert r.returncode == 4 and "line 2: Bad configuration option: nonsense" in json.loads(r.stdout)["hosts"][0]["error"]


def test_proxycommand_tokens_hostkeyalias_and_known_hosts_files(tmp_path):
    known = tmp_path / "kh_%h"
    config = case03(tmp_path, f"Host gpu\n  HostName gpu.example.invalid\n  Port 2200\n  User ops\n"
                              f"  ProxyCommand nc -X connect %h %p %r %n %%\n  HostKeyAlias gpu-alias\n"
                              f"  UserKnownHostsFile {known} ~/kh2\n  GlobalKnownHostsFile none\n")
    r = resolved(config, "gpu")
    assert r.proxy_command == "nc -X connect gpu.example.invalid 2200 ops gpu %"
    assert r.host_key_name == "gpu-alias"
    assert r.known_hosts == (tmp_path / "kh_gpu.example.invalid", passwd_home() / "kh2")
    assert r.global_known_hosts == ()
    plain = resolved(case03(tmp_path, "Host h\n  Port 2201\n"), "h")
    assert plain.host_key_name == "[h]:2201" and plain.proxy_command is None


def test_paramiko_offers_config_keys_first_and_identities_only_keeps_back_the_agents_others(tmp_path):
    """IdentityAgent and IdentitiesOnly (ssh_config(5)) with a real ssh-agent, in OpenSSH's order
    (sshconnect2.c pubkey_prepare: the agent's copy of an IdentityFile key before its other keys,
    though the agent lists it last); nothing dialled."""
    import paramiko
    from fleetctl.connection.paramiko_auth import OpenSSHAuth

    keys = {}
    for name in ("in_file", "agent_only"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / name)], check=True)
        keys[paramiko.PKey.from_path(tmp_path / name).asbytes()] = name
    sock = tmp_path / "agent.sock"
    agent = subprocess.Popen(["ssh-agent", "-D", "-a", str(sock)], stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while not sock.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        env = dict(os.environ, SSH_AUTH_SOCK=str(sock))
        for name in ("agent_only", "in_file"):
            subprocess.run(["ssh-add", "-q", str(tmp_path / name)], env=env, check=True, capture_output=True)
        base = f"Host h\n  IdentityFile {tmp_path / 'in_file'}\n  IdentityAgent {sock}\n"

        def offered(config: str) -> list[tuple[str, bool]]:
            auth = OpenSSHAuth(resolved(case03(tmp_path, config), "h"), 5)
            try:
                return [(keys[o.blob], o.agent) for o in auth.prepare()]
            finally:
                auth.close()

        assert offered(base) == [("in_file", True), ("agent_only", True)]
        assert offered(base + "  IdentitiesOnly yes\n") == [("in_file", True)]
        assert offered(f"Host h\n  IdentityAgent none\n  IdentityFile {tmp_path / 'in_file'}\n") == [("in_file", False)]
    finally:
        agent.terminate()
        agent.wait()


def test_identity_and_certificate_files_and_the_agent_take_environment_variables(tmp_path, monkeypatch):
    """ssh_config(5) ENVIRONMENT VARIABLES: `ssh -G` prints IdentityFile and CertificateFile with
    `${VAR}` unexpanded, which ssh expands when it loads them; IdentityAgent SSH_AUTH_SOCK (the
    default) and `$VAR` name the agent by the environment, `none` names none."""
    for name in ("k", "k-cert.pub"):
        (tmp_path / name).write_text("x\n")
    monkeypatch.setenv("FC_KEYS", str(tmp_path))
    monkeypatch.setenv("SSH_AUTH_SOCK", "/run/agent.sock")
    r = resolved(case03(tmp_path, "Host h\n  IdentityFile ${FC_KEYS}/k\n  CertificateFile ${FC_KEYS}/k-cert.pub\n"), "h")
    assert (r.identity_files, r.certificate_files) == ((tmp_path / "k",), (tmp_path / "k-cert.pub",))
    assert r.identity_agent == "/run/agent.sock"
    assert resolved(case03(tmp_path, "Host h\n  IdentityAgent none\n"), "h").identity_agent is None
    monkeypatch.setenv("FC_AGENT", "/run/other.sock")
    assert resolved(case03(tmp_path, "Host h\n  IdentityAgent $FC_AGENT\n"), "h").identity_agent == "/run/other.sock"
    monkeypatch.delenv("FC_KEYS")
    with pytest.raises(SshConfigError, match=r"FC_KEYS\} has no value"):
        resolved(case03(tmp_path, "Host h\n  IdentityFile ${FC_KEYS}/k\n"), "h")


def test_debians_default_ssh_config_is_fine_for_paramiko(tmp_path):
    """Debian's /etc/ssh/ssh_config turns GSSAPIAuthentication on: ssh tries it and falls back to
    public keys, and so must paramiko's resolution not refuse it."""
    config = case03(tmp_path, "Host *\n    SendEnv LANG LC_*\n    HashKnownHosts yes\n    GSSAPIAuthentication yes\n")
    r = resolved(config, "gpu-1")
    assert r.unsupported_by_paramiko() == [] and r.hash_known_hosts is True
    refused = resolved(case03(tmp_path, "Host *\n  ForwardAgent yes\n  DynamicForward 1080\n"), "gpu-1")
    assert sorted(refused.unsupported_by_paramiko()) == ["dynamicforward 1080", "forwardagent yes"]


# ------------------------------------------------------------------ ansible_ssh_common_args (case 06)

def test_case06_bastion_in_ansible_ssh_common_args_is_what_ssh_resolves(tmp_path):
    """Case turn2/06: the inventory's ansible_ssh_common_args reach `ssh -G` first on its command
    line: -o ProxyCommand, -J (the hop resolved from the config alone, as ssh's ProxyJump does),
    and -F FILE, which wins over --ssh-config (ssh keeps the last -F; fleetctl adds none then)."""
    inv_dir = tmp_path / "inv"
    shutil.copytree(Path(__file__).resolve().parents[1] / "inventories" / "bastion", inv_dir)
    (inv_dir / "bastion.d").mkdir()
    (inv_dir / "bastion.d" / "n1").write_text("Host *\n  ProxyJump deploy@front.example.invalid:2200\n")
    config = tmp_path / "ssh_config"
    config.write_text("Host *\n  User fromconfig\n")
    r = subprocess.run([sys.executable, "-m", "fleetctl.cli", "hosts", "all", "-i", str(inv_dir / "hosts.yaml"),
                        "--ssh-config", str(config), "--json"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    hosts = {d["host"]: d for d in json.loads(r.stdout)["hosts"]}
    one = hosts["gpu-node-01"]
    assert (one["address"], one["user"], one["jump"]) == ("10.213.250.11", "ops", [])
    assert one["proxy_command"] == "ssh -W 10.213.250.11:22 -q ops@bastion.example.invalid"
    three = hosts["gpu-node-03"]
    assert (three["address"], three["user"], three["jump"]) == (
        "10.213.250.13", "fromconfig", ["ops@bastion.example.invalid:2222"])
    four = hosts["gpu-node-04"]  # its own -F: the --ssh-config's User is not read
    assert (four["address"], four["jump"]) == ("10.213.250.14", ["deploy@front.example.invalid:2200"])
    assert four["user"] != "fromconfig"


def test_fallback_refuses_ansible_ssh_args_it_cannot_evaluate(tmp_path, monkeypatch):
    no_ssh(tmp_path, monkeypatch)
    config = case03(tmp_path, "Host *\n  User u\n")
    with pytest.raises(SshConfigError, match=r"h: ansible_ssh_common_args / ansible_ssh_extra_args \(-J b\) need "
                                             r"the OpenSSH client"):
        resolved(config, "h", extra_args=("-J", "b"))
