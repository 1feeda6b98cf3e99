"""Become through real sshd, its prompts and flags (issue 32): a sudo that asks in its own words is reported
within seconds with those words (case 01, `Password for USER@REALM: `; then a one-time code's
`Verification code: `), a PAM stack that asks a second question after the password is reported
as OTP, not supported; ansible_become_flags with a login shell (-i) or a shell (-s), whose shell
parses the command again, run it unchanged; ansible_become_exe names the sudo program, and one
that is not sudo is refused naming the var, its file:line and why, before anything runs.

The sudo of case 01 is the lab's stand-in (fleetctl.lab.become.standin_sudo: a stand-in for a
sudo whose authentication asks in its own words, as sudo's own Kerberos method did and authd's
PAM module does; named by ansible_become_exe); the PAM stacks are real sudo with Linux-PAM's own
pam_unix and pam_stress (the lab's `pam` and `otp` logins)."""

from __future__ import annotations

import json

import os
import signal
import time

import pytest
import yaml

from fleetctl import lab as labmod
from fleetctl.connection import Session, base
from fleetctl.inventory import load
from fleetctl.lab.become import standin_sudo

QUIET = base.BECOME_QUESTION_QUIET_S


def inventory(lab, path) -> tuple[str, dict[str, int]]:
    """The run's inventory at `path` (each entry a lab host reached as one of the lab's logins)
    and the line each entry's last var is on."""
    lab_hosts = yaml.safe_load(lab.inventory.read_text())["all"]["children"]["lab"]["hosts"]
    users = labmod.become_users(lab.lab_id)
    entries = {
        "root-03": ("lab-03", {"ansible_user": "root"}),
        "login-shell": ("lab-03", {"ansible_user": users["sudo"], "ansible_become_flags": "-i -n"}),
        "shell": ("lab-03", {"ansible_user": users["sudo"], "ansible_become_flags": "-s -H"}),
        "krb5": ("lab-04", {"ansible_user": users["sudo"], "ansible_become_exe": standin_sudo(lab.lab_id, "krb5")}),
        "otp-code": ("lab-04", {"ansible_user": users["sudo"], "ansible_become_exe": standin_sudo(lab.lab_id, "otp")}),
        "pam-own-words": ("lab-01", {"ansible_user": users["pam"]}),
        "pam-second": ("lab-02", {"ansible_user": users["otp"]}),
        "doas": ("lab-01", {"ansible_user": users["sudo"], "ansible_become_exe": "doas"}),
        "prompt-flag": ("lab-02", {"ansible_user": users["sudo"], "ansible_become_flags": "-H -p 'Password:'"}),
    }
    lines = ["all:", "  vars:", "    ansible_become: true",
             f"    ansible_become_password: {labmod.become_password(lab.lab_id, lab.state_dir)}",
             f"    ansible_ssh_private_key_file: {lab_hosts['lab-01']['ansible_ssh_private_key_file']}", "  hosts:"]
    at = {}
    for name, (host, hv) in entries.items():
        lines += [f"    {name}:", f"      ansible_host: {lab_hosts[host]['ansible_host']}"]
        if name == "root-03":
            lines.append("      ansible_become: false")
        lines += [f"      {k}: {json.dumps(v)}" for k, v in hv.items()]
        at[name] = len(lines)
    path.write_text("\n".join(lines) + "\n")
    return str(path), at


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


@pytest.fixture(autouse=True)
def sessions_end(lab):
    """The become logins' SSH sessions (an ssh kind's master lingers ControlPersist seconds) are
    gone before the next test, which counts the processes left on a lab host."""
    yield
    deadline = time.monotonic() + 15
    while True:
        left = [p for h in lab.hosts for p in lab.pids(h) if _cmdline(p).startswith(b"sshd: flab")]
        if not left:
            return
        if time.monotonic() > deadline:  # this module's own logins: end them (the lab's users only)
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + 60
        time.sleep(0.5)


