"""Opening a verified paramiko SSH session: the host-key policy, OpenSSH's auth order, the
ProxyCommand socket, and the run's shared connections to ProxyJump hosts (JumpPool), for the
paramiko connection kind (paramiko_ssh.py) and its bastions alike.

Host keys are always verified (known_hosts read by knownhosts.py, markers included): an unknown
key is refused unless hostkey_policy.accept_new says to store it (`--accept-new`, or
StrictHostKeyChecking no/off in the config or the inventory's args, with a warning; as OpenSSH's
StrictHostKeyChecking=accept-new), a changed key is always refused with both fingerprints, a
revoked key is refused, and a host covered only by a `@cert-authority` line, or pinned to a key
of a type paramiko cannot read (sk-*, ssh-dss), is refused with the reason, `--accept-new` or
not. Auth uses only what `ssh -G` resolved, as OpenSSH's client uses it (paramiko_auth.py):
its identity files and certificates (`look_for_keys` off) and the agent at IdentityAgent.
"""

from __future__ import annotations

import base64
import hashlib
import threading
import time
from pathlib import Path

from ._paramiko import paramiko  # first: paramiko without invoke (see _paramiko.py)

from . import knownhosts, proxycmd
from .base import Settings
from .errors import HostKeyRefused, Unreachable
from .hostkey_policy import accept_new
from .paramiko_auth import OpenSSHAuth
from .resolve import Resolved

_ACCEPT_LOCK = threading.Lock()


def fingerprint(key: paramiko.PKey) -> str:
    """OpenSSH-style SHA256 fingerprint of a host key, e.g. 'ssh-ed25519 SHA256:abc...'."""
    digest = base64.b64encode(hashlib.sha256(key.asbytes()).digest()).decode().rstrip("=")
    return f"{key.get_name()} SHA256:{digest}"


class _Policy(paramiko.MissingHostKeyPolicy):
    """What to do with a key that no plain known_hosts line lists for the host's key name
    (`Resolved.host_key_name`: HostKeyAlias, `host` or `[host]:port`)."""

    def __init__(self, known: knownhosts.KnownHosts, name: str, accept_into: Path | None, hashed: bool):
        self.known, self.name, self.accept_into, self.hashed = known, name, accept_into, hashed

    def missing_host_key(self, client, hostname, key):
        revoked = self.known.revocation(key)
        if revoked:
            raise HostKeyRefused(f"host key {fingerprint(key)} of {self.name} is revoked "
                                 f"(@revoked at {revoked.where}); nothing was run")
        ca = self.known.authority(self.name)
        if ca:
            raise HostKeyRefused(f"a CA vouches for this host (@cert-authority at {ca.where}); paramiko cannot "
                                 "verify host certificates: use ansible_connection: ssh")
        if self.known.unverifiable:  # a pin paramiko cannot check is no unknown host (review turn 3, M2)
            pins = " and ".join(f"a {p.keytype} key at {p.where}" for p in self.known.unverifiable)
            raise HostKeyRefused(f"host key of {self.name} not verified: known_hosts pins it to {pins}, and paramiko "
                                 "cannot verify this key type: use ansible_connection: ssh (the host offered "
                                 f"{fingerprint(key)}, not stored); nothing was run")
        if self.accept_into is None:
            raise HostKeyRefused(f"unknown host key for {self.name} ({fingerprint(key)}); verify it and add it to "
                                 "known_hosts, or pass --accept-new to store it on first use")
        client.get_host_keys().add(hostname, key.get_name(), key)
        with _ACCEPT_LOCK:
            knownhosts.append(self.accept_into, self.name, key, self.hashed)


