"""known_hosts files read line by line, markers included, for the paramiko connection.

OpenSSH's sshd(8) manual, "SSH_KNOWN_HOSTS FILE FORMAT": a line is `[marker] hostpatterns keytype
base64-key [comment]`; the markers are `@cert-authority` (the key is a CA that signs host
certificates for the hosts matching the patterns) and `@revoked` (the key must never be
accepted). paramiko's `HostKeys.load()` knows neither: one marker line raises `InvalidHostKey`
and stops the whole file (paramiko#771, pyinfra#1944). Here each line is read on its own: a line
that cannot be read is a warning with file:line and the others still load; revoked keys are
refused for every host whatever line lists them; CA lines are remembered so that a host they
cover is refused with the reason (paramiko cannot verify host certificates).
"""

from __future__ import annotations

import base64
import binascii
import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

import paramiko
from paramiko.hostkeys import HostKeyEntry, InvalidHostKey

from .resolve import match_patterns

log = logging.getLogger("fleetctl")

_CACHE: dict[tuple, "KnownHosts"] = {}
_CACHE_LOCK = threading.Lock()


def host_patterns_match(patterns: str, name: str) -> bool:
    """OpenSSH's match_hostname for a known_hosts pattern list (sshd(8), "SSH_KNOWN_HOSTS FILE
    FORMAT"): comma-separated patterns as resolve.match_patterns reads them. `name` is `host` or
    `[host]:port` as the client looks it up."""
    return match_patterns(patterns.split(","), name)


@dataclass
class Marker:
    """One `@cert-authority` or `@revoked` line: its host patterns, key blob and place."""

    patterns: str
    blob: bytes
    where: str  # "file:line"


@dataclass
class KnownHosts:
    """What a set of known_hosts files says: plain keys (paramiko's HostKeys, revoked keys left
    out), revoked key blobs and CA lines, and a warning per line that could not be read."""

    keys: paramiko.HostKeys = field(default_factory=paramiko.HostKeys)
    revoked: list[Marker] = field(default_factory=list)
    authorities: list[Marker] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def revocation(self, key: paramiko.PKey) -> Marker | None:
        """The @revoked line that lists `key`, if any (any host: a revoked key is never accepted)."""
        blob = key.asbytes()
        return next((m for m in self.revoked if m.blob == blob), None)

    def authority(self, name: str) -> Marker | None:
        """The @cert-authority line whose patterns cover `name` (`host` or `[host]:port`), if any."""
        return next((m for m in self.authorities if host_patterns_match(m.patterns, name)), None)


def _read(path: Path, out: KnownHosts, entries: list[HostKeyEntry]) -> None:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return
    except OSError as e:
        out.warnings.append(f"{path}: cannot read ({e.strerror}); its keys are not used")
        return
    for lineno, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{path}:{lineno}"
        if line.startswith("@"):
            fields = line.split()
            if len(fields) < 4 or fields[0] not in ("@cert-authority", "@revoked"):
                out.warnings.append(f"{where}: unknown marker or short line, ignored")
                continue
            try:
                blob = base64.b64decode(fields[3], validate=True)
            except (binascii.Error, ValueError):
                out.warnings.append(f"{where}: the key is not base64, line ignored")
                continue
            (out.revoked if fields[0] == "@revoked" else out.authorities).append(Marker(fields[1], blob, where))
            continue
        try:
            entry = HostKeyEntry.from_line(line, lineno)
        except (InvalidHostKey, paramiko.SSHException, binascii.Error, ValueError) as e:
            out.warnings.append(f"{where}: unreadable line ({type(e).__name__}), ignored")
            continue
        if entry is None:
            out.warnings.append(f"{where}: key type {line.split()[1] if len(line.split()) > 1 else '?'} "
                                "not supported by paramiko, line ignored")
            continue
        entries.append(entry)


def load(files: list[Path]) -> KnownHosts:
    """Read `files` in order (missing ones are skipped). Cached per process by each file's
    identity (path, size, mtime_ns), so every host of a run shares one reading and each warning
    is logged once."""
    ident = []
    for p in files:
        try:
            st = os.stat(p)
            ident.append((str(p), st.st_size, st.st_mtime_ns))
        except OSError:
            ident.append((str(p), None, None))
    key = tuple(ident)
    with _CACHE_LOCK:
        if key in _CACHE:
            return _CACHE[key]
        out, entries = KnownHosts(), []
        for p in files:
            _read(p, out, entries)
        for e in entries:
            if out.revocation(e.key) is None:
                for name in e.hostnames:
                    out.keys.add(name, e.key.get_name(), e.key)
        for w in out.warnings:
            log.warning("fleetctl: known_hosts %s", w)
        _CACHE[key] = out
        return out


def append(path: Path, name: str, key: paramiko.PKey) -> None:
    """Append `name keytype base64` to `path` (created 0600 in a 0700 directory), on a line of
    its own even when the file's last line has no newline."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        size = os.fstat(fd).st_size
        glue = b""
        if size:
            os.lseek(fd, size - 1, os.SEEK_SET)
            glue = b"" if os.read(fd, 1) == b"\n" else b"\n"
        os.write(fd, glue + f"{name} {key.get_name()} {key.get_base64()}\n".encode())
    finally:
        os.close(fd)
