"""The paramiko connection's ProxyCommand, run in a session of its own.

A terminal's Ctrl-C sends SIGINT to its whole foreground process group, and GNU `timeout` its
SIGTERM to its own group. fleetctl handles both (the hosts in progress finish, no other starts:
engine/fleet.py), but paramiko starts a ProxyCommand in fleetctl's group (paramiko 5.1
paramiko/proxy.py, `ProxyCommand.__init__`: `subprocess.Popen(self.cmd, stdin=PIPE, stdout=PIPE,
stderr=PIPE, bufsize=0)`), so the signal also killed the proxy (`ssh -W` to a bastion, a cloud
access proxy) that the host in progress depended on (paramiko PR #1183, paramiko-ng PR #73). Here
the same command starts with setsid(2) (`start_new_session`), so only fleetctl hears the
terminal, and fleetctl ends it itself: close() (paramiko's transport closes its socket when the
connection closes or fails) sends SIGTERM to the proxy's whole process group, SIGKILL when any of
it is left KILL_AFTER_S later, and reaps it; at exit, every proxy still running is closed so.
A proxy that exits (its bastion gone) is the connection's end at once (recv).
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import threading
import time

from ._paramiko import paramiko  # first: paramiko without invoke (see _paramiko.py)
from . import polling

# Seconds between a proxy's SIGTERM and its group's SIGKILL.
KILL_AFTER_S = 2

_LIVE: set["ProxyCommand"] = set()
_LIVE_LOCK = threading.Lock()


class ProxyCommand(paramiko.ProxyCommand):
    """paramiko's socket-like ProxyCommand over `argv`'s stdin and stdout, the process the
    leader of a new session and process group (its pid is both ids). Raises OSError when it
    cannot be started."""

    def __init__(self, argv: list[str]):  # noqa: super().__init__ would start it in fleetctl's group
        self.cmd = list(argv)
        self.process = subprocess.Popen(self.cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, bufsize=0, start_new_session=True)
        self.timeout = None
        self._closing = threading.Lock()
        with _LIVE_LOCK:
            _LIVE.add(self)

    def recv(self, size: int) -> bytes:
        """Up to `size` bytes from the proxy's stdout, within the timeout settimeout() set (None:
        no limit): what came when the time is up (socket.timeout when nothing did), and at the
        proxy's EOF what came before it, b"" when nothing did, which paramiko's transport takes
        for the connection's end (Packetizer.read_all: EOFError). paramiko's own recv reads EOF
        again and again until its timeout and then raises socket.timeout, which the transport
        retries: a proxy that exited (its bastion gone) was never noticed. Raises
        ProxyCommandFailure when its stdout cannot be read."""
        buf = b""
        start = time.monotonic()
        fd = self.process.stdout.fileno()
        try:
            while len(buf) < size:
                wait = None if self.timeout is None else self.timeout - (time.monotonic() - start)
                if wait is not None and wait <= 0:
                    raise socket.timeout()
                if polling.wait([fd], timeout=wait)[0]:
                    chunk = os.read(fd, size - len(buf))
                    if not chunk:
                        break
                    buf += chunk
            return buf
        except socket.timeout:
            if buf:
                return buf
            raise
        except OSError as e:
            raise paramiko.ProxyCommandFailure(" ".join(self.cmd), e.strerror) from None

    def close(self) -> None:
        """End the proxy's process group: SIGTERM, then SIGKILL to whatever of it is left once
        its leader exited or KILL_AFTER_S passed; then reap the leader (idempotent). The leader
        is reaped last, so the group's id cannot have been reused while it is signalled."""
        with self._closing:
            p = self.process
            if p.returncode is None:
                _signal_group(p.pid, signal.SIGTERM)
                end = time.monotonic() + KILL_AFTER_S
                while time.monotonic() < end and not _exited(p.pid):
                    time.sleep(0.02)
                _signal_group(p.pid, signal.SIGKILL)  # sh -c 'a | b': what the leader started
                p.wait()
        with _LIVE_LOCK:
            _LIVE.discard(self)


def _exited(pid: int) -> bool:
    """Whether child `pid` has exited, left unreaped (waitid(2) WNOWAIT)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


@atexit.register
def _close_all() -> None:
    """Close every proxy still running when fleetctl exits (its connection never closed)."""
    with _LIVE_LOCK:
        live = list(_LIVE)
    for proxy in live:
        proxy.close()
