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


def dialled(name: str, kind: str, r) -> str:
    """The -v line saying how host `name` is dialled over connection `kind`, from what `ssh -G`
    resolved (`r`, a resolve.Resolved): user@hostname:port, the proxy (ProxyJump chain or
    ProxyCommand; none: direct), the identity files offered, those named but missing, and the
    agent socket."""
    proxy = (f"ProxyJump {','.join(map(str, r.proxy_jump))}" if r.proxy_jump
             else f"ProxyCommand {r.proxy_command}" if r.proxy_command else "none (direct)")
    parts = [f"{name}: dialling {r.user}@{r.hostname}:{r.port} over {kind}", f"proxy {proxy}",
             "identity files " + (", ".join(map(str, r.identity_files)) or "none")]
    if r.missing_identity_files:
        parts.append("named but missing " + ", ".join(map(str, r.missing_identity_files)))
    parts.append(f"agent {r.identity_agent or 'none'}")
    return "; ".join(parts)
