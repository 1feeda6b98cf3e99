"""The lab itself, checked through real sshd with the OpenSSH client."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import yaml

from conftest import TEST_LAB_ID, running_lab
from fleetctl import lab as labmod
from fleetctl.lab import pidns
from fleetctl.lab.base import alive


RELEASES = dict(zip(["lab-01", "lab-02", "lab-03", "lab-04"], labmod.DEFAULT_RELEASES))


TIMED_OUT = "timed out"  # nothing arrived, and the connection stayed open


def banner(address: str, timeout: float) -> bytes | str:
    """Connect to address:22 (must succeed) and return what arrives within `timeout` s: the
    bytes (b"" when the server closed the connection), or TIMED_OUT when nothing came."""
    with socket.create_connection((address, 22), timeout=3) as s:
        s.settimeout(timeout)
        try:
            return s.recv(256)
        except socket.timeout:
            return TIMED_OUT


def test_inventory_and_known_hosts(lab):
    doc = yaml.safe_load(lab.inventory.read_text())
    group = doc["all"]["children"]["lab"]
    assert list(group["hosts"]) == lab.hosts == list(RELEASES)
    for name, v in group["hosts"].items():
        assert v["ansible_user"] == "root" and "ansible_python_interpreter" not in v
        assert v["ansible_ssh_private_key_file"] == str(lab.state_dir / "client_ed25519")
    for name, release in RELEASES.items():
        assert list(group["children"]["sglang_" + release.replace(".", "_")]["hosts"]) == [name]
    known = lab.known_hosts.read_text().split()
    assert all(lab.address(h) in known for h in lab.hosts)


def test_each_host_has_its_own_hostname_and_release(lab):
    code = ("import sys, importlib.metadata as m; "
            "print(sys.prefix, m.version('sglang'), m.version('torch'))")
    for name in lab.hosts:
        r = lab.ssh(name, f'hostname; /opt/sglang/venv/bin/python -c "{code}"')
        assert r.returncode == 0, r.stderr
        hostname, prefix, sglang, torch = r.stdout.split()
        assert (hostname, prefix, sglang) == (name, "/opt/sglang/venv", RELEASES[name])
        assert torch.startswith("2.13.0")  # the system torch, through --system-site-packages


def test_private_dirs_are_private(lab):
    token = uuid.uuid4().hex
    a, b = lab.hosts[0], lab.hosts[1]
    paths = [f"/tmp/{token}", f"/var/lib/fleetctl/{token}", f"/opt/sglang/{token}"]
    try:
        assert lab.ssh(a, " && ".join(f"echo {token} > {p}" for p in paths)).returncode == 0
        assert lab.ssh(a, f"cat {' '.join(paths)}").stdout.split() == [token] * 3
        r = lab.ssh(b, f"ls {' '.join(paths)}")
        assert r.returncode != 0 and r.stdout == ""
        assert not any(os.path.exists(p) for p in paths)  # nor on this machine
    finally:
        lab.ssh(a, f"rm -f {' '.join(paths)}")


def test_lab_ssh_config_reaches_hosts_by_name_and_its_include_line_comes_and_goes(lab, tmp_path):
    """`lab up` writes <state dir>/ssh_config; `fleetctl lab up` Includes it from ~/.ssh/config
    (here a stand-in file: the test must not edit the real one) before the first Host line, and
    `lab down` removes exactly that line."""
    lab_config = labmod.lab_ssh_config_path(lab.lab_id, lab.state_dir)
    r = subprocess.run(["ssh", "-F", str(lab_config), "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes",
                        "lab-02", "hostname"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and r.stdout.strip() == "lab-02", r.stderr
    user = tmp_path / "ssh" / "config"
    labmod.add_ssh_config_include(user, lab.lab_id, lab.state_dir)
    assert (user.stat().st_mode & 0o777) == 0o600 and (user.parent.stat().st_mode & 0o777) == 0o700
    assert user.read_text() == f"Include {lab_config} # fleetctl lab {lab.lab_id}\n"
    mine = "ServerAliveInterval 5\nHost other\n  User someone\nMatch all\n  Port 2222"  # no newline at the end
    user.write_text(mine)
    labmod.add_ssh_config_include(user, lab.lab_id, lab.state_dir)
    labmod.add_ssh_config_include(user, lab.lab_id, lab.state_dir)
    lines = user.read_text().splitlines()
    assert lines[:2] == ["ServerAliveInterval 5", f"Include {lab_config} # fleetctl lab {lab.lab_id}"]
    assert len(lines) == 6
    g = subprocess.run(["ssh", "-G", "-F", str(user), "lab-03"], capture_output=True, text=True, timeout=30)
    assert f"hostname {lab.address('lab-03')}" in g.stdout.splitlines() and "port 2222" in g.stdout.splitlines()
    labmod.remove_ssh_config_include(user, lab.lab_id, lab.state_dir)
    assert user.read_text() == mine + "\n"


def test_freeze_accepts_tcp_but_sends_no_banner(lab):
    h = lab.hosts[0]
    lab.fault(h, "freeze")
    try:
        assert banner(lab.address(h), 2.0) == TIMED_OUT  # accepted and held open, not closed (b"")
    finally:
        lab.fault(h, "thaw")
    assert banner(lab.address(h), 5.0).startswith(b"SSH-2.0-")


def test_a_thawed_sshd_is_reaped_when_killed(lab):
    """After freeze and thaw, the nsenter that waits on sshd runs again (it stopped itself with
    its child), so an sshd killed later is reaped, not left a zombie on the host's pid list."""
    h = lab.hosts[2]
    lab.fault(h, "freeze")
    lab.fault(h, "thaw")
    old = _state(lab)[h]["sshd_pid"]
    lab.fault(h, "sshd-kill")
    deadline = time.monotonic() + 5
    while Path(f"/proc/{old}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{old}").exists()
    assert old not in lab.pids(h)


