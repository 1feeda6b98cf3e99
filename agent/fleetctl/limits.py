"""The open-files limit a large fleet reaches (issue 55), and what it allows at once.

A host in progress holds several descriptors on this machine (FDS_PER_HOST: its connection's
socket, a paramiko channel's pipe pair, a ProxyCommand's pipes, or an OpenSSH client's three
pipes and its master's socket); a default soft RLIMIT_NOFILE of 1024 is then reached near
--forks 128, and a run that opened more than that failed its hosts with EMFILE. The command line
raises the soft limit to the hard one (any process may: setrlimit(2)) before it starts, and a
fan-out wider than what is left is narrowed to it (engine.fleet.Fleet).
"""

from __future__ import annotations

import resource

FDS_PER_HOST = 8  # the most one host in progress holds (the OpenSSH kind with a ProxyCommand: 3 + 2 + master's 1, rounded up)
RESERVED_FDS = 64  # the process's own: stdio, the inventory, history, logs, the wheel cache


def raise_open_files() -> int:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit (an unlimited hard limit: to
    1,048,576, Linux's default nr_open); returns the soft limit in force afterwards. Never
    raises: a limit that cannot be changed is left as it was."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = 1 << 20 if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            pass
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def forks_allowed(forks: int) -> int:
    """How many of `forks` hosts may be in progress at once under the current soft
    RLIMIT_NOFILE (FDS_PER_HOST each, RESERVED_FDS kept): `forks` itself when the limit allows
    it, else fewer, and at least 1."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return forks
    return max(1, min(forks, (soft - RESERVED_FDS) // FDS_PER_HOST))
