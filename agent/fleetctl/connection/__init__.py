"""Reaching hosts: one interface (`Connection`), one command builder (`command`), one kind per
way of reaching a host, picked by the host's `ansible_connection`.

Kinds: `paramiko` (the default; also `paramiko_ssh`, and for now `ssh` and `smart`, until
fleetctl has a connection through the OpenSSH client) and `local` (this machine). Everything
above this package runs argv lists through `Connection.run`, uploads with `put_bytes` and locks
with `hold_lock`; nothing above it imports paramiko or Fabric or builds a command line.
"""

from __future__ import annotations

from .base import Connection, HostLock, Result, Settings
from .errors import HostKeyRefused, LockBusy, OutputTooLarge, RemoteTimeout, Unreachable

__all__ = ["Connection", "HostKeyRefused", "HostLock", "LockBusy", "RemoteTimeout", "Result", "Settings",
           "Unreachable", "connect"]


def connect(host, settings: Settings) -> Connection:
    """A new, unopened connection to `host` of the kind its `ansible_connection` names (the
    inventory loader has already refused unknown kinds, naming the file and line). paramiko and
    Fabric are imported only for an SSH host."""
    kind = host.connection
    if kind == "local":
        from .local import LocalConnection
        return LocalConnection(host, settings)
    from .paramiko_ssh import ParamikoConnection
    return ParamikoConnection(host, settings)
