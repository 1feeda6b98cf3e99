"""A container connection: a host's connection with every command prefixed by the container's
entry, as mitogen's docker transport prefixes another transport's boot command
(mitogen/docker.py `get_boot_command`: `bits += ['exec'] + args + [self.container]`, then
`super().get_boot_command()`).

The deadline wrapper and sudo (base.Connection._begin) stay on the host, around the entry
(`podman exec ID`, probes/enter.py: command.container_entry); the command itself runs in the
container, where there may be no shell or coreutils (a distroless image), so the lock is taken by
command.python_lock_argv under the container's interpreter. Opening and closing are the host
connection's, which the fan-out owns.
"""

from __future__ import annotations

from . import command
from .base import LOCK_HANDSHAKE_MAX, Connection, Process


class ContainerConnection(Connection):
    """`outer` (the host's open connection) entered by `entry` (a command.container_entry
    prefix), with `python` the container's interpreter (None: python3 on its PATH)."""

    # the interpreter in the container is the container's own (/proc/PID/exe's name, resolved
    # inside), run with no more power than the container's process has (the runtime's exec, or
    # probes/enter.py): started directly, checked inside by the facts probe (no shell there)
    checks_interpreters = False

    def __init__(self, outer: Connection, entry: list[str], python: str | None):
        super().__init__(outer.host, outer.session)
        self.outer = outer
        self.prefix = tuple(entry)
        self._python = python

    @property
    def python(self) -> str | None:
        """The container's interpreter."""
        return self._python

    @property
    def address(self) -> str:
        return self.outer.address

    def around(self, outer: Connection) -> "ContainerConnection":
        """The same entry on another connection to the host (after a reconnect)."""
        return ContainerConnection(outer, list(self.prefix), self._python)

    def keepalive(self) -> tuple[float, int]:
        """The host connection's keepalive (its commands ride on it)."""
        return self.outer.keepalive()

    def open(self) -> None:
        """Nothing to open: the host's connection is open."""

    def close(self) -> None:
        """Nothing to close: the host's connection is the fan-out's."""

    def _start(self, argv: list[str], timeout: float) -> Process:
        return self.outer._start(argv, timeout)

    def _lock_argv(self, state_dir: str, who: str, hold_s: int, beat_s: int, token: str) -> list[str]:
        """The lock without a shell: command.python_lock_argv under the container's interpreter
        (with none known, the host's way: a shell and flock in the container)."""
        if self._python is None:
            return super()._lock_argv(state_dir, who, hold_s, beat_s, token)
        return command.python_lock_argv(self._python, state_dir, who, hold_s, beat_s, token)

    def _lock_holder(self, state_dir: str, seen: bytes, token: str, timeout: float) -> str:
        """The holder, as python_lock_argv prints it after its holder_marker line."""
        if self._python is None:
            return super()._lock_holder(state_dir, seen, token, timeout)
        owner = command.reply(seen, command.holder_marker(token))
        return "" if owner is None else owner[:LOCK_HANDSHAKE_MAX].decode("utf-8", "replace").strip()