def test_link_down_makes_host_unreachable(lab):
    h = lab.hosts[1]
    lab.fault(h, "down")
    try:
        with pytest.raises(OSError):
            socket.create_connection((lab.address(h), 22), timeout=2).close()
        assert labmod.lab_status(lab.lab_id, lab.state_dir)[1]["link_up"] is False
    finally:
        lab.fault(h, "up")
    assert banner(lab.address(h), 5.0).startswith(b"SSH-2.0-")


def _round_trip(address: str) -> float:
    """Seconds from sending our SSH version string to sshd's answer (its KEXINIT)."""
    with socket.create_connection((address, 22), timeout=5) as s:
        s.settimeout(5)
        got = b""
        while b"\r\n" not in got:
            got += s.recv(256)
        t = time.monotonic()
        s.sendall(b"SSH-2.0-fleetctl_labtest\r\n")
        assert s.recv(4096)
        return time.monotonic() - t


def test_delay_adds_latency_each_way(lab):
    h = lab.hosts[2]
    assert _round_trip(lab.address(h)) < 0.1
    lab.fault(h, "delay", 100)
    try:
        assert _round_trip(lab.address(h)) >= 0.2
        t = time.monotonic()
        assert lab.ssh(h, "true").returncode == 0  # sessions still work, only slower
        assert time.monotonic() - t >= 0.8  # >= 4 round trips of 200 ms
    finally:
        lab.fault(h, "delay", 0)
    assert _round_trip(lab.address(h)) < 0.1


def test_rekey_is_refused_by_strict_checking(lab):
    h = lab.hosts[3]
    lab.fault(h, "rekey")
    try:
        r = lab.ssh(h, "echo ran")
        assert r.returncode == 255 and "ran" not in r.stdout
        assert "HOST IDENTIFICATION HAS CHANGED" in r.stderr
    finally:
        lab.fault(h, "unrekey")
    assert lab.ssh(h, "echo ran").stdout == "ran\n"


