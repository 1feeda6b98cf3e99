"""The interface every way of reaching a host implements, and the types that cross it.

Follows pyinfra's `connectors/base.py` and mitogen's transports: a connection kind is a small
class that only knows how to open a session and start one process over there (`_start`). Running
a command with input under a deadline, uploading a file and holding fleetctl's host lock are
written once, here, against that one primitive; every remote command line is built by
`command.remote_argv` (the deadline wrapper) and, for a host with ansible_become,
`command.become_argv`; the sudo password handshake is done here, once, for every kind. Nothing in this module imports paramiko, so a local-only run (the GPU host
itself) needs no paramiko.
"""

from __future__ import annotations

import hashlib
import math
import os
import pwd
import secrets
import socket
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path

from . import command
from .errors import BecomeFailed, LockBusy, OutputTooLarge, RemoteTimeout

# Bytes of the lock handshake read at most (a hostile host cannot make the controller hold more).
LOCK_HANDSHAKE_MAX = 4096
# Bytes of one command's stdout, and of its stderr, the controller holds at most (review M3):
# past it the command is stopped and OutputTooLarge raised.
OUTPUT_MAX = 64 << 20
# Bytes kept of a command whose output is only shown (handlers): its first and last halves.
TAIL_MAX = 1 << 20
# Exit status of the lock script when another run holds the lock (flock -E).
_LOCK_BUSY_EXIT = 75
# Exit status of the lock script when the state dir is not this login's (command._LOCK).
_LOCK_REFUSED_EXIT = 3
# Bytes of sudo's stderr read at most before the command starts (its prompt, lecture, refusal).
BECOME_HANDSHAKE_MAX = 8192
# Characters of sudo's message kept in an error.
_SUDO_SAID_MAX = 300
# Seconds sudo's stderr stays silent after an unfinished line (text no newline has ended yet)
# that is neither fleetctl's prompt nor its ready line, nor the start of one, before that line
# counts as a question sudo waits on in its own words (`Password for USER@REALM: `, a one-time
# code's `Verification code: `): sudo given -p asks every question of PAM's conversation with
# -p's prompt (-p turns on sudoers' passprompt_override: plugins/sudoers/policy.c, "prompt="),
# so such a question comes from a sudo auth method other than PAM, a module or plugin that
# writes its own text, or a program that is not quite sudo. A prompt is written with no
# newline and then read; sudo's lecture, PAM's messages and sudo's refusals each end with one,
# so they are never taken for a question. Long enough for the rest of a line split across
# packets on a slow link; far shorter than a host's deadline.
BECOME_QUESTION_QUIET_S = 3.0
# Characters of such a question kept in an error (then escaped: repr).
_QUESTION_MAX = 120
# Seconds the lock's holder waits past keepalive interval x count for a heartbeat before it counts
# the controller as gone (a busy control node's late heartbeat must not end a live run's lock).
LOCK_BEAT_SLACK_S = 5


@dataclass(frozen=True)
class Settings:
    """How to reach hosts, for every connection kind: plain data (the run's state built from
    it is a session.Session's).

    connect_timeout: seconds for `ssh -G`, TCP connect, banner, key exchange and auth together
      (every ProxyJump hop included).
    accept_new: store unknown host keys (OpenSSH's StrictHostKeyChecking=accept-new).
    ssh_config: the ssh_config file OpenSSH reads instead of the user's `~/.ssh/config` (passwd
      home) and /etc/ssh/ssh_config (`ssh -F`); None: those two.
    server_alive_interval / server_alive_count_max: keepalive defaults (seconds, count) where
      the ssh_config sets no ServerAliveInterval / ServerAliveCountMax.
    connection: the connection kind of hosts whose inventory sets no ansible_connection (`-c`,
      which host variables override, as in Ansible); None: paramiko.
    become_password: the sudo password of hosts whose inventory sets no ansible_become_password
      (`--ask-become-pass`, -K); never in repr. None: none given.
    """

    connect_timeout: float = 10.0
    accept_new: bool = False
    ssh_config: Path | None = None
    server_alive_interval: float = 15.0
    server_alive_count_max: int = 3
    connection: str | None = None
    become_password: str | None = field(default=None, repr=False)


