"""How fleetctl would reach each host, without connecting: what `fleetctl hosts` shows.

Per host: the connection kind, and for an SSH kind what OpenSSH resolved (`ssh -G`, as the
connections themselves resolve it): address, port, user, identity files, the ProxyJump hosts in
the order they are dialled, ProxyCommand, the name host keys are looked up by, the known_hosts
files and the lines of them that apply (found by `ssh-keygen -F`). What an operator runs to see
why fleetctl dials what it dials.
"""

from __future__ import annotations

import time

from .session import Session, kind_for
from ..config import CONNECTIONS
from ..errors import FleetctlError
from ..inventory import Host


def describe(host: Host, session: Session) -> dict:
    """One host's entry: {host, connection, address, port, user, identity_files, jump,
    proxy_command, host_key_name, known_hosts, known_hosts_lines, error}; `error` is the
    resolution's refusal (SshConfigError: OpenSSH refuses the config, exit 4) or None. Runs
    `ssh -G` (and `ssh-keygen -F`, by the session's resolver) within the settings'
    connect_timeout seconds; dials nothing."""
    settings = session.settings
    kind = kind_for(host, settings)
    doc = {"host": host.name, "connection": kind, "address": host.address, "port": None,
           "user": host.user, "identity_files": [], "jump": [], "proxy_command": None, "host_key_name": None,
           "known_hosts": [], "known_hosts_lines": [], "error": None}
    if not CONNECTIONS[kind].ssh:
        doc["address"] = "localhost"
        return doc
    from . import knownhosts
    from .resolve import hop_chain
    try:
        r = session.resolver.resolve_host(host, time.monotonic() + settings.connect_timeout)
    except (FleetctlError, OSError) as e:
        doc["error"] = str(e)
        return doc
    files = [*r.known_hosts, *r.global_known_hosts]
    lines = []
    for f in (f for f in files if f.exists()):
        try:
            lines += [f"{where}: {line}" for where, line in knownhosts.found_lines(r.host_key_name, f)]
        except OSError as e:
            lines.append(f"{f}: cannot read ({e.strerror or e})")
    doc.update(address=r.hostname, port=r.port, user=r.user, identity_files=[str(p) for p in r.identity_files],
               jump=[f"{h.user}@{h.hostname}:{h.port}" for h in hop_chain(r)[:-1]], proxy_command=r.proxy_command,
               host_key_name=r.host_key_name, known_hosts=[str(f) for f in files], known_hosts_lines=lines)
    return doc
