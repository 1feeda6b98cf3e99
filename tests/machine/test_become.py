"""Become without a lab: the inventory vars, and the sudo handshake on this machine (root, whom
sudo never asks for a password: the command must get exactly its own stdin, never the password)."""

from __future__ import annotations

from types import MappingProxyType

import pytest

from fleetctl.connection import BecomeFailed, Session, Settings, command
from fleetctl.errors import InventoryError
from fleetctl.inventory import Host, load


def write(tmp_path, text):
    path = tmp_path / "hosts.yaml"
    path.write_text(text)
    return path


def test_become_vars_on_host(tmp_path):
    inv = load(write(tmp_path, "all:\n  hosts:\n    a:\n      ansible_become: 'yes'\n"
                               "      ansible_become_flags: -E -H\n      ansible_become_pass: pw\n"
                               "    b:\n      ansible_become: false\n      ansible_become_user: svc\n"))
    a, b = inv.hosts["a"], inv.hosts["b"]
    assert (a.become, a.become_user, a.become_flags, a.become_password) == (True, "root", ("-E", "-H"), "pw")
    assert (b.become, b.become_user, b.become_password) == (False, "svc", None)
    assert "'pw'" not in repr(a) and "ansible_become_pass" not in repr(a)  # logs, tracebacks


def test_other_become_method_is_exit_4_with_file_and_line(tmp_path):
    path = write(tmp_path, "all:\n  hosts:\n    a:\n      ansible_become: true\n      ansible_become_method: su\n")
    with pytest.raises(InventoryError) as e:
        load(path)
    assert f"{path}:5:" in str(e.value) and "ansible_become_method 'su'" in str(e.value)
    assert e.value.exit_code == 4


def test_a_bad_become_password_value_is_never_printed(tmp_path):
    path = write(tmp_path, "all:\n  vars:\n    pw: [hunter2x]\n  hosts:\n    a:\n"
                           "      ansible_become_password: '{{ pw }}'\n")
    with pytest.raises(InventoryError) as e:
        load(path)
    assert f"{path}:6:" in str(e.value) and "hunter2x" not in str(e.value)


def test_become_argv_puts_sudo_outside_the_deadline_wrapper():
    wrapped, _ = command.remote_argv(["id"], 5)
    argv = command.become_argv(wrapped, "svc", ("-E",), "P:", "R")
    assert argv[:7] == ["sudo", "-S", "-p", "P:", "-E", "-u", "svc"]
    assert argv[-5:] == ["timeout", "-k", "2", "5", "id"]
    with pytest.raises(ValueError):
        command.become_argv(wrapped, "svc", (), "50%p", "R")


def test_no_prompt_means_the_password_never_reaches_the_command():
    host = Host("here", MappingProxyType({"ansible_connection": "local", "ansible_become": True,
                                         "ansible_become_user": "nobody",
                                         "ansible_become_password": "pw-must-not-leak"}), ("all",))
    conn = Session(Settings()).connect(host)
    r = conn.run(["sh", "-c", "id -un; echo on-stderr >&2; cat"], 10, stdin=b"payload")
    assert (r.exit_code, r.stdout, r.stderr) == (0, b"nobody\npayload", b"on-stderr\n")
    bad = Host("here", MappingProxyType({**host.vars, "ansible_become_user": "no-such-user-fleetctl"}), ("all",))
    with pytest.raises(BecomeFailed, match="unknown user"):
        Session(Settings()).connect(bad).run(["true"], 10)
