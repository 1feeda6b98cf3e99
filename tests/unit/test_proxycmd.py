"""The paramiko connection's ProxyCommand (connection/proxycmd.py) in a session of its own: a
terminal's SIGINT to the controller's process group does not reach it, and the controller ends
it (its whole group) when it closes the connection or exits. Real processes: a controller in a
process group of its own, as a terminal's foreground job is."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from fleetctl.connection.proxycmd import ProxyCommand
from helpers.proc import alive, alive_pids, group_pids

AGENT = str(Path(__file__).resolve().parents[2] / "agent")

# A controller that opens a proxy (`sh` that starts a child in the background, then waits on its
# stdin as `ssh -W` does), says the proxy's pid and its child's, and waits; on Ctrl-C it says
# whether the proxy still runs and exits without closing it (its atexit hook must).
CONTROLLER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, sys.argv[1])
    from fleetctl.connection.proxycmd import ProxyCommand
    proxy = ProxyCommand(["sh", "-c", "sleep 300 & echo $!; exec cat"])
    child = proxy.process.stdout.readline().decode().strip()
    try:
        print(proxy.process.pid, child, flush=True)
        time.sleep(60)
    except KeyboardInterrupt:
        print("running" if proxy.process.poll() is None else "gone", flush=True)
""")


def _emptied(pgid: int, within: float = 2.0) -> bool:
    """Whether process group `pgid` has no live process within `within` seconds (one killed a
    moment ago may still be exiting)."""
    end = time.monotonic() + within
    while group_pids(pgid) and time.monotonic() < end:
        time.sleep(0.05)
    return group_pids(pgid) == []


def test_close_ends_the_proxys_whole_group_in_its_own_session():
    proxy = ProxyCommand(["sh", "-c", "sleep 300 & echo $!; exec cat"])
    child = int(proxy.process.stdout.readline())
    pid = proxy.process.pid
    assert os.getsid(pid) == pid and os.getpgid(pid) == pid and os.getpgid(child) == pid
    assert os.getsid(pid) != os.getsid(0)
    proxy.send(b"through\n")
    assert proxy.recv(8) == b"through\n"
    t0 = time.monotonic()
    proxy.close()
    assert time.monotonic() - t0 < 1.5  # cat ends at SIGTERM: no wait for the SIGKILL
    assert proxy.closed and _emptied(pid) and not alive(child)
    proxy.close()  # idempotent: nothing signalled once reaped


def test_a_proxy_that_ignores_sigterm_is_killed():
    proxy = ProxyCommand(["sh", "-c", "trap '' TERM; echo up; while :; do sleep 0.1; done"])
    assert proxy.process.stdout.readline() == b"up\n"
    t0 = time.monotonic()
    proxy.close()
    assert 1.5 < time.monotonic() - t0 < 8 and _emptied(proxy.process.pid)


def test_ctrl_c_to_the_controllers_group_spares_the_proxy_and_its_exit_ends_it():
    """SIGINT to the controller's whole process group, as a terminal's Ctrl-C: the controller
    gets it (KeyboardInterrupt) and its proxy still runs; at the controller's exit the proxy and
    what it started are gone."""
    p = subprocess.Popen([sys.executable, "-c", CONTROLLER, AGENT], stdout=subprocess.PIPE, text=True,
                         start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        proxy, child = map(int, p.stdout.readline().split())
        os.killpg(p.pid, signal.SIGINT)
        said = p.stdout.readline().strip()
        assert p.wait(10) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert said == "running"
    assert _emptied(proxy) and alive_pids([proxy, child]) == []


def test_a_proxy_that_exits_is_the_connections_end_at_once():
    """The proxy's EOF is b"" (paramiko's transport: EOFError, the connection's end), with what
    came before it; silence is socket.timeout after the timeout, as a socket's."""
    proxy = ProxyCommand(["sh", "-c", "printf ab; exit 0"])
    proxy.settimeout(5)
    t0 = time.monotonic()
    assert proxy.recv(16) == b"ab" and proxy.recv(16) == b""
    assert time.monotonic() - t0 < 2
    proxy.close()
    quiet = ProxyCommand(["cat"])
    quiet.settimeout(0.3)
    with pytest.raises(socket.timeout):
        quiet.recv(16)
    quiet.close()
