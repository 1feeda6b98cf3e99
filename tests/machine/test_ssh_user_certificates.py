"""Case turn4/06 (issue 52): who may log in, as OpenSSH decides it, through a real sshd that
trusts a user CA (`TrustedUserCAKeys`; its authorized_keys lists one plain key) with
`MaxAuthTries 3`, and a real ssh-agent per layout. For each layout of certificates, agent keys
and ssh_config, the real `ssh -o BatchMode=yes` and fleetctl's paramiko and ssh connection kinds
must agree on whether `true` runs; a refusal from the paramiko kind names the likely fix.

sshd is started by the test on 127.0.0.1 (a free port), as root; each layout's keys, certificates
and ssh_config live in its own directory, and its ssh-agent is stopped after it."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from fleetctl import inventory
from fleetctl.connection import Session, Settings, Unreachable

SSHD = "/usr/sbin/sshd"
WRONG_KEYS = 7  # agent keys sshd does not know: more than MaxAuthTries


def _run(*argv: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, check=True, capture_output=True, text=True, **kw)


def _keygen(path: Path, kind: str = "ed25519") -> Path:
    _run("ssh-keygen", "-q", "-t", kind, *(["-b", "2048"] if kind == "rsa" else []), "-N", "", "-C", path.name,
         "-f", str(path))
    return path


def _sign(ca: Path, key: Path, principal: str = "root") -> Path:
    _run("ssh-keygen", "-q", "-s", str(ca), "-I", f"{key.name}-id", "-n", principal, "-V", "-5m:+30m", f"{key}.pub")
    return Path(f"{key}-cert.pub")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """The test's sshd and what every layout shares: the user CA, another CA, the one key its
    authorized_keys lists (`right`), WRONG_KEYS keys it does not know."""

    def __init__(self, top: Path):
        self.top, self.port = top, _free_port()
        self.ca, self.other_ca = _keygen(top / "user_ca"), _keygen(top / "other_ca")
        self.right = _keygen(top / "right")
        self.wrong = [_keygen(top / f"wrong{i}") for i in range(WRONG_KEYS)]
        host_key = _keygen(top / "host_ed25519")
        (top / "authorized_keys").write_text(Path(f"{self.right}.pub").read_text())
        self.known_hosts = top / "known_hosts"
        self.known_hosts.write_text(f"[127.0.0.1]:{self.port} " + " ".join(
            Path(f"{host_key}.pub").read_text().split()[:2]) + "\n")
        cfg = top / "sshd_config"
        cfg.write_text(
            f"ListenAddress 127.0.0.1:{self.port}\nHostKey {host_key}\nPidFile {top / 'sshd.pid'}\n"
            f"AuthorizedKeysFile {top / 'authorized_keys'}\nTrustedUserCAKeys {self.ca}.pub\n"
            "PermitRootLogin prohibit-password\nPubkeyAuthentication yes\nPasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\nUseDNS no\nMaxAuthTries 3\n"
            "LogLevel VERBOSE\n")
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation directory
        self.log = top / "sshd.log"
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(cfg)], stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                assert self.proc.poll() is None and time.monotonic() < deadline, self.log.read_text()
                time.sleep(0.05)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    assert os.geteuid() == 0, "tests/machine runs as root (sshd, and logging in as root)"
    s = Server(tmp_path_factory.mktemp("sshd"))
    yield s
    s.stop()


class Agent:
    """A real ssh-agent on a socket of `d`; `add(key)` is `ssh-add key` (its certificate too, if
    one lies beside it)."""

    def __init__(self, d: Path):
        self.sock = d / "agent.sock"
        self.proc = subprocess.Popen(["ssh-agent", "-D", "-a", str(self.sock)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while not self.sock.exists():
            assert time.monotonic() < deadline, "ssh-agent did not start"
            time.sleep(0.02)

    def add(self, *keys: Path) -> None:
        for key in keys:
            _run("ssh-add", "-q", str(key), env=dict(os.environ, SSH_AUTH_SOCK=str(self.sock)))

    def listed(self) -> str:
        return subprocess.run(["ssh-add", "-l"], capture_output=True, text=True,
                              env=dict(os.environ, SSH_AUTH_SOCK=str(self.sock))).stdout

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


def _layout(name: str, s: Server, d: Path, agent: Agent) -> tuple[list[str], bool]:
    """Build layout `name` in `d`: -> (its ssh_config lines for the host, whether the agent is
    reached through SSH_AUTH_SOCK rather than IdentityAgent)."""
    at = [f"IdentityAgent {agent.sock}"]
    if name == "rsa_cert_and_key_in_agent":  # case 06 A: ssh-add puts key and certificate in the agent
        key = _keygen(d / "oncall", "rsa")
        _sign(s.ca, key)
        agent.add(key)
        assert "RSA-CERT" in agent.listed()
        return [f"IdentityFile {key}", *at], False
    if name == "ecdsa_cert_renewed_on_disk":  # case 06 B: the agent holds only the plain key
        key = _keygen(d / "oncall", "ecdsa")
        agent.add(key)
        _sign(s.ca, key)
        return [f"IdentityFile {key}", *at], False
    if name == "rsa_cert_only_in_agent":  # the key files gone (a step/Vault login): the agent has it all
        key = _keygen(d / "oncall", "rsa")
        _sign(s.ca, key)
        agent.add(key)
        for p in (key, Path(f"{key}.pub"), Path(f"{key}-cert.pub")):
            p.unlink()
        return [f"IdentityFile {s.wrong[0]}", *at], False
    if name == "certificate_file_no_agent":  # case 06 D with CertificateFile: file key and certificate only
        key = _keygen(d / "oncall")
        cert = _sign(s.ca, key).rename(d / "issued.cert")
        return [f"IdentityFile {key}", f"CertificateFile {cert}", "IdentityAgent none"], False
    if name == "right_key_behind_seven_agent_keys":  # the config's key first, though the agent lists it last
        agent.add(*s.wrong, s.right)
        return [f"IdentityFile {s.right}"], True
    if name == "identities_only_public_file":  # IdentityFile names the .pub; the private key is in the agent
        agent.add(*s.wrong, s.right)
        pub = shutil.copy(f"{s.right}.pub", d / "right.pub")
        return [f"IdentityFile {pub}", "IdentitiesOnly yes", *at], False
    if name == "principal_not_listed":
        key = _keygen(d / "oncall")
        _sign(s.ca, key, principal="bob")
        return [f"IdentityFile {key}", "IdentityAgent none"], False
    if name == "ca_not_trusted":
        key = _keygen(d / "oncall")
        _sign(s.other_ca, key)
        return [f"IdentityFile {key}", "IdentityAgent none"], False
    if name == "seven_agent_keys_before_the_file":  # ssh too gives up: "Too many authentication failures"
        agent.add(*s.wrong)
        return [f"IdentityFile {s.right}", *at], False
    raise AssertionError(name)


# layout -> (ssh logs in, what the refusal of fleetctl's paramiko kind says, what its ssh kind's says)
LAYOUTS = {
    "rsa_cert_and_key_in_agent": (True, None, None),
    "ecdsa_cert_renewed_on_disk": (True, None, None),
    "rsa_cert_only_in_agent": (True, None, None),
    "certificate_file_no_agent": (True, None, None),
    "right_key_behind_seven_agent_keys": (True, None, None),
    "identities_only_public_file": (True, None, None),
    "principal_not_listed": (False, "lists the principals bob, not 'root'", "lists the principals bob, not 'root'"),
    "ca_not_trusted": (False, "TrustedUserCAKeys", "TrustedUserCAKeys"),
    "seven_agent_keys_before_the_file": (False, "MaxAuthTries", "Too many authentication failures"),
}


def _fleetctl(cfg: Path, kind: str) -> str | None:
    """None when fleetctl's `kind` connection logs in and runs `true`, else its error."""
    host = inventory.Host("infer-b7", {"ansible_connection": kind}, ())
    with Session(Settings(ssh_config=cfg, connect_timeout=10)) as session:
        conn = session.connect(host)
        try:
            conn.open()
            assert conn.run(["true"], timeout=10).ok
            return None
        except Unreachable as e:
            return str(e)
        finally:
            conn.close()


