"""The lab's become users: non-root logins on this machine (which the lab hosts share) with
per-host sudo rules, and their password; the PAM stacks some of them authenticate with, and the
stand-in sudo programs a host may name in ansible_become_exe."""

from __future__ import annotations

import base64
import os
import shutil
from pathlib import Path

from .base import LabError, host_name, require_root, run, state_dir_for


# The lab's own PAM stacks for sudo, by become_users role (Linux-PAM's modules, libpam-modules):
# pam_stress asks `STRESS Password: `, its own words, and takes any answer; pam_unix asks
# `Password: ` and checks the login's password. sudo given -p asks both with -p's prompt (-p turns
# on sudoers' passprompt_override: plugins/sudoers/policy.c, "prompt=").
_PAM_STACKS = {
    "pam": "auth required pam_stress.so\n",
    "otp": "auth required pam_unix.so\nauth required pam_stress.so\n",
}
# A stand-in for a sudo whose authentication asks in its own words, not with -p's prompt (sudo's
# own Kerberos method before sudo PR #138, authd's PAM module: issue 32's case 01), for a host's
# ansible_become_exe: `Password for LOGIN@EXAMPLE.COM: ` (krb5/), or -p's prompt then a one-time
# code's `Verification code: ` (otp/), each answer read from stdin; it runs nothing and exits 1.
_STANDIN_SUDO = """#!/bin/sh
# fleetctl lab: a stand-in for sudo whose authentication asks in its own words; not sudo.
p=
while [ $# -gt 0 ]; do case $1 in -p) p=$2; shift 2;; --) break;; *) shift;; esac; done
case $0 in
*/otp/sudo) printf '%s' "$p" >&2; read -r pw; printf 'Verification code: ' >&2; read -r code;;
*) printf 'Password for %s@EXAMPLE.COM: ' "$(id -un)" >&2; read -r pw;;
esac
echo "sudo: 1 incorrect password attempt" >&2
exit 1
"""


def _sudoers_path(lab_id: int) -> Path:
    return Path(f"/etc/sudoers.d/fleetctl-lab-{lab_id}")


def _pam_service(lab_id: int, stack: str) -> str:
    return f"fleetctl-lab-{lab_id}-{stack}"


def standin_sudo(lab_id: int, kind: str) -> str:
    """The path of the lab's stand-in sudo of `kind` ("krb5": asks `Password for
    LOGIN@EXAMPLE.COM: `; "otp": asks -p's prompt, then `Verification code: `), for
    ansible_become_exe; root-owned, on the filesystem every lab host shares."""
    return f"/usr/local/lib/fleetctl-lab-{lab_id}/{kind}/sudo"


def become_users(lab_id: int) -> dict[str, str]:
    """The lab's non-root logins (role -> user name): `sudo` may sudo to any user, without a
    password on lab-03 and with one on lab-04 (and nowhere else); `nosudo` has no sudo rights;
    `tty` may sudo without a password anywhere, but only from a tty (`Defaults requiretty`).
    `pam` and `otp` may sudo to any user anywhere with a password, asked every time through
    their own PAM service (sudoers `pam_service`, _PAM_STACKS): `pam` by pam_stress alone (a
    module that asks in its own words), `otp` by pam_unix then pam_stress (a second question
    after the password)."""
    roles = ("sudo", "nosudo", "tty", "pam", "otp")
    return {r: f"flab{lab_id}{r}" for r in roles}


def lab_add_become_users(lab_id: int = 0, state_dir: Path | None = None) -> str:
    """Create (again: any earlier ones are removed first; `lab up` creates them) the lab's become_users on this machine (the hosts share its /etc: each host is
    its own UTS namespace, so sudo matches rules by the host name) and one sudoers file
    /etc/sudoers.d/fleetctl-lab-<id> with the per-host rules, checked by `visudo -c`, with the
    PAM services /etc/pam.d/fleetctl-lab-<id>-{pam,otp} its rules name and the stand-in sudo
    programs (standin_sudo); the logins sign in with the lab's client key and have a new random
    password, returned (also in <state dir>/become_password, mode 0600). `lab_down` removes
    them all. Raises LabError."""
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
    for stack, auth in _PAM_STACKS.items():
        Path(f"/etc/pam.d/{_pam_service(lab_id, stack)}").write_text(
            f"# fleetctl lab {lab_id}: written by `fleetctl lab up`, removed by `fleetctl lab down`\n"
            f"{auth}account required pam_permit.so\nsession required pam_permit.so\n")
    for kind in ("krb5", "otp"):
        exe = Path(standin_sudo(lab_id, kind))
        exe.parent.mkdir(parents=True, exist_ok=True)
        exe.write_text(_STANDIN_SUDO)
        exe.chmod(0o755)
    rules = (f"# fleetctl lab {lab_id}: written by `fleetctl lab up`, removed by `fleetctl lab down`\n"
             f"{users['sudo']} {host_name(2)} = (ALL) NOPASSWD: ALL\n"
             f"{users['sudo']} {host_name(3)} = (ALL) ALL\n"
             f"Defaults:{users['tty']} requiretty\n{users['tty']} ALL = (ALL) NOPASSWD: ALL\n"
             + "".join(f"Defaults:{users[r]} pam_service={_pam_service(lab_id, r)}, timestamp_timeout=0\n"
                       f"{users[r]} ALL = (ALL) ALL\n" for r in _PAM_STACKS))
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
    """Remove the lab's sudoers file, become_users (their homes too), PAM services and stand-in
    sudo programs, if there."""
    _sudoers_path(lab_id).unlink(missing_ok=True)
    for user in become_users(lab_id).values():
        run(["userdel", "--remove", user], check=False)
    for stack in _PAM_STACKS:
        Path(f"/etc/pam.d/{_pam_service(lab_id, stack)}").unlink(missing_ok=True)
    shutil.rmtree(Path(standin_sudo(lab_id, "krb5")).parent.parent, ignore_errors=True)