@dataclass
class Result:
    """A finished remote command: exit status, raw output bytes and wall time in seconds."""

    exit_code: int
    stdout: bytes
    stderr: bytes
    elapsed_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


class OutputBuffer:
    """One output stream of a command, never more than `limit` bytes held: with `keep_ends`,
    the first and last limit/2 bytes and a line saying how many were dropped between them;
    without, add() raises OutputTooLarge ("output over N MiB from WHAT") past the limit."""

    def __init__(self, limit: int, what: str, keep_ends: bool = False):
        self.limit, self.what, self.keep_ends = limit, what, keep_ends
        self.head, self.tail, self.dropped = bytearray(), bytearray(), 0

    def add(self, chunk: bytes) -> None:
        """Take the next bytes read from the stream."""
        if not self.keep_ends:
            if len(self.head) + len(chunk) > self.limit:
                raise OutputTooLarge(f"output over {self.limit >> 20} MiB from {self.what}")
            self.head += chunk
            return
        half = self.limit // 2
        room = half - len(self.head)
        self.head += chunk[:max(room, 0)]
        self.tail += chunk[max(room, 0):]
        if len(self.tail) > half:
            self.dropped += len(self.tail) - half
            del self.tail[:len(self.tail) - half]

    def value(self) -> bytes:
        """What was kept."""
        gap = f"\n[... {self.dropped} bytes of output dropped ...]\n".encode() if self.dropped else b""
        return bytes(self.head) + gap + bytes(self.tail)


class Process(ABC):
    """One process started over there by a connection kind."""

    @abstractmethod
    def communicate(self, stdin: bytes, deadline: float, stdout: OutputBuffer,
                    stderr: OutputBuffer) -> tuple[bytes, bytes, int]:
        """Send `stdin` then EOF, read stdout and stderr to the end into the two buffers (which
        bound them), and return what they kept with the exit status (-1: killed by a signal).
        `deadline` is a time.monotonic() value. Raises RemoteTimeout past the deadline,
        Unreachable when the connection is lost, OutputTooLarge from a buffer."""

    @abstractmethod
    def read_out(self, limit: int, timeout: float) -> bytes:
        """The stdout bytes that arrive next (at most `limit`; b"" at EOF or after `timeout`
        seconds). stdin stays open. For the lock's reply, before `communicate`."""

    @abstractmethod
    def read_err(self, limit: int, timeout: float) -> bytes:
        """The stderr bytes that arrive next (at most `limit`; b"" at EOF or after `timeout`
        seconds). For the become handshake, before `communicate`."""

    @abstractmethod
    def write(self, data: bytes) -> None:
        """Send `data` on stdin, which stays open. Raises Unreachable when the connection is lost."""

    @abstractmethod
    def wait(self, timeout: float) -> int | None:
        """The exit status within `timeout` seconds, else None."""

    @abstractmethod
    def close(self) -> None:
        """Close stdin and the process's channel (idempotent): the process sees EOF."""


