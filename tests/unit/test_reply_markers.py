"""Every reply fleetctl reads from a remote command is found by a marker, never by its place in
stdout (issue 52, a login shell that prints): the host lock's reply and its holder's, over the
local connection behind a stand-in for a login shell that prints a banner on stdout before it
runs the command (as bash does with a ~/.bashrc that echoes, for sshd's `bash -c`). Real
processes, a real flock."""

from __future__ import annotations

import time

import pytest

from fleetctl.connection import LockBusy, Session, Settings
from fleetctl.connection import command
from fleetctl.connection.local import LocalConnection, LocalProcess
from helpers.lab import local_host

BANNER = "Welcome to rack2\nLOCKED\nfleetctl-locked-0000 quota 91%"


class _PrintingShell(LocalConnection):
    """The local connection, every command run by a stand-in for a login shell that prints
    `banner` on stdout first (and with `runs` False, never runs the command: exit 1)."""

    banner, runs = BANNER, True

    def _start(self, argv, timeout):
        then = 'exec "$@"' if self.runs else "exit 1"
        return LocalProcess(["sh", "-c", f'printf "%s\\n" "$0"; {then}', self.banner, *argv])


def _conn(tmp_path, **kw) -> _PrintingShell:
    conn = _PrintingShell(local_host(tmp_path), Session(Settings()))
    for k, v in kw.items():
        setattr(conn, k, v)
    return conn


def test_reply_is_what_follows_the_marker_line_only():
    m = command.reply_marker("x")
    assert m.startswith("fleetctl-x-") and m != command.reply_marker("x")
    assert command.reply(f"{m}\nout\n".encode(), m) == b"out\n"
    assert command.reply(f"banner {m}\n{m}x\n{m}\n/usr/bin/python3\n".encode(), m) == b"/usr/bin/python3\n"
    assert command.reply(b"banner\n", m) is None and command.reply(f"{m}".encode(), m) is None


def test_framed_prints_the_marker_then_runs_the_words_as_given(tmp_path):
    m = command.reply_marker("which")
    r = _conn(tmp_path).run(command.framed(["printf", "%s|", "a b", "$HOME", "'"], m), timeout=10)
    assert r.stdout.startswith(BANNER.encode()) and command.reply(r.stdout, m) == b"a b|$HOME|'|"


def test_the_lock_is_taken_and_its_holder_named_past_a_banner(tmp_path):
    state = str(tmp_path / "state")
    t0 = time.monotonic()
    lock = _conn(tmp_path).hold_lock(state, timeout=10, hold_s=60)
    try:
        assert time.monotonic() - t0 < 5
        with pytest.raises(LockBusy, match=r"another fleetctl run is changing this host \(\S+ pid \d+ since "):
            _conn(tmp_path).hold_lock(state, timeout=10, hold_s=60)
    finally:
        lock.release()


def test_a_shell_that_never_runs_the_lock_is_named_with_what_it_printed(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(LockBusy) as e:
        _conn(tmp_path, banner="This account is currently not available.", runs=False).hold_lock(
            str(tmp_path / "state"), timeout=10, hold_s=60)
    assert time.monotonic() - t0 < 5
    said = str(e.value)
    # it ended at once: said so, not "within 10 s"
    assert "the lock command exited 1 and never said it held it" in said and " within " not in said, said
    assert "'This account is currently not available.'" in said
    assert "login shell" in said and "~/.bashrc" in said
