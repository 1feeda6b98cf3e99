"""The lab's lines in known_hosts: where the file is, and dropping the lines of given addresses."""

from __future__ import annotations

import base64
import hashlib
import hmac
from pathlib import Path

from ..connection.resolve import passwd_home


def default_known_hosts() -> Path:
    """~/.ssh/known_hosts of the passwd home, where fleetctl and OpenSSH look (not $HOME)."""
    return passwd_home() / ".ssh" / "known_hosts"


def _host_matches(field: str, address: str) -> bool:
    names = {address, f"[{address}]:22"}
    for entry in field.split(","):
        if entry.startswith("|1|"):
            _, _, salt, digest = entry.split("|")
            for n in names:
                mac = hmac.new(base64.b64decode(salt), n.encode(), hashlib.sha1).digest()
                if base64.b64encode(mac).decode() == digest:
                    return True
        elif entry in names:
            return True
    return False


def forget_known_hosts(known_hosts: Path, addresses: list[str]) -> None:
    """Drop known_hosts lines for `addresses` (plain or hashed), like `ssh-keygen -R`."""
    if not known_hosts.exists():
        return
    keep = []
    for line in known_hosts.read_text().splitlines(keepends=True):
        parts = line.split()
        field = parts[1] if parts and parts[0].startswith("@") and len(parts) >= 4 else (parts or [""])[0]
        if len(parts) >= 3 and not line.startswith("#") and any(
                _host_matches(field, a) for a in addresses):
            continue
        keep.append(line)
    known_hosts.write_text("".join(keep))
