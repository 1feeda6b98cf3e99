"""The run's session: what every connection of one fleetctl run shares, and the one place a
host's connection is made.

As mitogen's `Router` and pyinfra's `State`: `Settings` (base.py) is plain data, and the state a
run builds from it lives here, made on first use so that a run that never needs it never imports
it (a local-only run imports no paramiko): the ssh_config resolver (each host and hop resolved
once by `ssh -G`), the paramiko jump pool (one connection per bastion) and the OpenSSH control
files (ControlPath directory, per-run ssh_config, masters). The fan-out holds one session for
the whole run and closes it last.
"""

from __future__ import annotations

import threading
from importlib import import_module

from ..config import CONNECTIONS
from .base import Connection, Settings


def kind_for(host, settings: Settings) -> str:
    """The connection kind of `host`: its ansible_connection, else settings.connection (`-c`),
    else paramiko (Ansible: connection variables override the command line)."""
    return host.vars.get("ansible_connection") or settings.connection or host.connection


class Session:
    """One run's reach to its hosts: `connect(host)` makes connections, `close()` ends the
    state they share (idempotent)."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self._state: dict = {}
        self._lock = threading.Lock()

    def _shared(self, name: str, make):
        """The run's one `name` object, made by `make()` on first use (from any thread)."""
        with self._lock:
            if name not in self._state:
                self._state[name] = make()
            return self._state[name]

    @property
    def resolver(self):
        """The run's resolve.Resolver (each host and hop resolved once)."""
        from .resolve import Resolver
        return self._shared("resolver", lambda: Resolver(self.settings.ssh_config))

    @property
    def jump_pool(self):
        """The run's paramiko_dial.JumpPool (one shared connection per bastion)."""
        from .paramiko_dial import JumpPool
        return self._shared("jump_pool", JumpPool)

    @property
    def control_files(self):
        """The run's openssh.ControlFiles (ControlPath directory and per-run ssh_config)."""
        from .openssh import ControlFiles
        return self._shared("control_files", lambda: ControlFiles(self.settings.ssh_config, self.settings.accept_new))

    def connect(self, host) -> Connection:
        """A new, unopened connection to `host` of the kind its `ansible_connection` names: the
        class config.CONNECTIONS gives for it, imported now (paramiko only for an SSH host). The
        inventory loader has already refused other names, naming the file and line."""
        module, _, name = CONNECTIONS[kind_for(host, self.settings)].cls.partition(":")
        return getattr(import_module(f"{__package__}.{module}"), name)(host, self)

    def close(self) -> None:
        """End the run's shared state: the OpenSSH masters still open (bastions included) and
        their control directory (idempotent)."""
        with self._lock:
            files = self._state.get("control_files")
        if files is not None:
            files.close()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