@pytest.mark.parametrize("name", LAYOUTS)
def test_ssh_and_fleetctl_agree_on_who_logs_in(server, tmp_path, monkeypatch, name):
    logs_in, paramiko_says, ssh_kind_says = LAYOUTS[name]
    agent = Agent(tmp_path)
    try:
        lines, via_env = _layout(name, server, tmp_path, agent)
        if via_env:
            monkeypatch.setenv("SSH_AUTH_SOCK", str(agent.sock))
        else:
            monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
        cfg = tmp_path / "ssh_config"
        cfg.write_text("Host infer-b7\n  HostName 127.0.0.1\n" + f"  Port {server.port}\n  User root\n"
                       + "".join(f"  {line}\n" for line in lines)
                       + f"  UserKnownHostsFile {server.known_hosts}\n  GlobalKnownHostsFile none\n")
        ssh = subprocess.run(["ssh", "-F", str(cfg), "-o", "BatchMode=yes", "infer-b7", "true"],
                             stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=30)
        assert (ssh.returncode == 0) == logs_in, ssh.stderr
        paramiko_error = _fleetctl(cfg, "paramiko")
        assert (paramiko_error is None) == logs_in, paramiko_error
        assert paramiko_says is None or paramiko_says in paramiko_error
        ssh_kind_error = _fleetctl(cfg, "ssh")
        assert (ssh_kind_error is None) == logs_in, ssh_kind_error
        assert ssh_kind_says is None or ssh_kind_says in ssh_kind_error
    finally:
        agent.stop()
