"""Become options and the sudo handshake without a lab: ansible_become_flags and
ansible_become_exe read as sudo and Ansible's sudo become plugin read them (passed, changed or
refused with the reason), the command kept intact through the shell that -i / -s start, and
issue 32's case 01 as given: `ansible_connection: local` with a stand-in `sudo` first on PATH
(a stand-in for sudo under a PAM stack that asks in its own words: this room has no root, so
no real sudo), reported within seconds with sudo's own words."""

from __future__ import annotations

import subprocess
import time
from types import MappingProxyType

import pytest

from fleetctl.connection import BecomeFailed, Session, Settings, base, command
from fleetctl.inventory import Host


@pytest.mark.parametrize("flags,password,want", [
    (("-H", "-S", "-n"), True, (("-H", "-S"), False)),  # Ansible's default: -n dropped for a password
    (("-H", "-S", "-n"), False, (("-H", "-S", "-n"), False)),  # kept without one (sudo fails at once)
    (("-Hn",), True, (("-H",), False)),
    (("-nH",), False, (("-n", "-H"), False)),
    (("--non-interactive", "-E"), True, (("-E",), False)),
    (("--non-int",), True, ((), False)),  # a prefix of a long name, as getopt_long reads it
    (("-i",), False, (("-i",), True)),
    (("--login", "-H"), False, (("--login", "-H"), True)),
    (("-s",), False, (("-s",), True)),
    (("-iH",), False, (("-i", "-H"), True)),
    (("-gwheel", "-k"), False, (("-gwheel", "-k"), False)),
    (("-ng", "wheel"), True, (("-g", "wheel"), False)),
    (("--chdir", "/srv", "--command-timeout=5m"), False, (("--chdir", "/srv", "--command-timeout=5m"), False)),
    (("--preserve-env=PATH,CUDA_HOME", "-i"), False, (("--preserve-env=PATH,CUDA_HOME", "-i"), True)),
    (("FOO=bar", "-H"), False, (("FOO=bar", "-H"), False)),
    (("-hgpu-01",), False, (("-hgpu-01",), False)),
    (("-h", "gpu-01", "-H"), False, (("-h", "gpu-01", "-H"), False)),
    (("--host=gpu-01",), False, (("--host=gpu-01",), False)),
    (("-X", "--frobnicate"), False, (("-X", "--frobnicate"), False)),  # unknown: passed through
])
def test_become_flags_passed_as_ansible_and_sudo_read_them(flags, password, want):
    assert command.sudo_flags(flags, password) == want


@pytest.mark.parametrize("flags,why", [
    (("-p", "Password:"), "-p Password:: fleetctl gives sudo its own prompt"),
    (("--prompt=x",), "--prompt=x: fleetctl gives sudo its own prompt"),
    (("--pro", "x"), "--pro x: fleetctl gives sudo its own prompt"),
    (("-HSp", "x"), "-p x: fleetctl gives sudo its own prompt"),
    (("-A",), "askpass helper"),
    (("-Hu", "root"), "-u root: fleetctl gives -u itself: set ansible_become_user"),
    (("--user=svc",), "set ansible_become_user"),
    (("-b",), "in the background"),
    (("-l",), "sudo's list mode"),
    (("-h",), "sudo's help mode"),
    (("-H", "--"), "'--' is not a sudo option: sudo would take it, and all after it, as the command"),
    (("-H", "ls"), "'ls' is not a sudo option"),
    (("-i", "-s"), "-i with -s: sudo refuses"),
    (("-iE",), "-i with -E: sudo refuses"),
    (("--pre",), "ambiguous: it may be --preserve-env, --preserve-groups"),
    (("-g",), "-g needs a value"),
])
def test_become_flags_that_break_the_handshake_or_run_nothing_are_refused_with_why(flags, why):
    with pytest.raises(ValueError) as e:
        command.sudo_flags(flags, True)
    assert why in str(e.value)


@pytest.mark.parametrize("exe,want", [("", "sudo"), ("sudo", "sudo"), ("/usr/bin/sudo", "/usr/bin/sudo"),
                                      ("/opt/site/bin/sudo", "/opt/site/bin/sudo")])
def test_become_exe_sudo_anywhere(exe, want):
    assert command.become_exe(exe) == want


@pytest.mark.parametrize("exe,why", [
    ("doas", "it is not sudo: doas reads a password only from a terminal"),
    ("/usr/local/bin/pbrun", "it is not sudo: pbrun has no -S and no -p"),
    ("dzdo", "community.general.dzdo"),
    ("su", "it is not sudo: su takes none of sudo's options"),
    ("/usr/bin/mysudo", "a path whose last part is `sudo`"),
    ("bin/sudo", "it is a relative path"),
    ("sudo -E", "it holds options: it names the sudo program only; put the options in ansible_become_flags"),
])
def test_become_exe_not_sudo_is_refused_with_why(exe, why):
    with pytest.raises(ValueError) as e:
        command.become_exe(exe)
    assert why in str(e.value)


def test_become_argv_runs_the_named_sudo():
    wrapped, _ = command.remote_argv(["id"], 5)
    argv = command.become_argv(wrapped, "svc", ("-H",), "P:", "R", "/opt/site/bin/sudo")
    assert argv[:9] == ["/opt/site/bin/sudo", "-S", "-p", "P:", "-H", "-u", "svc", "--", "sh"]
    assert argv[-6:] == ["R", "timeout", "-k", "2", "5", "id"]