def verifying_client(r: Resolved, settings: Settings, what: str | None = None) -> paramiko.SSHClient:
    """A paramiko client that verifies `r`'s host key against `r`'s known_hosts files (user
    files, then the global ones as read-only pins) under its key name; an unknown key is stored
    in the first user file where hostkey_policy.accept_new says so (`what` names the host in its
    warnings, default r.name)."""
    client = paramiko.SSHClient()
    name = r.host_key_name
    known = knownhosts.lookup(name, [*r.known_hosts, *r.global_known_hosts])
    # paramiko looks the key up as `host` / `[host]:port` of the address it dials
    dialled = r.hostname if r.port == 22 else f"[{r.hostname}]:{r.port}"
    for ktype, key in (known.keys.lookup(name) or {}).items():  # lookup() filed them under `name`
        client.get_host_keys().add(dialled, ktype, key)
    accept = accept_new(r, settings.accept_new, what)
    client.set_missing_host_key_policy(_Policy(known, name, r.known_hosts[0] if accept else None,
                                               r.hash_known_hosts))
    return client


def dial(client: paramiko.SSHClient, r: Resolved, sock, deadline: float) -> None:
    """Connect `client` to `r` (over `sock`, or dialling itself), authenticate (paramiko_auth:
    Unreachable naming the keys refused), by `deadline`."""
    left = max(0.1, deadline - time.monotonic())
    tcp = left if r.connect_timeout is None else min(left, r.connect_timeout)
    client.connect(r.hostname, r.port, r.user, sock=sock, timeout=tcp, banner_timeout=left, auth_timeout=left,
                   channel_timeout=left, auth_strategy=OpenSSHAuth(r, left))


def proxy_command(r: Resolved) -> proxycmd.ProxyCommand:
    """A socket-like ProxyCommand for `r` (run by `sh -c`, as ssh runs it through the shell), in
    a session of its own (proxycmd.py: the terminal's Ctrl-C reaches fleetctl only)."""
    return proxycmd.ProxyCommand(["sh", "-c", r.proxy_command])


class _Jump:
    """One shared connection to a bastion (the chain of hosts that leads to it is its key)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.client: paramiko.SSHClient | None = None
        self.users = 0


class JumpPool:
    """The run's connections to ProxyJump hosts: one per chain, shared by every host behind it
    (security review L12: one bastion session per host exhausts sshd's MaxStartups), opened by
    the first host that needs it, closed when the last one lets go."""

    def __init__(self):
        self._lock = threading.Lock()
        self._jumps: dict[tuple, _Jump] = {}

    def lease(self, chain: list[Resolved], settings: Settings, deadline: float) -> tuple[paramiko.Transport, list]:
        """Open (or share) every connection of `chain` (dialled in order, each through the one
        before), by `deadline`; -> (the last one's transport, the lease to hand to release()).
        Raises HostKeyRefused, Unreachable, paramiko errors as SSHClient.connect does."""
        held: list[tuple[tuple, _Jump]] = []
        transport = None
        try:
            for i, hop in enumerate(chain):
                key = tuple((h.hostname, h.port, h.user) for h in chain[:i + 1])
                with self._lock:
                    jump = self._jumps.setdefault(key, _Jump())
                if not jump.lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
                    raise Unreachable(f"ProxyJump hop {hop.name}: no session within the connect timeout")
                try:
                    live = jump.client is not None and jump.client.get_transport() is not None \
                        and jump.client.get_transport().is_active()
                    if not live:
                        if transport is not None:
                            sock = transport.open_channel("direct-tcpip", (hop.hostname, hop.port), ("", 0),
                                                          timeout=max(0.1, deadline - time.monotonic()))
                        else:
                            sock = proxy_command(hop) if hop.proxy_command else None
                        client = verifying_client(hop, settings, f"ProxyJump hop {hop.name}")
                        dial(client, hop, sock, deadline)
                        jump.client = client
                    jump.users += 1
                    held.append((key, jump))
                    transport = jump.client.get_transport()
                finally:
                    jump.lock.release()
        except BaseException:
            self.release(held)
            raise
        return transport, held

    def release(self, held: list) -> None:
        """Let go of a lease; a connection no host uses any more is closed."""
        for key, jump in reversed(held):
            with jump.lock:
                jump.users -= 1
                if jump.users <= 0 and jump.client is not None:
                    jump.client.close()
                    jump.client = None
        held.clear()


