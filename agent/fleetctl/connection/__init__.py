"""Reaching hosts: one interface (`Connection`), one command builder (`command`), one kind per
way of reaching a host, picked by the host's `ansible_connection`, and the run's `Session`
that makes them.

Kinds: `paramiko` (the default; also `paramiko_ssh`), `ssh` (also `smart`: the system OpenSSH
client, over a ControlMaster) and `local` (this machine); a container connection (container.py)
wraps a host's connection and prefixes every command with the container's entry. The kinds are
one table, config.CONNECTION_KINDS (names, class, inventory vars): a new kind is a module here and
a row there. Every SSH kind
reaches what OpenSSH's `ssh -G` resolves (resolve.py). Everything above this package runs argv
lists through `Connection.run`, uploads with `put_bytes` and locks with `hold_lock`; nothing
above it imports paramiko or builds a command line.
"""

from __future__ import annotations

from .base import Connection, HostLock, Result, Settings, gone_holder
from .errors import BecomeFailed, HostKeyRefused, LockBusy, OutputTooLarge, RemoteTimeout, Unreachable
from .session import Session, kind_for

__all__ = ["BecomeFailed", "Connection", "HostKeyRefused", "HostLock", "LockBusy", "OutputTooLarge", "RemoteTimeout",
           "Result", "Session", "Settings", "Unreachable", "gone_holder", "kind_for"]
