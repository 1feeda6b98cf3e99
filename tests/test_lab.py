"""The lab itself, checked through real sshd with the OpenSSH client."""

from __future__ import annotations

import os
import signal
import socket
import time
import uuid

import pytest
import yaml

from fleetctl import lab as labmod

pytestmark = pytest.mark.lab

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


def test_freeze_accepts_tcp_but_sends_no_banner(lab):
    h = lab.hosts[0]
    lab.fault(h, "freeze")
    try:
        assert banner(lab.address(h), 2.0) == TIMED_OUT  # accepted and held open, not closed (b"")
    finally:
        lab.fault(h, "thaw")
    assert banner(lab.address(h), 5.0).startswith(b"SSH-2.0-")


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


def test_hang_replaces_the_interpreter(lab):
    h = lab.hosts[0]
    lab.fault(h, "hang")
    try:
        with pytest.raises(Exception, match="timed out"):
            lab.ssh(h, "/opt/sglang/venv/bin/python -c 'print(1)'", timeout=3)
        left = lab.pids(h)  # the client gave up; the hanging interpreter runs on
        assert any(b"sleep" in open(f"/proc/{p}/cmdline", "rb").read() for p in left)
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


def test_lab_refuses_without_root(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert labmod.main(["--lab-id", "9", "status"]) != 0
    assert "needs root" in capsys.readouterr().err
