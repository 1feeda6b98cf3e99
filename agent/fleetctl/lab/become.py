"""The lab's become users: non-root logins on this machine (which the lab hosts share) with
per-host sudo rules, and their password."""

from __future__ import annotations

import base64
import os
import shutil
from pathlib import Path

from .base import LabError, host_name, require_root, run, state_dir_for


def _sudoers_path(lab_id: int) -> Path:
    return Path(f"/etc/sudoers.d/fleetctl-lab-{lab_id}")


def become_users(lab_id: int) -> dict[str, str]:
    """The lab's non-root logins (role -> user name): `sudo` may sudo to any user, without a
    password on lab-03 and with one on lab-04 (and nowhere else); `nosudo` has no sudo rights;
    `tty` may sudo without a password anywhere, but only from a tty (`Defaults requiretty`)."""
    return {"sudo": f"flab{lab_id}sudo", "nosudo": f"flab{lab_id}nosudo", "tty": f"flab{lab_id}tty"}


def lab_add_become_users(lab_id: int = 0, state_dir: Path | None = None) -> str:
    """Create (again: any earlier ones are removed first; `lab up` creates them) the lab's become_users on this machine (the hosts share its /etc: each host is
    its own UTS namespace, so sudo matches rules by the host name) and one sudoers file
    /etc/sudoers.d/fleetctl-lab-<id> with the per-host rules, checked by `visudo -c`; both
    logins sign in with the lab's client key and have a new random password, returned (also in
    <state dir>/become_password, mode 0600). `lab_down` removes users and file. Raises LabError."""
    require_root()
    sd = state_dir_for(lab_id, state_dir)
    if shutil.which("sudo") is None:
        raise LabError("sudo is not installed (scripts/setup.sh installs it)")
    lab_remove_become_users(lab_id)
    password = base64.b32encode(os.urandom(15)).decode().lower()
    users = become_users(lab_id)
    for user in users.values():
        run(["useradd", "--create-home", "--home-dir", f"/home/{user}", "--shell", "/bin/sh", user])
        run(["chpasswd"], input=f"{user}:{password}\n")
    rules = (f"# fleetctl lab {lab_id}: written by `fleetctl lab up`, removed by `fleetctl lab down`\n"
             f"{users['sudo']} {host_name(2)} = (ALL) NOPASSWD: ALL\n"
             f"{users['sudo']} {host_name(3)} = (ALL) ALL\n"
             f"Defaults:{users['tty']} requiretty\n{users['tty']} ALL = (ALL) NOPASSWD: ALL\n")
    tmp = _sudoers_path(lab_id).with_name(f".fleetctl-lab-{lab_id}.tmp")  # sudo skips names with a dot
    tmp.write_text(rules)
    tmp.chmod(0o440)
    run(["visudo", "-c", "-q", "-f", str(tmp)])
    tmp.rename(_sudoers_path(lab_id))
    secret = sd / "become_password"
    secret.unlink(missing_ok=True)
    fd = os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(password)
    return password


def become_password(lab_id: int = 0, state_dir: Path | None = None) -> str:
    """The become_users' password `lab up` chose (<state dir>/become_password). Raises LabError
    when the lab has none (not up, or built before `lab up` created become users)."""
    try:
        return (state_dir_for(lab_id, state_dir) / "become_password").read_text()
    except FileNotFoundError:
        raise LabError(f"lab {lab_id} has no become users: run `fleetctl lab up --lab-id {lab_id}`") from None


def lab_remove_become_users(lab_id: int) -> None:
    """Remove the lab's sudoers file and become_users (their homes too), if there."""
    _sudoers_path(lab_id).unlink(missing_ok=True)
    for user in become_users(lab_id).values():
        run(["userdel", "--remove", user], check=False)
