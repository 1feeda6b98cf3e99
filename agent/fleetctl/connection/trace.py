"""What a connection dialled and how long each of its phases took, for `fleetctl -v` (the CLI
shows this logger's records on stderr; nothing is shown without -v). Only what `ssh -G` and the
inventory say about reaching a host is logged (addresses, ports, users, file paths, the proxy's
command line): never a password, a key or a vault value.

A connection's phases (PHASES) pass in order; `Phases` marks each as it starts, so the one a
timeout stopped in is named with its time (errors.stalled) instead of every candidate.
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger("fleetctl.connect")

# resolve: ssh -G; connect: TCP (or the ProxyJump hops, or starting the ProxyCommand); banner: the
# server's SSH identification string; kex: key exchange and host key; auth: user authentication;
# open-session: the first channel (RFC 4254 5.1) of the first command.
PHASES = ("resolve", "connect", "banner", "kex", "auth", "open-session")


class Phases:
    """The phases one connection went through, each with the time.monotonic() it started."""

    def __init__(self) -> None:
        self.marks: list[tuple[str, float]] = []

    def mark(self, phase: str, at: float | None = None) -> None:
        """`phase` (one of PHASES) starts now (or at `at`); marking the current one again does nothing."""
        if not self.marks or self.marks[-1][0] != phase:
            self.marks.append((phase, time.monotonic() if at is None else at))

    @property
    def current(self) -> str | None:
        """The phase marked last (None before any)."""
        return self.marks[-1][0] if self.marks else None

    def in_current(self, now: float | None = None) -> float:
        """Seconds since the current phase started (0 before any)."""
        return ((time.monotonic() if now is None else now) - self.marks[-1][1]) if self.marks else 0.0

    def summary(self, end: float | None = None) -> str:
        """"resolve 0.012 s, connect 0.001 s, ..." up to `end` (default now): each phase's seconds."""
        end = time.monotonic() if end is None else end
        bounds = [t for _, t in self.marks[1:]] + [end]
        return ", ".join(f"{p} {b - t:.3f} s" for (p, t), b in zip(self.marks, bounds))


def dialled(name: str, kind: str, user: str, hostname: str, port: int, proxy: str | None,
            identity_files: list[str], missing: list[str], agent: str | None) -> str:
    """The -v line saying how host `name` is dialled: connection `kind`, user@hostname:port, the
    proxy (ProxyJump chain or ProxyCommand, None: direct), the identity files offered, those
    named but missing, and the agent socket."""
    parts = [f"{name}: dialling {user}@{hostname}:{port} over {kind}", f"proxy {proxy or 'none (direct)'}",
             "identity files " + (", ".join(identity_files) or "none")]
    if missing:
        parts.append("named but missing " + ", ".join(missing))
    parts.append(f"agent {agent or 'none'}")
    return "; ".join(parts)
