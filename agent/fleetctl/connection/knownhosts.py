"""known_hosts files read line by line, markers included, for the paramiko connection.

OpenSSH's sshd(8) manual, "SSH_KNOWN_HOSTS FILE FORMAT": a line is `[marker] hostpatterns keytype
base64-key [comment]`; the markers are `@cert-authority` (the key is a CA that signs host
certificates for the hosts matching the patterns) and `@revoked` (the key must never be
accepted). paramiko's `HostKeys.load()` knows neither: one marker line raises `InvalidHostKey`
and stops the whole file (paramiko#771, pyinfra#1944). Here the lines that apply to a host are
found by OpenSSH's own matcher (`ssh-keygen -F NAME -f FILE`) and each is read on its own: a line
that cannot be read is a warning with file:line and the others still load; a key under an
@revoked line that applies to the host is refused whatever other line lists it; CA lines are
remembered so that a host they cover is refused with the reason (paramiko cannot verify host
certificates); and so are the host's keys of a type paramiko cannot read (sk-ssh-ed25519,
sk-ecdsa-sha2-nistp256, ssh-dss since paramiko 4): a pin that cannot be checked, never one to drop
(security review turn 3, M2), so that `--accept-new` cannot store another key over it.
"""

from __future__ import annotations

import base64
import binascii
import logging
import os
import re
import shutil
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path

from ._paramiko import paramiko  # first: paramiko without invoke (see _paramiko.py)
from paramiko.hostkeys import HostKeyEntry, InvalidHostKey  # noqa: E402

from .resolve import match_patterns

log = logging.getLogger("fleetctl")

_CACHE: dict[tuple, "KnownHosts"] = {}
# Seconds one `ssh-keygen -F` may take, and the bytes of its output read at most.
KEYGEN_TIMEOUT_S = 10
KEYGEN_OUTPUT_MAX = 1 << 20
_CACHE_LOCK = threading.Lock()
MARKERS = ("@cert-authority", "@revoked")  # sshd(8), SSH_KNOWN_HOSTS FILE FORMAT


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
class Unverifiable:
    """A plain line that pins the host to a key of a type paramiko cannot read: the type, the place."""

    keytype: str
    where: str  # "file:line"


@dataclass
class KnownHosts:
    """What a set of known_hosts files says: plain keys (paramiko's HostKeys, revoked keys left
    out), revoked key blobs and CA lines, the pins of types paramiko cannot read (unverifiable),
    and a warning per line that could not be read."""

    keys: paramiko.HostKeys = field(default_factory=paramiko.HostKeys)
    revoked: list[Marker] = field(default_factory=list)
    authorities: list[Marker] = field(default_factory=list)
    unverifiable: list[Unverifiable] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def revocation(self, key: paramiko.PKey) -> Marker | None:
        """The @revoked line that lists `key`, if any (any host: a revoked key is never accepted)."""
        blob = key.asbytes()
        return next((m for m in self.revoked if m.blob == blob), None)

    def authority(self, name: str) -> Marker | None:
        """The @cert-authority line whose patterns cover `name` (`host` or `[host]:port`), if any."""
        return next((m for m in self.authorities if host_patterns_match(m.patterns, name)), None)


def _take(line: str, where: str, out: KnownHosts, entries: list[HostKeyEntry]) -> None:
    """Read one known_hosts line (found at `where`, "file:line") into `out` / `entries`."""
    line = line.strip()
    if not line or line.startswith("#"):
        return
    if line.startswith("@"):
        fields = line.split()
        if len(fields) < 4 or fields[0] not in MARKERS:
            out.warnings.append(f"{where}: unknown marker or short line, ignored")
            return
        try:
            blob = base64.b64decode(fields[3], validate=True)
        except (binascii.Error, ValueError):
            out.warnings.append(f"{where}: the key is not base64, line ignored")
            return
        (out.revoked if fields[0] == "@revoked" else out.authorities).append(Marker(fields[1], blob, where))
        return
    try:
        entry = HostKeyEntry.from_line(line)
    except (InvalidHostKey, paramiko.SSHException, binascii.Error, ValueError) as e:
        out.warnings.append(f"{where}: unreadable line ({type(e).__name__}), ignored")
        return
    if entry is None:  # a key type paramiko does not know (HostKeyEntry.from_line's None)
        keytype = line.split()[1] if len(line.split()) > 1 else "?"
        out.unverifiable.append(Unverifiable(keytype, where))
        out.warnings.append(f"{where}: key type {keytype}: paramiko cannot verify this key type, so the host is "
                            "refused unless another line's key matches (use ansible_connection: ssh)")
        return
    entries.append(entry)