def test_sshd_kill_cuts_an_open_session_mid_write_and_sshd_comes_back(lab, tmp_path):
    """`sshd-kill`: a session writing without end is cut (its ssh client ends with 255, a lost
    connection, not by its command's own exit), the host's sshd is a new process, and a new
    session works at once."""
    h = lab.hosts[0]
    before = labmod.lab_status(lab.lab_id, lab.state_dir)[0]["sshd_pid"]
    out = tmp_path / "out"
    with open(out, "wb") as f:
        p = subprocess.Popen(["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes",
                              "-o", f"UserKnownHostsFile={lab.known_hosts}", "-i", str(lab.state_dir / "client_ed25519"),
                              f"root@{lab.address(h)}", "yes soak"], stdout=f, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while out.stat().st_size == 0 and time.monotonic() < deadline:  # the session is writing
            time.sleep(0.05)
        assert out.stat().st_size > 0
        lab.fault(h, "sshd-kill")
        assert p.wait(timeout=10) == 255  # ssh's own status for a lost connection
    finally:
        p.kill()
        p.wait()
    after = labmod.lab_status(lab.lab_id, lab.state_dir)[0]
    assert after["sshd_pid"] != before and after["sshd_alive"]
    assert lab.ssh(h, "echo ran").stdout == "ran\n"


def _cmdline(pid: int) -> bytes:
    """/proc/PID/cmdline, or b"" for a process that exited since it was listed."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def test_hang_replaces_the_interpreter(lab):
    h = lab.hosts[0]
    lab.fault(h, "hang")
    try:
        with pytest.raises(Exception, match="timed out"):
            lab.ssh(h, "/opt/sglang/venv/bin/python -c 'print(1)'", timeout=3)
        left = lab.pids(h)  # the client gave up; the hanging interpreter runs on
        assert any(b"sleep" in _cmdline(p) for p in left)
        for p in left:  # only this host's processes (lab.pids), never by name
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        while set(lab.pids(h)) & set(left) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not set(lab.pids(h)) & set(left), "killed processes still on the host"
    finally:
        lab.fault(h, "unhang")
    assert lab.ssh(h, "/opt/sglang/venv/bin/python -c 'print(1)'").stdout == "1\n"


def _state(lab) -> dict:
    """lab.json: per host init_pid, sshd_pid, proxy_pid (and server_pid), root PID namespace view."""
    return {h["name"]: h for h in json.loads((lab.state_dir / "lab.json").read_text())["hosts"]}


def _pidns(pid: int) -> tuple[int, int]:
    st = os.stat(f"/proc/{pid}/ns/pid")
    return st.st_dev, st.st_ino


def test_each_host_has_its_own_pid_namespace(lab):
    state = _state(lab)
    a, b = lab.hosts[0], lab.hosts[1]
    r = lab.ssh(a, "cat /proc/1/comm; tr '\\0' ' ' < /proc/1/cmdline; echo; "
                   "stat -L -c '%d %i' /proc/[0-9]*/ns/pid 2>/dev/null | sort -u; "
                   "ps -e -o args=")
    assert r.returncode == 0, r.stderr
    comm, cmdline, *rest = r.stdout.splitlines()
    assert comm == "fleetctl-init" and "lab-init.py" in cmdline and a in cmdline
    namespaces = {tuple(map(int, line.split())) for line in rest if line[:1].isdigit()}
    # everything A sees is in A's own PID namespace: not this machine's, not B's
    assert namespaces == {_pidns(state[a]["init_pid"])}
    assert _pidns(state[a]["init_pid"]) not in (_pidns(os.getpid()), _pidns(state[b]["init_pid"]))
    seen = "\n".join(rest)
    assert f"hosts/{a}/sshd_config" in seen
    assert not any(f"hosts/{h}/" in seen for h in lab.hosts if h != a)  # no other host's sshd
    assert "delayproxy" not in seen  # the lab's network, not the host's process
    # lab.json has root-view pids: sshd is pid >1 inside A, the init is A's PID 1
    assert pidns.nspids(state[a]["init_pid"])[-1] == 1
    # (a member, not the lowest pid: once this machine's pids wrap, a later process can have a lower one)
    assert state[a]["init_pid"] in pidns.pidns_members(state[a]["init_pid"])
    assert _pidns(state[a]["sshd_pid"]) == _pidns(state[a]["init_pid"])
    assert _pidns(state[a]["proxy_pid"]) == _pidns(os.getpid())


def test_host_pids_match_ps_on_the_host(lab):
    h = lab.hosts[1]
    sshd = _state(lab)[h]["sshd_pid"]
    r = lab.ssh(h, "setsid sleep 300 >/dev/null 2>&1 </dev/null & echo $!")
    sleeper = int(r.stdout)
    # the session stays open (`read`) while host_pids looks, so it sees what ps saw
    cmd = ["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes",
           "-o", f"UserKnownHostsFile={lab.known_hosts}", "-o", "ConnectTimeout=5", "-i", str(lab.state_dir / "client_ed25519"),
           f"root@{lab.address(h)}", "ps -e -o pid=,comm=; echo END; read x"]
    with subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=lab.env) as ssh:
        try:
            rows = []
            for line in ssh.stdout:
                if line.strip() == "END":
                    break
                rows.append(line.split())
            inside = {ns[-1]: p for p in lab.pids(h) if (ns := pidns.nspids(p))}  # {pid on the host: root view}
        finally:
            ssh.stdin.write("\n")
            ssh.stdin.close()
            ssh.wait(timeout=10)
    try:
        seen = {int(row[0]) for row in rows if row[1:] != ["ps"]}  # ps has exited by now
        assert seen == set(inside) | {1, pidns.nspids(sshd)[-1]}
        assert sleeper in inside and b"sleep" in open(f"/proc/{inside[sleeper]}/cmdline", "rb").read()
    finally:
        lab.ssh(h, f"kill {sleeper}")


def test_orphans_are_reaped(lab):
    h = lab.hosts[2]
    # a double fork: the subshell exits at once, its sleep is orphaned to the host's init
    orphan = int(lab.ssh(h, "(sleep 3 >/dev/null 2>&1 </dev/null & echo $!)").stdout)
    (pid,) = [p for p in lab.pids(h) if (pidns.nspids(p) or [None])[-1] == orphan]  # None: exited meanwhile
    status = open(f"/proc/{pid}/status").read()
    assert int(status.split("\nPPid:")[1].split()[0]) == _state(lab)[h]["init_pid"]  # root view
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:  # a zombie stays in /proc
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{pid}")


def test_server_pids_are_recorded_as_this_machine_sees_them(server_lab):
    for name, h in _state(server_lab).items():
        nspid = int(server_lab.ssh(name, "cat /opt/fleetctl-standin/server.pid").stdout)
        pid = pidns.root_pid(h["init_pid"], nspid)
        assert pid in labmod.host_pids(name, server_lab.lab_id, server_lab.state_dir)
        assert b"server.py" in open(f"/proc/{pid}/cmdline", "rb").read()
        assert isinstance(h["server_pid"], int)
        if alive(h["server_pid"]):  # not restarted by a test since `lab up`
            assert h["server_pid"] == pid


def _describe(pid: str) -> str:
    """A leftover process for the failure message: its state, parent and command line."""
    try:
        status = dict(line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                      if ":\t" in line)
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:200].decode(errors="replace")
        return f"{status.get('State')} ppid {status.get('PPid')}: {cmd}"
    except OSError as e:
        return f"gone ({e.strerror})"


# lab_down's own test takes a lab of its own down, never the run's shared one
DOWN_LAB_ID = (TEST_LAB_ID + 150) % 256


@pytest.fixture
def doomed(lab_machine, tmp_path_factory):
    """A two-host lab (0.5.10, no servers) for lab_down to take down."""
    with running_lab(tmp_path_factory.mktemp("home-down"), DOWN_LAB_ID, ["0.5.10"], hosts=2) as up:
        yield up


def test_down_leaves_no_process_in_the_hosts_pid_namespaces(doomed):
    """`lab down`, with processes that try to stay."""
    lab = doomed
    state = _state(lab)
    assert lab.ssh(lab.hosts[0], "setsid sh -c 'trap \"\" TERM HUP; sleep 300' >/dev/null 2>&1 </dev/null &"
                                 " setsid sh -c 'kill -STOP $$; sleep 300' >/dev/null 2>&1 </dev/null &"
                                 " (sleep 300 >/dev/null 2>&1 </dev/null &)").returncode == 0
    namespaces = {_pidns(h["init_pid"]) for h in state.values()}
    members = {p for h in state.values() for p in pidns.pidns_members(h["init_pid"])}
    assert len(namespaces) == len(lab.hosts) == 2 and len(members) >= 2 * len(lab.hosts) + 3
    labmod.lab_down(lab.lab_id, lab.state_dir, lab.known_hosts)
    left = []
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            if _pidns(int(d)) in namespaces:
                left.append(d)
        except OSError:
            pass
    assert left == [] and not any(alive(p) for p in members), [(p, _describe(p)) for p in left]
    assert not any(alive(h[k]) for h in state.values() for k in ("init_pid", "sshd_pid", "proxy_pid"))
    assert f"flab{lab.lab_id}-" not in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                                      text=True).stdout


# a lab id of this test's own: the server lab (session scope) stays up for the modules after this
STEPS_LAB_ID = (TEST_LAB_ID + 170) % 256


def test_lab_up_says_each_step_as_it_starts(lab_machine, tmp_path):
    """Issue 50 (review newcomer-turn4 item 7): `lab up` printed nothing for 19 s and edited
    known_hosts without a word. A one-host lab on an id of its own reports its steps in order,
    known_hosts named."""
    known = tmp_path / ".ssh" / "known_hosts"
    sd = labmod.state_dir_for(STEPS_LAB_ID)
    said: list[str] = []
    try:
        labmod.lab_up(1, ["0.5.2"], lab_id=STEPS_LAB_ID, state_dir=sd, known_hosts=known, say=said.append)
    finally:
        labmod.lab_down(STEPS_LAB_ID, sd, known)
    steps = [line.split(":")[0].split()[0] for line in said]
    assert steps == ["wheels", "network", "host", "SGLang", "waiting", "known_hosts", "ssh_config"], said
    assert str(known) in said[5] and "lab-01" in said[2]