class Connection(ABC):
    """A connection to one inventory host. Subclasses implement open, close, address and
    _start; run, put_bytes and hold_lock are the same for every kind."""

    # words every command starts with over there (a container connection's entry; none on a host)
    prefix: tuple[str, ...] = ()
    # whether a probe's interpreter is checked by the command that starts it (root runs it:
    # probes/trust.py GUARD, engine/context.HostContext.probe)
    checks_interpreters = True

    def __init__(self, host, session):
        """`host`: the inventory host; `session`: the run's session.Session (its settings and
        the state every connection of the run shares)."""
        self.host = host
        self.session = session
        self.settings: Settings = session.settings
        # the lock.groups file of the lock held over this connection: commands register there
        self._tied: str | None = None

    @property
    def python(self) -> str | None:
        """The interpreter probes run under when the job names none: the inventory's
        (ansible_python_interpreter / fleetctl_python), None for python3 on PATH."""
        return self.host.python

    def keepalive(self) -> tuple[float, int]:
        """(seconds between keepalives, unanswered ones that end the connection): the host's
        ssh_config ServerAliveInterval / ServerAliveCountMax where set, else the settings'."""
        return self.settings.server_alive_interval, self.settings.server_alive_count_max

    @property
    @abstractmethod
    def address(self) -> str:
        """The address actually reached (after ssh_config's HostName), for reports."""

    @abstractmethod
    def open(self) -> None:
        """Connect within settings.connect_timeout seconds. Raises Unreachable (HostKeyRefused
        for a refused host key)."""

    @abstractmethod
    def close(self) -> None:
        """Close the connection and everything started over it (idempotent)."""

    def release(self) -> None:
        """The run's last job on this host ended: free what the connection holds now (close),
        where nothing else of the run can be using it."""
        self.close()

    @abstractmethod
    def _start(self, argv: list[str], timeout: float) -> Process:
        """Start `argv` (already wrapped by command.remote_argv) over there, within `timeout`
        seconds. Raises Unreachable, RemoteTimeout."""

    def _begin(self, argv: list[str], timeout: float, start_s: float | None = None) -> tuple[Process, bytes, int]:
        """Start `argv` under the deadline wrapper of `timeout` seconds (and, for a host with
        ansible_become, under sudo, its password handshake done), within `start_s` seconds
        (default: the whole deadline): (the process, stderr it already wrote, the whole seconds
        it may run). Raises BecomeFailed, RemoteTimeout, Unreachable."""
        wrapped, limit = command.remote_argv([*self.prefix, *argv], timeout, self._tied)
        start_s = limit if start_s is None else start_s
        if not self.host.become:
            return self._start(wrapped, start_s), b"", limit
        password = self.host.become_password
        if password is None:
            password = self.settings.become_password
        prompt = f"fleetctl-sudo-{secrets.token_hex(8)}:"
        ready = f"fleetctl-ready-{secrets.token_hex(8)}"
        proc = self._start(self._become_argv(wrapped, prompt, ready, password is not None), start_s)
        try:
            rest = self._answer_sudo(proc, prompt.encode(), ready.encode() + b"\n", password,
                                     time.monotonic() + start_s)
        except BaseException:
            proc.close()
            raise
        return proc, rest, limit

    def _become_argv(self, wrapped: list[str], prompt: str, ready: str, password: bool) -> list[str]:
        """command.become_argv of `wrapped` for this host's ansible_become_exe and
        ansible_become_flags (command.become_exe, command.sudo_flags; `password`: whether one is
        given). Raises BecomeFailed, before anything starts, for a value fleetctl does not run,
        naming the var, the file:line it was set at (Host.where) and why."""
        host = self.host
        var = "ansible_become_exe"
        try:
            exe = command.become_exe(host.become_exe)
            var = "ansible_become_flags"
            flags, shell = command.sudo_flags(host.become_flags, password)
        except ValueError as e:
            where = host.where.get(var)
            raise BecomeFailed(f"{where + ': ' if where else ''}{var} {host.vars.get(var)!r}: {e}") from None
        return command.become_argv(wrapped, host.become_user, flags, prompt, ready, exe, shell)

    def _answer_sudo(self, proc: Process, prompt: bytes, ready: bytes, password: str | None,
                     deadline: float) -> bytes:
        """Read sudo's stderr until the command's `ready` line (return what follows it). The
        `password` is written once, and only after sudo's own `prompt` arrived: with NOPASSWD or
        a cached sudo it would otherwise reach the command's stdin. Never a pty (sudo -S).
        Raises BecomeFailed with sudo's words: the prompt again (after a message: the password
        was refused; with none: a second question asked with fleetctl's prompt), a question of
        its own (an unfinished line, then BECOME_QUESTION_QUIET_S seconds of silence: a PAM
        module's prompt, or a second question after the password), no password to give, sudo
        exiting (no rights, `Defaults requiretty`); RemoteTimeout at `deadline`."""
        said, unread, answered = b"", b"", False  # unread: what sudo wrote since fleetctl last answered
        heard = time.monotonic()
        while True:
            at = unread.find(ready)
            if at >= 0:
                return unread[at + len(ready):]
            if prompt in unread:
                before, _, unread = unread.partition(prompt)
                if answered and before.strip():
                    raise BecomeFailed(f"sudo refused the password: {_sudo_said(before, prompt)}")
                if answered:  # nothing between: not a refusal (sudo says one), the next PAM question
                    raise BecomeFailed(_second_question(None, _sudo_said(said, prompt)))
                if password is None:
                    raise BecomeFailed("sudo asked for a password and none was given: set "
                                       "ansible_become_password (vault it) or run with --ask-become-pass (-K)")
                proc.write(password.encode() + b"\n")
                answered, said = True, said + before
                continue
            now = time.monotonic()
            if now >= deadline:
                told = _sudo_said(said + unread, prompt)
                raise RemoteTimeout("sudo did not start the command by its deadline"
                                    + (f" (sudo said: {told})" if told else ""))
            asked = _question(unread, (prompt, ready))
            quiet = bool(asked) and now - heard >= BECOME_QUESTION_QUIET_S
            if quiet and proc.wait(0) is None:
                earlier = _sudo_said(said + unread[:-len(asked)], prompt)
                if answered:
                    raise BecomeFailed(_second_question(asked, earlier))
                raise BecomeFailed(self._own_prompt(asked, earlier))
            wait = deadline - now if not asked else min(deadline - now, heard + BECOME_QUESTION_QUIET_S - now)
            gone = quiet or len(said) + len(unread) >= BECOME_HANDSHAKE_MAX  # exited, or said too much
            chunk = b"" if gone else proc.read_err(BECOME_HANDSHAKE_MAX, wait)
            if chunk:
                unread, heard = unread + chunk, time.monotonic()
                continue
            if gone or time.monotonic() - now < wait - 0.01:  # b"" before the wait was over: EOF, sudo is gone
                told = _sudo_said(said + unread, prompt)
                if "must have a tty" in told:
                    raise BecomeFailed("sudo requires a tty (Defaults requiretty)")
                raise BecomeFailed(f"sudo did not run the command: {told or 'no message'}")

    def _own_prompt(self, asked: bytes, earlier: str) -> str:
        """The error for a question sudo asked in its own words (`asked`) where fleetctl's prompt
        was expected, after `earlier` (what sudo said before it)."""
        login = self.host.user or "LOGIN"
        return (f"sudo asked {_quoted(asked)} instead of fleetctl's prompt"
                + (f" (after: {earlier})" if earlier else "")
                + f": a prompt of its own (a PAM module or a sudo auth method asking in its own words); "
                f"nothing was answered (waited {BECOME_QUESTION_QUIET_S:g} s). sudoers' "
                f"`Defaults:{login} passprompt_override` makes sudo ask with fleetctl's prompt where the "
                "question goes through PAM's conversation (sudo's -p turns it on); otherwise let this login "
                "sudo without that question (the PAM stack sudo uses) or with NOPASSWD")

    def run(self, argv: list[str], timeout: float, stdin: bytes = b"", what: str | None = None,
            keep_ends: bool = False) -> Result:
        """Run `argv` (a list of words, never a shell string) with `stdin` bytes then EOF, killed
        over there (the whole process group) if it outlives `timeout` seconds; as the become
        user when the host has ansible_become. Each output stream is held to OUTPUT_MAX bytes,
        or with `keep_ends` to its first and last TAIL_MAX/2. `what` names the command in errors
        (default: its first word).
        Raises RemoteTimeout at the deadline, Unreachable if the connection is lost,
        OutputTooLarge (the command is stopped), BecomeFailed when sudo does not start it."""
        what = what or repr(argv[0])
        size = TAIL_MAX if keep_ends else OUTPUT_MAX
        start = time.monotonic()
        proc, early_err, limit = self._begin(argv, timeout)
        try:
            out, err, code = proc.communicate(stdin, start + limit + command.KILL_AFTER_S + 3,
                                              OutputBuffer(size, what, keep_ends), OutputBuffer(size, what, keep_ends))
        finally:
            proc.close()
        elapsed = time.monotonic() - start
        if code in command.TIMEOUT_EXITS and elapsed >= limit - 0.5:
            raise RemoteTimeout(f"remote command ran past its deadline of {limit} s and was killed on the host")
        return Result(code, out, early_err + err, elapsed)

    def put_bytes(self, data: bytes, remote_path: str, timeout: float, mode: int = 0o644) -> None:
        """Write `data` to `remote_path` over there: sent on the stdin of a command that writes a
        private temp file beside it, checks its sha256 and renames it into place (the parent
        directories are created). Raises RemoteTimeout, Unreachable, OSError (the host's refusal:
        permission denied, no space left, a bad upload)."""
        r = self.run(command.upload_argv(remote_path, mode, hashlib.sha256(data).hexdigest()), timeout, stdin=data)
        if not r.ok:
            raise OSError(f"upload to {remote_path} failed (exit {r.exit_code}): "
                          f"{r.stderr.decode('utf-8', 'replace').strip()[-300:]}")

    def hold_lock(self, state_dir: str, timeout: float, hold_s: float) -> "HostLock":
        """Take fleetctl's per-host lock (flock on STATE_DIR/lock) for as long as it is held,
        and at most `hold_s` seconds.

        The lock is held by a remote `flock` whose child reads heartbeat bytes on its stdin
        (HostLock sends one every keepalive interval): releasing, losing the connection, this
        process dying, no heartbeat for keepalive interval x count + LOCK_BEAT_SLACK_S seconds
        (a cut link or a dead control node that sshd does not notice), or `hold_s` passing
        frees it. On a host (not in a container), every command this connection runs while the
        lock is held is registered with it, and whatever of them still runs when the lock ends
        is stopped by its process group: nothing of a dead controller's run outlives its lock.
        The lock command's reply, and its holder's, are found by their markers (command.reply):
        what a login shell's startup files print first is passed over, and named when no marker
        came. Raises LockBusy at once when another run holds it (quoting who and since when), or
        when it cannot be taken within `timeout` seconds; Unreachable, RemoteTimeout."""
        who = f"{_controller()} pid {os.getpid()}"
        hold = max(1, math.ceil(hold_s))
        token = secrets.token_hex(8)
        proc, _, _ = self._begin(self._lock_argv(state_dir, who, hold, self.lock_beat_s(), token), hold + timeout,
                                 timeout)
        end, marker = time.monotonic() + timeout, command.lock_marker(token)
        seen = _read_until(proc, marker, end)  # by its marker: a login shell may print first
        if command.reply(seen, marker) is not None:
            if not self.prefix:
                self._tied = command.lock_groups(state_dir, token)
            return HostLock(proc, self, self.keepalive()[0])
        code = proc.wait(max(1.0, end - time.monotonic()))
        said = _sudo_said(proc.read_err(LOCK_HANDSHAKE_MAX, 1.0), b"") if code != _LOCK_BUSY_EXIT else ""
        proc.close()
        if code == _LOCK_BUSY_EXIT:
            who = self._lock_holder(state_dir, seen, token, timeout)
            raise LockBusy(f"another fleetctl run is changing this host ({who or 'holder unknown'})", holder=who)
        if code == _LOCK_REFUSED_EXIT:  # the state dir is not this login's: the script said why
            raise LockBusy(f"could not take the lock {state_dir}/lock: {said}")
        ended = (f"the lock command exited {code} and never said it held it" if code is not None else
                 f"within {timeout:g} s the lock command never said it held it (it still ran)")
        raise LockBusy(f"could not take the lock {state_dir}/lock: {ended}; {command.unframed(seen, marker)}"
                       + (f"; its stderr: {said}" if said else ""))

    def lock_beat_s(self) -> int:
        """Seconds without a heartbeat after which the lock's holder counts this controller as
        gone: keepalive interval x count (rounded up) + LOCK_BEAT_SLACK_S."""
        interval, count = self.keepalive()
        return math.ceil(interval * count) + LOCK_BEAT_SLACK_S

    def _lock_argv(self, state_dir: str, who: str, hold_s: int, beat_s: int, token: str) -> list[str]:
        """The lock command (command.lock_argv: flock, with a shell and coreutils)."""
        return command.lock_argv(state_dir, who, hold_s, beat_s, token)

    def _lock_holder(self, state_dir: str, seen: bytes, token: str, timeout: float) -> str:
        """Who holds the lock, from STATE_DIR/lock.owner, read by a command of its own whose reply
        is framed by a marker (`seen`: the lock command's stdout; `token`: its hold's)."""
        marker = command.reply_marker("owner")
        holder = self.run(command.framed(["cat", "--", f"{state_dir}/lock.owner"], marker), timeout=timeout)
        owner = command.reply(holder.stdout[:LOCK_HANDSHAKE_MAX], marker)
        return "" if owner is None else owner.decode("utf-8", "replace").strip()


