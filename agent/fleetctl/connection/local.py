"""`ansible_connection: local`: the host is this machine; commands are local processes.

For fleetctl on the host itself (the GPU check script deploys this way) and for testing the
orchestration without sshd. The command still goes through the command builder (the deadline
wrapper), so a local command behaves as a remote one does.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

from . import polling
from .base import Connection, OutputBuffer, Process
from .errors import OutputTooLarge, RemoteTimeout, Unreachable


class LocalProcess(Process):
    """A process in its own session on this machine (see Process)."""

    def __init__(self, argv: list[str]):
        try:
            self._p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, start_new_session=True)
        except OSError as e:
            raise Unreachable(f"cannot start {argv[0]!r} on this machine: {e}") from None

    def _kill_group(self) -> None:
        try:
            os.killpg(self._p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def communicate(self, stdin: bytes, deadline: float, out: OutputBuffer,
                    err: OutputBuffer) -> tuple[bytes, bytes, int]:
        sinks = {self._p.stdout.fileno(): out, self._p.stderr.fileno(): err}
        pending = memoryview(stdin)
        writer = self._p.stdin.fileno()
        if not pending:
            self._p.stdin.close()
        try:
            while sinks or pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RemoteTimeout("local command did not end by its deadline")
                readable, writable = polling.wait(list(sinks), [writer] if pending else [], left)
                if writable:
                    try:
                        pending = pending[os.write(writer, pending[:65536]):]
                    except BrokenPipeError:
                        pending = pending[:0]
                    if not pending:
                        self._p.stdin.close()
                for fd in readable:
                    chunk = os.read(fd, 65536)
                    if chunk:
                        sinks[fd].add(chunk)
                    else:
                        del sinks[fd]
            code = self._p.wait(max(0.0, deadline - time.monotonic()))
        except (RemoteTimeout, OutputTooLarge, subprocess.TimeoutExpired):
            self._kill_group()
            self._p.wait()
            if time.monotonic() >= deadline:
                raise RemoteTimeout("local command did not end by its deadline") from None
            raise
        return out.value(), err.value(), code if code >= 0 else -1

    def read_out(self, limit: int, timeout: float) -> bytes:
        fd = self._p.stdout.fileno()
        if not polling.wait([fd], timeout=max(0.0, timeout))[0]:
            return b""
        return os.read(fd, limit)

    def read_err(self, limit: int, timeout: float) -> bytes:
        fd = self._p.stderr.fileno()
        if not polling.wait([fd], timeout=max(0.0, timeout))[0]:
            return b""
        return os.read(fd, limit)

    def write(self, data: bytes) -> None:
        try:
            self._p.stdin.write(data)
            self._p.stdin.flush()
        except OSError as e:
            raise Unreachable(f"the command's stdin closed: {e}") from None

    def wait(self, timeout: float) -> int | None:
        try:
            return self._p.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def close(self) -> None:
        for f in (self._p.stdin, self._p.stdout, self._p.stderr):
            try:
                f.close()
            except OSError:
                pass
        if self.wait(2) is None:  # EOF on stdin ends fleetctl's own commands; anything else is killed
            self._kill_group()
            self._p.wait()


class LocalConnection(Connection):
    """This machine, as the user fleetctl runs as."""


    @property
    def address(self) -> str:
        return "localhost"

    def open(self) -> None:
        """Nothing to connect."""

    def close(self) -> None:
        """Nothing to close: each process is closed when its command ends."""

    def _start(self, argv: list[str], timeout: float) -> Process:
        return LocalProcess(argv)
