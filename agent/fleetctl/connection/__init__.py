"""Reaching hosts: one interface (`Connection`), one command builder (`command`), one kind per
way of reaching a host, picked by the host's `ansible_connection`.

Kinds: `paramiko` (the default; also `paramiko_ssh`), `ssh` (also `smart`: the system OpenSSH
client, over a ControlMaster) and `local` (this machine). Every SSH kind reaches what OpenSSH's
`ssh -G` resolves (resolve.py). Everything
above this package runs argv lists through `Connection.run`, uploads with `put_bytes` and locks
with `hold_lock`; nothing above it imports paramiko or builds a command line.
"""

from __future__ import annotations

from .base import Connection, HostLock, Result, Settings
from .errors import BecomeFailed, HostKeyRefused, LockBusy, OutputTooLarge, RemoteTimeout, Unreachable

__all__ = ["BecomeFailed", "Connection", "HostKeyRefused", "HostLock", "LockBusy", "RemoteTimeout", "Result", "Settings",
           "Unreachable", "connect", "kind_for"]


def kind_for(host, settings: Settings) -> str:
    """The connection kind of `host`: its ansible_connection, else settings.connection (`-c`),
    else paramiko (Ansible: connection variables override the command line)."""
    return host.vars.get("ansible_connection") or settings.connection or host.connection


def connect(host, settings: Settings) -> Connection:
    """A new, unopened connection to `host` of the kind its `ansible_connection` names (the
    inventory loader has already refused unknown kinds, naming the file and line). paramiko is
    imported only for an SSH host."""
    kind = kind_for(host, settings)
    if kind == "local":
        from .local import LocalConnection
        return LocalConnection(host, settings)
    if kind in ("ssh", "smart"):
        from .openssh import OpenSSHConnection
        return OpenSSHConnection(host, settings)
    from .paramiko_ssh import ParamikoConnection
    return ParamikoConnection(host, settings)