def _controller() -> str:
    """USER@HOST of this control node, as a lock's owner line names it."""
    return f"{os.environ.get('USER') or pwd.getpwuid(os.getuid()).pw_name}@{socket.gethostname()}"


def gone_holder(holder: str) -> int | None:
    """The pid of a lock's holder (LockBusy.holder, "USER@HOST pid N since TIME") when it names
    this control node (the same USER@HOST) and no process N runs here: a run of this node that
    ended while the host could not hear it (its link cut), whose remote holder lives on until its
    heartbeats stop (hold_lock). None for a holder that runs, another node's, or a line that
    does not parse: such a lock is busy. A pid reused since, or a holder in another pid namespace
    under the same name, reads as running or gone; either only bounds a wait (changes.locked)."""
    words = holder.split()
    if len(words) < 3 or words[0] != _controller() or words[1] != "pid" or not words[2].isdigit():
        return None
    pid = int(words[2])
    if pid <= 1 or pid == os.getpid():
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return pid
    except PermissionError:  # it runs, as someone else
        return None
    return None


def _read_until(proc: Process, marker: str, end: float) -> bytes:
    """`proc`'s stdout until a line `marker` came (what follows it in the same read included),
    EOF, LOCK_HANDSHAKE_MAX bytes, or time.monotonic() `end`."""
    seen = b""
    while command.reply(seen, marker) is None and len(seen) < LOCK_HANDSHAKE_MAX:
        left = end - time.monotonic()
        chunk = proc.read_out(LOCK_HANDSHAKE_MAX - len(seen), left) if left > 0 else b""
        if not chunk:
            break
        seen += chunk
    return seen


