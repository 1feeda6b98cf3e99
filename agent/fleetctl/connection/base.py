"""The interface every way of reaching a host implements, and the types that cross it.

Follows pyinfra's `connectors/base.py` and mitogen's transports: a connection kind is a small
class that only knows how to open a session and start one process over there (`_start`). Running
a command with input under a deadline, uploading a file and holding fleetctl's host lock are
written once, here, against that one primitive; every remote command line is built by
`command.remote_argv` (the deadline wrapper; the become prefix and the container entry join it
there later). Nothing in this module imports paramiko, so a local-only run (the GPU host
itself) needs neither paramiko nor Fabric.
"""

from __future__ import annotations

import hashlib
import math
import os
import pwd
import socket
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

from . import command
from .errors import LockBusy, OutputTooLarge, RemoteTimeout, Unreachable

# Bytes of the lock handshake read at most (a hostile host cannot make the controller hold more).
LOCK_HANDSHAKE_MAX = 4096
# Bytes of one command's stdout, and of its stderr, the controller holds at most (review M3):
# past it the command is stopped and OutputTooLarge raised.
OUTPUT_MAX = 64 << 20
# Bytes kept of a command whose output is only shown (handlers): its first and last halves.
TAIL_MAX = 1 << 20
# Exit status of the lock script when another run holds the lock (flock -E).
_LOCK_BUSY_EXIT = 75


def passwd_home() -> Path:
    """The current user's home from the passwd database, as OpenSSH finds `~` (ssh(1): it never
    reads $HOME)."""
    return Path(pwd.getpwuid(os.getuid()).pw_dir)


def expand_home(path: str) -> Path:
    """`path` with a leading `~/` (or a bare `~`) replaced by passwd_home()."""
    if path == "~" or path.startswith("~/"):
        return passwd_home() / path[2:]
    return Path(path)


@dataclass(frozen=True)
class Settings:
    """How to reach hosts, for every connection kind.

    connect_timeout: seconds for TCP connect, banner, key exchange and auth together (every
      ProxyJump hop included).
    accept_new: store unknown host keys (OpenSSH's StrictHostKeyChecking=accept-new).
    ssh_config: the ssh_config file to read instead of the user's `~/.ssh/config` (passwd home)
      and /etc/ssh/ssh_config, as `ssh -F` does; None: those two.
    server_alive_interval / server_alive_count_max: keepalive defaults (seconds, count) where
      the ssh_config sets no ServerAliveInterval / ServerAliveCountMax.
    """

    connect_timeout: float = 10.0
    accept_new: bool = False
    ssh_config: Path | None = None
    server_alive_interval: float = 15.0
    server_alive_count_max: int = 3


@dataclass
class Result:
    """A finished remote command: exit status, raw output bytes and wall time in seconds."""

    exit_code: int
    stdout: bytes
    stderr: bytes
    elapsed_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


class OutputBuffer:
    """One output stream of a command, never more than `limit` bytes held: with `keep_ends`,
    the first and last limit/2 bytes and a line saying how many were dropped between them;
    without, add() raises OutputTooLarge ("output over N MiB from WHAT") past the limit."""

    def __init__(self, limit: int, what: str, keep_ends: bool = False):
        self.limit, self.what, self.keep_ends = limit, what, keep_ends
        self.head, self.tail, self.dropped = bytearray(), bytearray(), 0

    def add(self, chunk: bytes) -> None:
        """Take the next bytes read from the stream."""
        if not self.keep_ends:
            if len(self.head) + len(chunk) > self.limit:
                raise OutputTooLarge(f"output over {self.limit >> 20} MiB from {self.what}")
            self.head += chunk
            return
        half = self.limit // 2
        room = half - len(self.head)
        self.head += chunk[:max(room, 0)]
        self.tail += chunk[max(room, 0):]
        if len(self.tail) > half:
            self.dropped += len(self.tail) - half
            del self.tail[:len(self.tail) - half]

    def value(self) -> bytes:
        """What was kept."""
        gap = f"\n[... {self.dropped} bytes of output dropped ...]\n".encode() if self.dropped else b""
        return bytes(self.head) + gap + bytes(self.tail)


class Process(ABC):
    """One process started over there by a connection kind."""

    @abstractmethod
    def communicate(self, stdin: bytes, deadline: float, stdout: OutputBuffer,
                    stderr: OutputBuffer) -> tuple[bytes, bytes, int]:
        """Send `stdin` then EOF, read stdout and stderr to the end into the two buffers (which
        bound them), and return what they kept with the exit status (-1: killed by a signal).
        `deadline` is a time.monotonic() value. Raises RemoteTimeout past the deadline,
        Unreachable when the connection is lost, OutputTooLarge from a buffer."""

    @abstractmethod
    def readline(self, limit: int, timeout: float) -> bytes:
        """The first line of stdout (at most `limit` bytes; b"" at EOF or after `timeout`
        seconds). stdin stays open."""

    @abstractmethod
    def wait(self, timeout: float) -> int | None:
        """The exit status within `timeout` seconds, else None."""

    @abstractmethod
    def close(self) -> None:
        """Close stdin and the process's channel (idempotent): the process sees EOF."""