def _found_by_ssh_keygen(name: str, path: Path) -> list[tuple[str, str]]:
    """(file:line, line) for every line of `path` that OpenSSH's matcher applies to `name`:
    `ssh-keygen -F NAME -f FILE` (ssh-keygen(1); host patterns, `!` negation, hashed names,
    markers, `[host]:port`), which prints `# Host NAME found: line N [CA|REVOKED]` before each."""
    try:
        r = subprocess.run(["ssh-keygen", "-F", name, "-f", str(path)], capture_output=True, timeout=KEYGEN_TIMEOUT_S,
                           stdin=subprocess.DEVNULL, start_new_session=True)
    except subprocess.TimeoutExpired:
        raise OSError(f"ssh-keygen -F did not finish within {KEYGEN_TIMEOUT_S} s") from None
    found, lineno = [], None
    for line in r.stdout[:KEYGEN_OUTPUT_MAX].decode("utf-8", "replace").splitlines():
        m = re.match(r"# Host .* found: line (\d+)", line)
        if m:
            lineno = m[1]
        elif lineno is not None and line.strip():
            found.append((f"{path}:{lineno}", line))
            lineno = None
    return found


def _hashed(field: str, name: str) -> bool:
    """Whether host field `field`, a hashed name (`|1|base64(salt)|base64(HMAC-SHA1(salt, name))`,
    a 20-byte salt: OpenSSH's hostfile.c host_hash), is `name`'s, compared whole (a field that
    starts with `|` is one hashed name: `|1|...,other` names no host). A field of another shape
    names no host; it never raises."""
    parts = field.split("|")
    if len(parts) != 4 or parts[1] != "1":
        return False
    try:
        if len(base64.b64decode(parts[2], validate=True)) != 20:
            return False  # paramiko's hash_host asserts the salt's length
        return paramiko.HostKeys.hash_host(name, field) == field
    except (binascii.Error, ValueError):
        return False


def _applies(line: str, name: str) -> bool:
    """Whether a known_hosts line applies to `name`, read as OpenSSH's hostfile.c reads it (the
    matcher without ssh-keygen, which prints the same lines): a marker is the word up to the first
    space (else tab) and is one of MARKERS or the line is skipped (check_markers); then the host
    field, a key type and a key, or the line applies to nothing; a host field starting with `|`
    is one hashed name (_hashed), any other a pattern list (host_patterns_match)."""
    line = line.lstrip(" \t")
    if not line or line.startswith("#"):
        return False
    if line.startswith("@"):
        end = line.find(" ") if " " in line else line.find("\t")
        if end < 0 or line[:end] not in MARKERS:
            return False
        line = line[end:].lstrip(" \t")
    fields = line.split(None, 2)
    if len(fields) < 3:
        return False
    return _hashed(fields[0], name) if fields[0].startswith("|") else host_patterns_match(fields[0], name)


def found_lines(name: str, path: Path) -> list[tuple[str, str]]:
    """(file:line, line) for every line of `path` that applies to the host key name `name`:
    found by `ssh-keygen -F` when it is on PATH, else by _applies. Raises OSError when `path`
    cannot be read."""
    if shutil.which("ssh-keygen") is not None:
        return _found_by_ssh_keygen(name, path)
    text = path.read_text(encoding="utf-8", errors="replace")
    return [(f"{path}:{n}", line) for n, line in enumerate(text.splitlines(), start=1) if _applies(line, name)]


def lookup(name: str, files: list[Path]) -> KnownHosts:
    """What `files` (in order; missing ones skipped) say about the host key name `name` (`host`,
    `[host]:port` or a HostKeyAlias): its plain keys under `name` (revoked keys left out), its
    pins of a type paramiko cannot read, and the @revoked and @cert-authority lines that apply
    to it (found_lines). Cached per process by `name` and each file's identity (path, size,
    mtime_ns), so each warning is logged once."""
    ident = []
    for p in files:
        try:
            st = os.stat(p)
            ident.append((str(p), st.st_size, st.st_mtime_ns))
        except OSError:
            ident.append((str(p), None, None))
    key = (name, tuple(ident))
    with _CACHE_LOCK:
        if key in _CACHE:
            return _CACHE[key]
    out, entries = KnownHosts(), []
    for p in files:
        if not p.exists():
            continue
        try:
            lines = found_lines(name, p)
        except OSError as e:
            out.warnings.append(f"{p}: cannot read ({e.strerror or e}); its keys are not used")
            continue
        for where, line in lines:
            _take(line, where, out, entries)
    for e in entries:
        if out.revocation(e.key) is None:
            out.keys.add(name, e.key.get_name(), e.key)
    with _CACHE_LOCK:
        for w in out.warnings:
            log.warning("fleetctl: known_hosts %s", w)
        return _CACHE.setdefault(key, out)


def append(path: Path, name: str, key: paramiko.PKey, hashed: bool = False) -> None:
    """Append `name keytype base64` to `path` (created 0600 in a 0700 directory) in one
    O_APPEND write, on a line of its own even when the file's last line has no newline; with
    `hashed` (ssh_config HashKnownHosts yes) the name is written hashed (`|1|salt|hash`), as ssh
    does."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        size = os.fstat(fd).st_size
        glue = b""
        if size:
            os.lseek(fd, size - 1, os.SEEK_SET)
            glue = b"" if os.read(fd, 1) == b"\n" else b"\n"
        field = paramiko.HostKeys.hash_host(name) if hashed else name
        os.write(fd, glue + f"{field} {key.get_name()} {key.get_base64()}\n".encode())
    finally:
        os.close(fd)