def _question(unread: bytes, markers: tuple[bytes, ...]) -> bytes:
    """The unfinished last line of `unread` (no newline after it yet), unless it is blank or
    could still become one of `markers` (it ends with the start of one); else b""."""
    line = unread.rpartition(b"\n")[2]
    if not line.strip():
        return b""
    for m in markers:
        if any(m.startswith(line[k:]) for k in range(max(0, len(line) - len(m)), len(line))):
            return b""
    return line


def _quoted(text: bytes) -> str:
    """`text` from a host as a bounded, escaped Python string literal (repr: quotes, no control
    characters), cut to _QUESTION_MAX characters."""
    s = text.decode("utf-8", "replace")
    return repr(s[:_QUESTION_MAX]) + ("..." if len(s) > _QUESTION_MAX else "")


def _second_question(asked: bytes | None, earlier: str) -> str:
    """The error for a question sudo asked after fleetctl had answered its password prompt:
    `asked` in its own words, or None for fleetctl's prompt once more with no refusal before it
    (sudo asks each PAM question with -p's prompt); `earlier`: what sudo said before."""
    what = (_quoted(asked) if asked else
            "fleetctl's prompt once more, with no refusal before it: sudo asks each PAM question with -p's prompt")
    return (f"sudo asked a second question ({what}) after fleetctl answered its password prompt"
            + (f" (after: {earlier})" if earlier else "")
            + ": a one-time code or other second factor (OTP) is not supported: let this login sudo "
            "with the password alone (the PAM stack sudo uses), or give it NOPASSWD")


