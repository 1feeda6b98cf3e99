"""The connection seam without sshd: the command builder, the `local` connection (run, deadline,
upload, lock), the factory by ansible_connection, the run-level deadline, and known_hosts files
with marker lines (case shared/cases/turn2/01)."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import paramiko
import pytest

from fleetctl import inventory
from fleetctl.connection import LockBusy, RemoteTimeout, Session, Settings, knownhosts
from fleetctl.connection.command import remote_argv, shell_line
from fleetctl.connection.local import LocalConnection
from fleetctl.errors import InventoryError
from fleetctl.engine.fleet import Fleet
from fleetctl.vocab import HostStatus
from helpers.lab import local_host
from helpers.proc import alive

ROOT = Path(__file__).resolve().parents[2]

# The two keys of case 01 (generated for the case with ssh-keygen; not real hosts' keys).
NODE01 = "AAAAC3NzaC1lZDI1NTE5AAAAIB/R2EBNwSNgM01ZxqKmqKH3/HY4aKPrWNIZZ8vUBvYh"
CA = "AAAAC3NzaC1lZDI1NTE5AAAAIKtZZipMIFKufYYiG98eBzugs9Xw6YwLoWhGGtpp7Rrn"


# ------------------------------------------------------------------ the command builder

def test_remote_argv_wraps_with_the_deadline_and_refuses_shell_strings():
    wrapped, limit = remote_argv(["python3", "-c", "print(1)"], 2.2)
    assert (wrapped, limit) == (["timeout", "-k", "2", "3", "python3", "-c", "print(1)"], 3)
    assert remote_argv(["true"], 0.01)[1] == 1
    with pytest.raises(TypeError):
        remote_argv("rm -rf /tmp/x", 5)
    with pytest.raises(TypeError):
        remote_argv([], 5)
    # a value with shell syntax in it stays one word on the far side
    word = "a b; echo INJECTED $(id) 'q'"
    out = subprocess.run(["sh", "-c", shell_line(["printf", "%s", word])], capture_output=True, text=True)
    assert out.stdout == word


# ------------------------------------------------------------------ the local connection

def test_factory_picks_the_kind_from_ansible_connection(tmp_path):
    assert isinstance(Session(Settings()).connect(local_host(tmp_path)), LocalConnection)
    path = tmp_path / "ssh.yaml"
    path.write_text("all:\n  hosts:\n    a:\n      ansible_connection: paramiko_ssh\n    b:\n")
    hosts = {h.name: h for h in inventory.load(path).select("all")}
    assert hosts["a"].connection == "paramiko_ssh" and hosts["b"].connection == "paramiko"
    from fleetctl.connection.paramiko_ssh import ParamikoConnection
    assert isinstance(Session(Settings(ssh_config=write_empty(tmp_path))).connect(hosts["b"]), ParamikoConnection)


def test_dash_c_is_the_kind_of_hosts_whose_inventory_sets_none(tmp_path):
    from fleetctl.connection import kind_for
    path = tmp_path / "hosts.yaml"
    path.write_text("all:\n  hosts:\n    a:\n      ansible_connection: paramiko\n    b:\n")
    hosts = {h.name: h for h in inventory.load(path).select("all")}
    assert [kind_for(hosts[n], Settings(connection="ssh")) for n in "ab"] == ["paramiko", "ssh"]
    assert kind_for(hosts["b"], Settings()) == "paramiko"
    from fleetctl.connection.openssh import OpenSSHConnection
    assert isinstance(Session(Settings(connection="smart")).connect(hosts["b"]), OpenSSHConnection)


def test_every_name_of_the_kinds_table_connects_with_its_rows_class(tmp_path):
    """config.CONNECTION_KINDS is the one list of kinds: each ansible_connection name gives its
    row's class (an unopened Connection), and the inventory reads each row's vars (templated,
    checked at load)."""
    from fleetctl import config
    from fleetctl.connection import Connection
    session = Session(Settings(ssh_config=write_empty(tmp_path)))
    for name, kind in config.CONNECTIONS.items():
        conn = session.connect(inventory.Host("h", {"ansible_connection": name}, ()))
        assert isinstance(conn, Connection) and f"{type(conn).__module__}:{type(conn).__name__}" == \
            f"fleetctl.connection.{kind.cls}", name
    path = tmp_path / "hosts.yaml"
    path.write_text("all:\n  vars:\n    p: 2022\n  hosts:\n    a:\n      ansible_ssh_port: '{{ p }}'\n"
                    "    b:\n      ansible_ssh_extra_args: \"-o 'x\"\n")
    with pytest.raises(InventoryError, match=f"{path}:8: ansible_ssh_extra_args .* cannot be split"):
        inventory.load(path)
    path.write_text(path.read_text().replace("\"-o 'x\"", "-v"))
    assert inventory.load(path).select("a")[0].port == 2022


def write_empty(tmp_path: Path) -> Path:
    p = tmp_path / "empty_ssh_config"
    p.write_text("")
    return p


def test_unknown_ansible_connection_is_an_inventory_error_with_file_and_line(tmp_path):
    path = tmp_path / "hosts.yaml"
    path.write_text("all:\n  hosts:\n    a:\n    b:\n      ansible_connection: winrm\n")
    with pytest.raises(InventoryError) as e:
        inventory.load(path)
    assert str(e.value).startswith(f"{path}:5: ansible_connection 'winrm'")
    assert e.value.exit_code == 4


def test_local_run_passes_argv_and_stdin_and_returns_status(tmp_path):
    conn = Session(Settings()).connect(local_host(tmp_path))
    conn.open()
    r = conn.run([sys.executable, "-c", "import sys; d = sys.stdin.read(); print(d[::-1]); sys.exit(3)"],
                 timeout=10, stdin=b"abc")
    assert (r.exit_code, r.stdout, r.ok) == (3, b"cba\n", False)
    assert conn.address == "localhost"


def test_local_run_past_its_deadline_kills_the_whole_process_group(tmp_path):
    conn = Session(Settings()).connect(local_host(tmp_path))
    pidfile = tmp_path / "grandchild.pid"
    t0 = time.monotonic()
    with pytest.raises(RemoteTimeout):
        conn.run(["sh", "-c", f'sleep 60 & echo $! > {pidfile}; wait'], timeout=1)
    assert time.monotonic() - t0 < 1 + 2 + 3 + 2
    pid = int(pidfile.read_text())
    deadline = time.monotonic() + 10
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(pid)


def test_put_bytes_is_atomic_with_mode_and_creates_parents(tmp_path):
    conn = Session(Settings()).connect(local_host(tmp_path))
    dest = tmp_path / "a" / "b" / "file.bin"
    data = os.urandom(300_000)
    conn.put_bytes(data, str(dest), timeout=10, mode=0o640)
    assert dest.read_bytes() == data and (dest.stat().st_mode & 0o777) == 0o640
    conn.put_bytes(b"second", str(dest), timeout=10)
    assert dest.read_bytes() == b"second" and (dest.stat().st_mode & 0o777) == 0o644
    assert sorted(p.name for p in dest.parent.iterdir()) == ["file.bin"]  # no temp file left
    with pytest.raises(OSError, match="upload to"):
        conn.put_bytes(b"x", "/proc/fleetctl-cannot-write-here/x", timeout=10)


def test_lock_is_exclusive_names_its_holder_and_is_freed_on_release(tmp_path):
    host = local_host(tmp_path)
    a, b = Session(Settings()).connect(host), Session(Settings()).connect(host)
    state = str(tmp_path / "state")
    lock = a.hold_lock(state, timeout=5, hold_s=60)
    try:
        with pytest.raises(LockBusy, match=f"pid {os.getpid()}"):
            b.hold_lock(state, timeout=5, hold_s=60)
    finally:
        lock.release()
    b.hold_lock(state, timeout=5, hold_s=60).release()


def test_lock_ends_by_itself_after_its_hold_time(tmp_path):
    host = local_host(tmp_path)
    state = str(tmp_path / "state")
    Session(Settings()).connect(host).hold_lock(state, timeout=5, hold_s=1)  # never released by this side
    time.sleep(1.5)
    Session(Settings()).connect(host).hold_lock(state, timeout=5, hold_s=5).release()


def test_run_deadline_fails_hosts_in_progress_and_does_not_start_the_rest(tmp_path):
    hosts = [local_host(tmp_path, f"h{i}") for i in range(3)]

    def job(ctx):
        ctx.run(["sleep", "30"])
        return ctx.result(HostStatus.OK, data={})

    t0 = time.monotonic()
    with Fleet(Settings(), forks=1, timeout=60, run_timeout=1.5) as fleet:
        results = fleet.run(hosts, job)
        took = time.monotonic() - t0
        later = fleet.run(hosts[:1], job)
    assert took < 5
    assert [r.status for r in results] == [HostStatus.FAILED, HostStatus.NOT_ATTEMPTED, HostStatus.NOT_ATTEMPTED]
    assert "--run-timeout 1.5 s" in results[0].error and "in progress" in results[0].error
    assert later[0].status == HostStatus.NOT_ATTEMPTED


def test_close_during_a_connect_never_keeps_nor_races_the_new_connection(tmp_path):
    """Review L8, the second Ctrl-C: Fleet.close() while a worker is still opening a connection
    neither fails (no dict changing size under it) nor leaves the worker a connection to go on
    with: the connection that finishes opening after close() is closed and the job stops."""
    import threading
    opening, release, made = threading.Event(), threading.Event(), []

    class SlowOpen(LocalConnection):
        def open(self):
            opening.set()
            release.wait(30)
            super().open()

        def close(self):
            made.append("closed")
            super().close()

    def slow(host):
        made.append("made")
        return SlowOpen(host, fleet.session)

    fleet = Fleet(Settings(), forks=1, timeout=60, connect=slow)
    box = {}
    worker = threading.Thread(target=lambda: box.update(r=fleet.run([local_host(tmp_path)],
                                                                    lambda ctx: ctx.result(HostStatus.OK, data={"ran": True}))[0]))
    worker.start()
    assert opening.wait(30)
    fleet.close()  # the second Ctrl-C's cleanup, while the worker is inside connect
    release.set()
    worker.join(60)
    r = box["r"]
    assert made == ["made", "closed"] and r.data.get("ran") is None
    assert r.status == "unreachable" and "the run is stopping" in r.error, (r.status, r.error)


def test_run_without_deadline_finishes_normally(tmp_path):
    with Fleet(Settings(), run_timeout=30) as fleet:
        r = fleet.run([local_host(tmp_path)], lambda ctx: ctx.result(HostStatus.OK, data={"out": ctx.run(["echo", "hi"]).stdout.decode()}))[0]
    assert r.status == HostStatus.OK and r.data == {"out": "hi\n"}


def test_a_local_run_needs_neither_paramiko_nor_fabric(tmp_path):
    """The GPU check runs fleetctl on the GPU host through the local connection, where neither
    is installed: `inspect` of a local host must work with both imports refused."""
    path = tmp_path / "hosts.yaml"
    path.write_text(f"all:\n  hosts:\n    gpu-host:\n      ansible_connection: local\n"
                    f"      fleetctl_python: {sys.executable}\n")
    code = ("import sys; sys.modules['paramiko'] = None; sys.modules['fabric'] = None; "
            "from fleetctl.cli import main; sys.argv = ['fleetctl', 'inspect', 'all', '-i', sys.argv[1], '--json']; "
            "main()")
    r = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=str(ROOT / "agent")))
    doc = json.loads(r.stdout)
    host = doc["hosts"][0]
    assert host["status"] == "ok", (host["error"], r.stderr[-2000:])
    assert host["address"] == "localhost" and host["facts"]["python"]["path"] == sys.executable
    assert r.returncode == 0


# ------------------------------------------------------------------ known_hosts (case 01)

def test_case01_cert_authority_line_does_not_stop_the_file(tmp_path):
    f = tmp_path / "known_hosts"
    f.write_text(f"gpu-node-01.example.invalid ssh-ed25519 {NODE01}\n"
                 f"@cert-authority *.example.invalid ssh-ed25519 {CA}\n")
    kh = knownhosts.lookup("gpu-node-01.example.invalid", [f])
    assert kh.warnings == []
    node01 = kh.keys.lookup("gpu-node-01.example.invalid")
    assert node01 is not None and node01["ssh-ed25519"].get_base64() == NODE01
    kh2 = knownhosts.lookup("gpu-node-02.example.invalid", [f])
    assert kh2.keys.lookup("gpu-node-02.example.invalid") is None
    ca = kh2.authority("gpu-node-02.example.invalid")
    assert ca is not None and ca.where == f"{f}:2" and ca.blob == base64.b64decode(CA)
    assert knownhosts.lookup("gpu-node-02.other.invalid", [f]).authority("gpu-node-02.other.invalid") is None


def test_case01_variant_b_revoked_key_is_refused_even_where_a_plain_line_lists_it(tmp_path):
    f = tmp_path / "known_hosts"
    f.write_text(f"gpu-node-01.example.invalid ssh-ed25519 {NODE01}\n"
                 f"@revoked * ssh-ed25519 {NODE01}\n")
    kh = knownhosts.lookup("gpu-node-01.example.invalid", [f])
    assert kh.warnings == []
    assert kh.keys.lookup("gpu-node-01.example.invalid") is None  # never accepted as known
    key = paramiko.Ed25519Key(data=base64.b64decode(NODE01))
    assert kh.revocation(key).where == f"{f}:2"


def test_unreadable_lines_are_warnings_with_file_and_line_and_the_rest_loads(tmp_path):
    f = tmp_path / "known_hosts"
    f.write_text("# a comment\n\n"
                 "broken.example.invalid ssh-ed25519 !!!notbase64!!!\n"
                 "@frobnicate * ssh-ed25519 " + CA + "\n"
                 "fido.example.invalid sk-ssh-ed25519@openssh.com " + CA + "\n"
                 "[gpu-node-01.example.invalid]:2222,alias.example.invalid ssh-ed25519 " + NODE01)
    warnings = []
    for name in ("broken.example.invalid", "fido.example.invalid"):
        kh = knownhosts.lookup(name, [f])
        warnings += kh.warnings
        assert kh.keys.lookup(name) is None
    assert [w.split(":", 2)[1] for w in warnings] == ["3", "5"]
    assert all(w.startswith(f"{f}:") for w in warnings)
    kh = knownhosts.lookup("[gpu-node-01.example.invalid]:2222", [f])
    assert kh.keys.lookup("[gpu-node-01.example.invalid]:2222")["ssh-ed25519"].get_base64() == NODE01
    assert knownhosts.lookup("alias.example.invalid", [f]).keys.lookup("alias.example.invalid") is not None


def test_host_patterns_match_as_openssh(tmp_path):
    m = knownhosts.host_patterns_match
    assert m("*.example.invalid", "GPU-1.Example.Invalid")
    assert m("gpu-?.example.invalid,!gpu-9.example.invalid", "gpu-1.example.invalid")
    assert not m("gpu-?.example.invalid,!gpu-9.example.invalid", "gpu-9.example.invalid")
    assert m("[gpu-1.example.invalid]:2222", "[gpu-1.example.invalid]:2222")
    assert not m("gpu-1.example.invalid", "[gpu-1.example.invalid]:2222")


def test_accept_new_appends_on_a_line_of_its_own(tmp_path):
    f = tmp_path / "ssh" / "known_hosts"
    f.parent.mkdir()
    f.write_text(f"a.example.invalid ssh-ed25519 {NODE01}")  # no newline at the end
    key = paramiko.Ed25519Key(data=base64.b64decode(CA))
    knownhosts.append(f, "b.example.invalid", key)
    lines = f.read_text().splitlines()
    assert lines == [f"a.example.invalid ssh-ed25519 {NODE01}", f"b.example.invalid ssh-ed25519 {CA}"]
    fresh = tmp_path / "new" / "known_hosts"
    knownhosts.append(fresh, "c.example.invalid", key)
    assert (fresh.stat().st_mode & 0o777) == 0o600 and (fresh.parent.stat().st_mode & 0o777) == 0o700
    assert hashlib.sha256(fresh.read_bytes()).hexdigest() == hashlib.sha256(
        f"c.example.invalid ssh-ed25519 {CA}\n".encode()).hexdigest()


@pytest.mark.parametrize("matcher", ["ssh-keygen", "fallback"])
def test_lookup_matches_patterns_negation_hashed_names_and_markers_as_openssh(tmp_path, monkeypatch, matcher):
    if matcher == "fallback":
        (tmp_path / "bin").mkdir()
        monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    f = tmp_path / "known_hosts"
    hashed = paramiko.HostKeys.hash_host("node-7.example.invalid")
    f.write_text(f"gpu-?.example.invalid,!gpu-9.example.invalid ssh-ed25519 {NODE01}\n"
                 f"{hashed} ssh-ed25519 {CA}\n"
                 f"@revoked gpu-3.example.invalid ssh-ed25519 {NODE01}\n")
    one = knownhosts.lookup("gpu-1.example.invalid", [f]).keys.lookup("gpu-1.example.invalid")
    assert [k.get_base64() for k in one.values()] == [NODE01]
    assert knownhosts.lookup("gpu-9.example.invalid", [f]).keys.lookup("gpu-9.example.invalid") is None
    seven = knownhosts.lookup("node-7.example.invalid", [f]).keys.lookup("node-7.example.invalid")
    assert [k.get_base64() for k in seven.values()] == [CA]
    three = knownhosts.lookup("gpu-3.example.invalid", [f])
    assert three.keys.lookup("gpu-3.example.invalid") is None and three.revoked[0].where == f"{f}:3"
    assert knownhosts.lookup("gpu-1.example.invalid", [f]).revoked == []


def test_accept_new_hashes_the_name_with_hash_known_hosts(tmp_path):
    f = tmp_path / "known_hosts"
    knownhosts.append(f, "[gpu-1.example.invalid]:2222", paramiko.Ed25519Key(data=base64.b64decode(CA)), hashed=True)
    text = f.read_text()
    assert text.startswith("|1|") and "gpu-1" not in text
    found = knownhosts.lookup("[gpu-1.example.invalid]:2222", [f]).keys.lookup("[gpu-1.example.invalid]:2222")
    assert found["ssh-ed25519"].get_base64() == CA


@pytest.mark.parametrize("option", ["ForwardAgent yes", "LocalForward 8080 localhost:80", "RemoteCommand uptime"])
def test_paramiko_refuses_an_option_it_cannot_honour_naming_the_host(tmp_path, option):
    """Exit 4 before anything is dialled (the address is .invalid: resolving it would fail
    differently)."""
    config = tmp_path / "ssh_config"
    config.write_text(f"Host gpu-*\n  HostName %h.example.invalid\n  {option}\n")
    path = tmp_path / "hosts.yaml"
    path.write_text("all:\n  hosts:\n    gpu-1:\n")
    host = inventory.load(path).select("all")[0]
    with Fleet(Settings(ssh_config=config, connect_timeout=20)) as fleet:
        r = fleet.run([host], lambda ctx: ctx.result(HostStatus.OK))[0]
    assert r.parse_error is True and r.status == HostStatus.FAILED
    key = option.split()[0].lower()
    assert r.error.startswith(f"gpu-1: the paramiko connection cannot honour {key} ")


def test_paramiko_is_imported_without_invoke_which_stays_importable(tmp_path):
    """paramiko.config imports invoke when it is installed (Fabric brings it), only for `Match exec`,
    which fleetctl never uses (ssh -G resolves ssh_config): fleetctl's import of paramiko skips it
    (connection/_paramiko.py), and invoke can still be imported afterwards. A stand-in `invoke`
    package on the path says when it was imported."""
    (tmp_path / "invoke").mkdir()
    (tmp_path / "invoke" / "__init__.py").write_text("IMPORTED = True\n")
    code = ("import sys\n"
            "import fleetctl.connection.paramiko_ssh, fleetctl.connection.knownhosts\n"
            "import paramiko.config\n"
            "assert 'invoke' not in sys.modules and paramiko.config.invoke is None, sys.modules.get('invoke')\n"
            "import invoke\n"
            "assert invoke.IMPORTED\n"
            "print('ok')\n")
    agent = Path(__file__).resolve().parents[2] / "agent"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=f"{agent}:{tmp_path}"))
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
    # without fleetctl's guard, paramiko imports the stand-in: the check above can fail
    r = subprocess.run([sys.executable, "-c", "import sys, paramiko; print('invoke' in sys.modules)"],
                       capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(tmp_path)))
    assert r.stdout.strip() == "True", r.stderr


@pytest.mark.parametrize("python", [sys.executable, None], ids=["python-lock", "shell-lock"])
def test_a_container_connection_is_a_prefix_on_the_host_connection(tmp_path, python):
    """The container connection runs every command after its entry (here `env IN=yes`, where a
    real one is `podman exec ID` or `nsenter -t PID -a`), under the host connection's deadline
    wrapper; its lock (python_lock_argv with the container's interpreter, else the shell's
    flock) is the same lock as the host's; a reconnected context enters again over the new
    host connection; a container checks no interpreter with the trust probe."""
    from fleetctl.connection.container import ContainerConnection
    from fleetctl.engine.context import HostContext

    host = local_host(tmp_path)
    session = Session(Settings())
    outer = session.connect(host)
    outer.open()
    inner = ContainerConnection(outer, ["env", "IN=yes"], python)
    assert inner.run(["sh", "-c", "echo ${IN:-no}"], 10).stdout == b"yes\n"
    assert outer.run(["sh", "-c", "echo ${IN:-no}"], 10).stdout == b"no\n"
    with pytest.raises(RemoteTimeout):
        inner.run(["sleep", "30"], 1)
    state = str(tmp_path / "state")
    lock = inner.hold_lock(state, timeout=5, hold_s=30)
    try:
        with pytest.raises(LockBusy, match="another fleetctl run"):
            outer.hold_lock(state, timeout=5, hold_s=30)
    finally:
        lock.release()
    outer.hold_lock(state, timeout=5, hold_s=5).release()
    assert (inner.python, inner.checks_interpreters, outer.checks_interpreters) == (python, False, True)
    fresh = session.connect(host)
    ctx = HostContext(host, outer, time.monotonic() + 60, lambda: fresh).inside(inner, {"how": "env"})
    again = ctx.reconnected()
    assert again.conn is fresh and again.target.outer is fresh and again.target.prefix == ("env", "IN=yes")
    assert ctx.target is inner and HostContext(host, outer, 0).target is outer
