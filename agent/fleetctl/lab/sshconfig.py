"""The lab's ssh_config (<state dir>/ssh_config, a Host block per lab host) and the one marked
Include line for it in the passwd home's ~/.ssh/config."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from ..connection.resolve import passwd_home
from .base import state_dir_for


def user_ssh_config() -> Path:
    """~/.ssh/config of the passwd home, which `lab up` / `lab down` add / remove the Include in."""
    return passwd_home() / ".ssh" / "config"


def lab_ssh_config_path(lab_id: int = 0, state_dir: Path | None = None) -> Path:
    """`<state dir>/ssh_config`: Host blocks for the lab's host names (written by lab_up)."""
    return state_dir_for(lab_id, state_dir) / "ssh_config"


def write_lab_ssh_config(sd: Path, state: dict, known_hosts: Path) -> Path:
    path = sd / "ssh_config"
    path.write_text(f"# fleetctl lab {state['lab_id']}: written by `fleetctl lab up`\n" + "".join(
        f"Host {h['name']}\n  HostName {h['address']}\n  User root\n  IdentityFile {sd / 'client_ed25519'}\n"
        f"  IdentitiesOnly yes\n  UserKnownHostsFile {known_hosts}\n" for h in state["hosts"]))
    return path


def _include_line(lab_id: int, lab_config: Path) -> str:
    return f"Include {lab_config} # fleetctl lab {lab_id}\n"


def _replace_atomically(path: Path, text: str) -> None:
    """Write `text` to `path` through a private temp file beside it and a rename; the file keeps
    its mode (0600 when it is new) and never exists half-written."""
    mode = path.stat().st_mode & 0o777 if path.exists() else 0o600
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.fleetctl-")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def add_ssh_config_include(user_config: Path, lab_id: int = 0, state_dir: Path | None = None) -> None:
    """Add the marked line `Include <state dir>/ssh_config # fleetctl lab ID` to `user_config`
    (the passwd home's ~/.ssh/config for `fleetctl lab up`) before its first Host or Match line,
    so that it applies to every host; the file is created 0600 (its directory 0700) if missing
    and written atomically. Adding it twice leaves one line."""
    line = _include_line(lab_id, lab_ssh_config_path(lab_id, state_dir))
    user_config.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    lines = user_config.read_text().splitlines(keepends=True) if user_config.exists() else []
    if line in lines:
        return
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    at = next((i for i, text in enumerate(lines) if text.split()[:1] and text.split()[0].lower() in ("host", "match")),
              len(lines))
    _replace_atomically(user_config, "".join(lines[:at] + [line] + lines[at:]))


def remove_ssh_config_include(user_config: Path, lab_id: int = 0, state_dir: Path | None = None) -> None:
    """Remove exactly the line add_ssh_config_include wrote (nothing else changes)."""
    if not user_config.exists():
        return
    line = _include_line(lab_id, lab_ssh_config_path(lab_id, state_dir))
    lines = user_config.read_text().splitlines(keepends=True)
    if line in lines:
        _replace_atomically(user_config, "".join(text for text in lines if text != line))