def _sudo_said(seen: bytes, prompt: bytes) -> str:
    """What sudo wrote on stderr, as one bounded line of printable text: its prompts and the
    in-band exit line (command.exit_status_line) taken out, anything else unprintable as `?`."""
    text = seen.split(command.EXIT_LINE_PREFIX)[0].replace(prompt, b"").decode("utf-8", "replace")
    text = " ".join("".join(c if c.isprintable() else "?" for c in line) for line in text.split())
    return text[-_SUDO_SAID_MAX:]


class HostLock:
    """fleetctl's lock on one host, held while the remote flock's process runs (see
    Connection.hold_lock), kept alive by a heartbeat byte every `interval` seconds."""

    def __init__(self, proc: Process, conn: Connection, interval: float):
        self._proc, self._conn = proc, conn
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, args=(interval,), daemon=True,
                                      name=f"fleetctl-lock-{conn.host.name}")
        self._beat.start()

    def _heartbeat(self, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                self._proc.write(b".")
            except Exception:  # noqa: BLE001 - a lost connection: the holder ends by itself
                return

    def release(self) -> None:
        """Release the lock: closing the process's stdin ends the remote flock, and the
        connection's commands are no longer registered with it (idempotent)."""
        self._stop.set()
        self._conn._tied = None
        self._proc.close()