@pytest.mark.parametrize("kind", ["paramiko", "ssh"])
def test_case_01_prompts_of_its_own_otp_and_become_options(lab, tmp_path, kind):
    inv, at = inventory(lab, tmp_path / "hosts.yaml")
    r, _, hosts = lab.cli_json("inspect", "all", "-i", inv, "-c", kind)
    user = labmod.become_users(lab.lab_id)["sudo"]
    out = {h: (e["status"], e.get("error") or "", e["elapsed_s"]) for h, e in hosts.items()}

    # case 01: the stand-in's own question, within seconds (not the 60 s deadline), in its words
    status, error, took = out["krb5"]
    assert status == "failed", out["krb5"]
    assert error.startswith(f"sudo asked 'Password for {user}@EXAMPLE.COM: ' instead of fleetctl's prompt"), error
    assert f"`Defaults:{user} passprompt_override`" in error and "nothing was answered" in error
    assert QUIET <= took < QUIET + 3, took
    status, error, took = out["otp-code"]
    assert status == "failed" and error.startswith(
        "sudo asked a second question ('Verification code: ') after fleetctl answered its password prompt"), error
    assert "(OTP) is not supported" in error and QUIET <= took < QUIET + 3, (error, took)

    # real sudo and PAM: a module's own words (pam_stress) are asked with -p's prompt, and answered;
    # a second module after pam_unix is a second question with fleetctl's prompt: OTP
    assert out["pam-own-words"][0] == "ok", out["pam-own-words"]
    status, error, took = out["pam-second"]
    assert status == "failed" and error.startswith(
        "sudo asked a second question (fleetctl's prompt once more, with no refusal before it"), error
    assert "(OTP) is not supported" in error and took < QUIET + 3, (error, took)

    # a login shell (-i) and a shell (-s): the probes (quotes, `$`, newlines) ran as root's do
    assert out["root-03"][0] == "ok", out["root-03"]
    for name in ("login-shell", "shell"):
        assert out[name][0] == "ok", out[name]
        for k in ("facts", "allocator_call_sites", "need_sort_origins"):
            assert hosts[name][k] == hosts["root-03"][k], (name, k)

    # refused before anything ran, naming the var, its file:line and why
    status, error, took = out["doas"]
    assert status == "failed" and error == (
        f"{inv}:{at['doas']}: ansible_become_exe 'doas': it is not sudo: doas reads a password only from a "
        "terminal (it has no -S and no -p), and fleetctl never allocates one"), error
    status, error, _ = out["prompt-flag"]
    assert status == "failed" and error.startswith(
        f"{inv}:{at['prompt-flag']}: ansible_become_flags \"-H -p 'Password:'\": -p Password:: fleetctl gives sudo "
        "its own prompt (-p MARKER)"), error
    assert r.returncode == 2


def test_a_login_shell_and_a_shell_get_the_command_word_for_word(lab, tmp_path):
    """Through real sudo -i and -s over sshd: every word arrives as sent (the shell they start
    parses the command a second time), stdin too, run as root, and -i did start root's login
    shell (its working directory is root's home)."""
    inv, _ = inventory(lab, tmp_path / "hosts.yaml")
    hosts = load(inv).hosts
    words = ["a$HOME", "b\nc", "", "q'\"`\\", "é ü", "$(id)", "--", "*"]
    script = 'id -un; pwd; printf "[%s]" "$@"; cat'
    for name, cwd in (("login-shell", "/root"), ("shell", None)):
        conn = Session(lab.settings()).connect(hosts[name])
        conn.open()
        try:
            r = conn.run(["sh", "-c", script, "fleetctl-test", *words], 30, stdin=b"in\n")
        finally:
            conn.close()
        assert r.exit_code == 0, r.stderr
        user, where, rest = r.stdout.decode().split("\n", 2)
        assert user == "root" and (cwd is None or where == cwd), (name, user, where)
        assert rest == "".join(f"[{w}]" for w in words) + "in\n", (name, rest)