def _sudo_shell_mode(argv: list[str]) -> str:
    """The `-c` string sudo gives the shell that -i / -s start, made from the command's words as
    sudo 1.9 makes it (src/parse_args.c, "quote potential meta characters": a backslash before each
    character but letters, digits, `_`, `-` and `$`; the words joined with spaces)."""
    def escaped(word: str) -> str:
        return "".join(c if c.isascii() and (c.isalnum() or c in "_-$") else "\\" + c for c in word)
    return " ".join(escaped(w) for w in argv)


def test_a_shell_flag_keeps_every_word_through_the_shells_second_parse():
    words = ["printf", "[%s]\\n", "a$HOME", "b\nc", "", "q'\"`\\", "é ü", "$(id)", "--"]
    argv = command.become_argv(words, "svc", ("-i",), "P:", "fleetctl-ready-1", shell=True)
    after = argv[argv.index("--") + 1:]
    assert all(w and "$" not in w and "\n" not in w for w in after)  # what that parse would change
    line = _sudo_shell_mode(after)
    r = subprocess.run(["sh", "-c", line], capture_output=True, timeout=10)
    assert r.returncode == 0, r.stderr
    assert r.stderr == b"fleetctl-ready-1\n"
    assert r.stdout == b"[a$HOME]\n[b\nc]\n[]\n[q'\"`\\]\n[\xc3\xa9 \xc3\xbc]\n[$(id)]\n[--]\n"
    # and without the encoding the same parse loses `$` and the newline (why it is there)
    plain = command.become_argv(words, "svc", ("-i",), "P:", "fleetctl-ready-1")
    r = subprocess.run(["sh", "-c", _sudo_shell_mode(plain[plain.index("--") + 1:])], capture_output=True, timeout=10)
    assert r.stdout != b"[a$HOME]\n[b\nc]\n[]\n[q'\"`\\]\n[\xc3\xa9 \xc3\xbc]\n[$(id)]\n[--]\n"


# Stand-ins for sudo -S (case 01's fixture, first on PATH), each its own way of asking:
# `pam_prompt` a PAM module's own prompt instead of -p's; `otp` -p's, then a one-time code's.
STANDIN = r"""#!/bin/sh
p=
while [ $# -gt 0 ]; do case $1 in -p) p=$2; shift 2;; --) shift; break;; *) shift;; esac; done
case MODE in
pam_prompt) printf 'Password for svca@EXAMPLE.COM: ' >&2; read -r pw;;
otp) printf '%s' "$p" >&2; read -r pw; printf 'Verification code: ' >&2; read -r code;;
split) printf 'fleetctl-sudo-' >&2; sleep 0.6; printf '%s' "${p#fleetctl-sudo-}" >&2; read -r pw; exec "$@";;
said) printf 'Your password expires in 3 days.\n' >&2; sleep 0.6; printf '%s' "$p" >&2; read -r pw; exec "$@";;
esac
echo "sudo: 1 incorrect password attempt" >&2
exit 1
"""


def standin_host(tmp_path, monkeypatch, mode: str) -> Host:
    """Case 01's host (`ansible_connection: local`, become with password "pw"), its `sudo` the
    stand-in of `mode`, first on PATH."""
    bindir = tmp_path / mode
    bindir.mkdir()
    (bindir / "sudo").write_text(STANDIN.replace("MODE", mode))
    (bindir / "sudo").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:/usr/bin:/bin")
    return Host("sbx", MappingProxyType({"ansible_connection": "local", "ansible_become": True,
                                         "ansible_become_password": "pw"}), ("all",))


@pytest.mark.parametrize("mode,want", [
    ("pam_prompt", "sudo asked 'Password for svca@EXAMPLE.COM: ' instead of fleetctl's prompt"),
    ("otp", "sudo asked a second question ('Verification code: ') after fleetctl answered its password prompt"),
])
def test_case_01_a_prompt_of_its_own_is_reported_within_seconds_with_its_words(tmp_path, monkeypatch, mode, want):
    monkeypatch.setattr(base, "BECOME_QUESTION_QUIET_S", 0.5)  # the window is what is tested, not its 3 s
    conn = Session(Settings()).connect(standin_host(tmp_path, monkeypatch, mode))
    start = time.monotonic()
    with pytest.raises(BecomeFailed) as e:
        conn.run(["true"], 60)
    took = time.monotonic() - start
    assert str(e.value).startswith(want), str(e.value)
    assert base.BECOME_QUESTION_QUIET_S <= took < base.BECOME_QUESTION_QUIET_S + 2, took  # not the 60 s deadline
    if mode == "otp":
        assert "(OTP) is not supported" in str(e.value)
    else:
        assert "passprompt_override" in str(e.value) and "nothing was answered" in str(e.value)


@pytest.mark.parametrize("mode", ["split", "said"])
def test_a_marker_in_two_pieces_or_a_finished_line_is_no_question(tmp_path, monkeypatch, mode):
    """A pause longer than the quiet window inside fleetctl's own prompt (the start of the marker
    held back), or after a line sudo finished (a PAM message), is waited out: the password is
    given and the command runs."""
    monkeypatch.setattr(base, "BECOME_QUESTION_QUIET_S", 0.2)
    conn = Session(Settings()).connect(standin_host(tmp_path, monkeypatch, mode))
    r = conn.run(["sh", "-c", "cat"], 30, stdin=b"payload")
    assert (r.exit_code, r.stdout) == (0, b"payload")