class Connection(ABC):
    """A connection to one inventory host. Subclasses implement open, close, address and
    _start; run, put_bytes and hold_lock are the same for every kind."""

    kind = "?"

    def __init__(self, host, settings: Settings):
        self.host = host
        self.settings = settings
        # interpreters the trust probe found root may run on this host (fleet.HostContext.probe)
        self.trusted_interpreters: set[str] = set()

    @property
    @abstractmethod
    def address(self) -> str:
        """The address actually reached (after ssh_config's HostName), for reports."""

    @abstractmethod
    def open(self) -> None:
        """Connect within settings.connect_timeout seconds. Raises Unreachable (HostKeyRefused
        for a refused host key)."""

    @abstractmethod
    def close(self) -> None:
        """Close the connection and everything started over it (idempotent)."""

    @abstractmethod
    def _start(self, argv: list[str], timeout: float) -> Process:
        """Start `argv` (already wrapped by command.remote_argv) over there, within `timeout`
        seconds. Raises Unreachable, RemoteTimeout."""

    def run(self, argv: list[str], timeout: float, stdin: bytes = b"", what: str | None = None,
            keep_ends: bool = False) -> Result:
        """Run `argv` (a list of words, never a shell string) with `stdin` bytes then EOF, killed
        over there (the whole process group) if it outlives `timeout` seconds. Each output
        stream is held to OUTPUT_MAX bytes, or with `keep_ends` to its first and last TAIL_MAX/2.
        `what` names the command in errors (default: its first word).
        Raises RemoteTimeout at the deadline, Unreachable if the connection is lost,
        OutputTooLarge (the command is stopped)."""
        wrapped, limit = command.remote_argv(argv, timeout)
        what = what or repr(argv[0])
        size = TAIL_MAX if keep_ends else OUTPUT_MAX
        start = time.monotonic()
        proc = self._start(wrapped, limit)
        try:
            out, err, code = proc.communicate(stdin, start + limit + command.KILL_AFTER_S + 3,
                                              OutputBuffer(size, what, keep_ends), OutputBuffer(size, what, keep_ends))
        finally:
            proc.close()
        elapsed = time.monotonic() - start
        if code in command.TIMEOUT_EXITS and elapsed >= limit - 0.5:
            raise RemoteTimeout(f"remote command ran past its deadline of {limit} s and was killed on the host")
        return Result(code, out, err, elapsed)

    def put_bytes(self, data: bytes, remote_path: str, timeout: float, mode: int = 0o644) -> None:
        """Write `data` to `remote_path` over there: sent on the stdin of a command that writes a
        private temp file beside it, checks its sha256 and renames it into place (the parent
        directories are created). Raises RemoteTimeout, Unreachable, OSError (the host's refusal:
        permission denied, no space left, a bad upload)."""
        r = self.run(command.upload_argv(remote_path, mode, hashlib.sha256(data).hexdigest()), timeout, stdin=data)
        if not r.ok:
            raise OSError(f"upload to {remote_path} failed (exit {r.exit_code}): "
                          f"{r.stderr.decode('utf-8', 'replace').strip()[-300:]}")

    def hold_lock(self, state_dir: str, timeout: float, hold_s: float) -> "HostLock":
        """Take fleetctl's per-host lock (flock on STATE_DIR/lock) for as long as it is held,
        and at most `hold_s` seconds.

        The lock is held by a remote `flock` whose child waits for EOF on its stdin: releasing,
        losing the connection or this process dying frees it; so does `hold_s` passing (a network
        partition that sshd does not notice cannot keep a stale lock for hours). Raises LockBusy
        at once when another run holds it (quoting who and since when), or when it cannot be
        taken within `timeout` seconds; Unreachable, RemoteTimeout."""
        who = f"{os.environ.get('USER') or pwd.getpwuid(os.getuid()).pw_name}@{socket.gethostname()} pid {os.getpid()}"
        hold = max(1, math.ceil(hold_s))
        wrapped, _ = command.remote_argv(command.lock_argv(state_dir, who, hold), hold + timeout)
        proc = self._start(wrapped, timeout)
        line = proc.readline(LOCK_HANDSHAKE_MAX, timeout)
        if line.strip() == b"LOCKED":
            return HostLock(proc)
        code = proc.wait(timeout)
        proc.close()
        if code == _LOCK_BUSY_EXIT:
            holder = self.run(["cat", "--", f"{state_dir}/lock.owner"], timeout=timeout)
            who = holder.stdout[:LOCK_HANDSHAKE_MAX].decode("utf-8", "replace").strip()
            raise LockBusy(f"another fleetctl run is changing this host ({who or 'holder unknown'})")
        raise LockBusy(f"could not take the lock {state_dir}/lock within {timeout:g} s (exit {code})")


class HostLock:
    """fleetctl's lock on one host, held while the remote flock's process runs (see
    Connection.hold_lock)."""

    def __init__(self, proc: Process):
        self._proc = proc

    def release(self) -> None:
        """Release the lock: closing the process's stdin ends the remote flock (idempotent)."""
        self._proc.close()
