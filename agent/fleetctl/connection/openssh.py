"""`ansible_connection: ssh` (or `smart`): the system OpenSSH client, as Ansible's default
connection uses it. It verifies everything OpenSSH verifies (host certificates, FIDO keys,
GSSAPI, KnownHostsCommand...) because it is OpenSSH.

A per-run ssh_config (`ControlFiles.config_for`) sets ControlMaster/ControlPath/ControlPersist and
the run's StrictHostKeyChecking for every host and then `Include`s the user's config
(`--ssh-config`, else ~/.ssh/config of the passwd home and /etc/ssh/ssh_config), so ProxyJump's own
ssh processes share bastion masters too, and get the run's host-key policy (ProxyJump hands its
hop's ssh only -l, -p and -F). Every ssh fleetctl runs itself starts with fleetctl's host-key
option (hostkey_policy.ssh_options), before the host's ansible_ssh_common_args /
ansible_ssh_extra_args: OpenSSH keeps the first value, so the inventory cannot weaken it.
ControlPath is `<private 0700 dir under /tmp>/%C` (a unix socket path has 108 bytes at most).
The master is opened first (`ssh -M -N -f`, then `-O check`), so a connect or host-key failure is
`unreachable` before any command; where the user's own configuration already has a live master
for the host (their ControlMaster/ControlPath/ControlPersist: `ssh -O check` answers), commands go
over it instead and it is left running (unless that configuration turns host key checking off); a command's exit status travels in-band on stderr (ssh's own
255 cannot be told from the command's); close() runs `-O exit` for this host's master, and the
run's last cleanup (`ControlFiles.close`) for every master left, bastions included.
Every ssh fleetctl starts (masters, the ProxyCommand a master runs, commands, `-G`, `-O`) is in
a session of its own (`start_new_session`): a terminal's Ctrl-C reaches fleetctl only, which
lets the host in progress finish.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import re
import shutil
import stat
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from . import command, keyfiles, trace
from .base import Connection, OutputBuffer, Process
from .errors import AUTH_FIX, HostKeyRefused, Unreachable
from .hostkey_policy import ssh_options, strictness
from .local import LocalProcess
from .resolve import passwd_home, split_config_option

log = logging.getLogger("fleetctl")

# Seconds a master outlives its last client if fleetctl dies without closing it.
CONTROL_PERSIST_S = 60
# The in-band exit status line a remote command ends its stderr with (command.exit_status_line).
_EXIT_RE = re.compile(re.escape(command.EXIT_LINE_PREFIX) + rb"(\d+)\n?$")
# Bytes of the master's stderr kept for an error message.
_ERR_MAX = 2000
# The fix each of OpenSSH's own failure messages (ssh.c, sshconnect.c, sshconnect2.c) calls for:
# (words in ssh's stderr, the fix appended to its message); the first match wins.
_FIXES = (
    ("Connection refused", "is sshd listening there? check ansible_port (or Port in ssh_config) and ansible_host"),
    ("Could not resolve hostname", "check ansible_host (or HostName in ssh_config)"),
    ("not accessible: No such file", "fix ansible_ssh_private_key_file (or IdentityFile in ssh_config)"),
    ("no such identity", "fix ansible_ssh_private_key_file (or IdentityFile in ssh_config)"),
    ("Permission denied (", AUTH_FIX),
    ("timed out during banner exchange", "the banner phase stalled: sshd stopped or overloaded (MaxStartups), or no "
                                         "SSH server on that port: check ansible_port"),
    ("Connection timed out", "the connect phase stalled: host down, a firewall dropping packets, or the wrong "
                             "ansible_host?"),
)
# What OpenSSH prints when it refuses a host key, or (StrictHostKeyChecking no) connects anyway
# past a changed one (sshconnect.c).
_HOST_KEY_TROUBLE = ("Host key verification failed", "IDENTIFICATION HAS CHANGED", "REVOKED HOST KEY")


class ControlFiles:
    """The run's control directory (private, 0700, under /tmp) and its ssh_config: ControlMaster,
    ControlPath and ControlPersist for every host, BatchMode, and a host-key policy never weaker
    than accept-new, then the user's configuration by Include (OpenSSH keeps the first value it
    obtains, so these win)."""

    def __init__(self, user_config: Path | None, accept_new: bool):
        self.dir = Path(tempfile.mkdtemp(prefix="fc-", dir="/tmp"))
        self.user_config, self._accept_new = user_config, accept_new
        self._configs: dict[Path | None, Path] = {}
        self._lock = threading.Lock()
        self._hop_locks: dict[tuple, threading.Lock] = {}
        atexit.register(self.close)

    def config_for(self, host_config: Path | None) -> Path:
        """The run's ssh_config that Includes `host_config` (a host's own `-F FILE` from
        ansible_ssh_common_args / ansible_ssh_extra_args), else the user's configuration; one
        file per distinct configuration, all with the same control settings."""
        with self._lock:
            if host_config not in self._configs:
                includes = [host_config or self.user_config] if host_config or self.user_config else [
                    passwd_home() / ".ssh" / "config", Path("/etc/ssh/ssh_config")]
                path = self.dir / f"ssh_config-{len(self._configs)}"
                path.write_text(
                    "Host *\n"
                    "  ControlMaster auto\n"
                    f"  ControlPath {self.dir}/%C\n"
                    f"  ControlPersist {CONTROL_PERSIST_S}\n"
                    "  BatchMode yes\n"
                    f"  StrictHostKeyChecking {strictness(self._accept_new)}\n"
                    + "".join(f'  Include "{p}"\n' for p in includes))
                self._configs[host_config] = path
            return self._configs[host_config]

    def hop_lock(self, key: tuple) -> threading.Lock:
        """The lock that serialises opening the master to one ProxyJump hop (concurrent first
        connections with ControlMaster auto would each open their own)."""
        with self._lock:
            return self._hop_locks.setdefault(key, threading.Lock())

    def close(self) -> None:
        """`ssh -O exit` for every master still listening in the directory, then remove it
        (idempotent)."""
        with self._lock:
            if not self.dir.exists():
                return
            for sock in self.dir.iterdir():
                if sock.is_socket():
                    subprocess.run(["ssh", "-o", f"ControlPath={sock}", "-O", "exit", "fleetctl-master"],
                                   stdin=subprocess.DEVNULL, capture_output=True, timeout=10, start_new_session=True)
            shutil.rmtree(self.dir, ignore_errors=True)


def open_master(argv: list[str], destination: str, deadline: float, what: str, connect_timeout: float) -> None:
    """Start a master (`ssh -M -N -f`) for `destination` with the options of `argv` (an ssh
    command line without its destination), by `deadline` (time.monotonic(); `connect_timeout`:
    the seconds the whole connect was given, for the message). OpenSSH's stderr is read whatever
    its exit status: with StrictHostKeyChecking no, ssh connects past a changed host key and
    exits 0 after its "REMOTE HOST IDENTIFICATION HAS CHANGED" warning (OpenSSH sshconnect.c,
    check_host_key); that master is stopped (`-O exit`) and refused too (security review turn 3,
    N3). Raises HostKeyRefused (a refused or changed host key), Unreachable, naming `what` (with
    the fix _FIXES gives for OpenSSH's words)."""
    left = deadline - time.monotonic()
    with tempfile.TemporaryFile() as err:  # ssh -f keeps stderr open in the background: not a pipe
        try:
            r = subprocess.run([*argv, "-M", "-N", "-f", "-o", f"ConnectTimeout={max(1, math.ceil(left))}",
                                "--", destination],
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                               timeout=max(0.1, left), start_new_session=True)
        except subprocess.TimeoutExpired:
            raise Unreachable(f"{what}: no SSH session within the connect timeout ({connect_timeout:g} s)") from None
        err.seek(0)
        msg = err.read()[-_ERR_MAX:].decode("utf-8", "replace").replace("\r\n", "\n").strip()
    if any(t in msg for t in _HOST_KEY_TROUBLE):
        if r.returncode == 0:
            subprocess.run([*argv, "-O", "exit", "--", destination], stdin=subprocess.DEVNULL, capture_output=True,
                           timeout=10, start_new_session=True)
        raise HostKeyRefused(f"OpenSSH refused the host key of {what}: {msg}")
    if r.returncode != 0:
        fix = next((f for words, f in _FIXES if words in msg), None)
        raise Unreachable(f"cannot connect to {what} (ssh exit {r.returncode}): "
                          + (f"{msg.rstrip('.')}: {fix}" if fix else msg))


def users_master(path: str) -> str | None:
    """None when the user's own master at ControlPath `path` (as `ssh -G` expands it with the
    user's configuration) may be used: a socket owned by this euid, in a directory owned by this
    euid (or root) that neither group nor others can write; "" when there is none (`none`, nothing
    there); else why the one there is not used. OpenSSH's client does not check the master's owner
    (security review turn 3, N9: a socket another user planted would get the command and the
    client's stdin, stdout and stderr), so fleetctl does, with lstat (a link is never followed)."""
    if path == "none":
        return ""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return ""
    except OSError as e:
        return f"ControlPath {path}: {e.strerror}"
    me = os.geteuid()
    if not stat.S_ISSOCK(st.st_mode) or st.st_uid != me:
        return f"ControlPath {path} is not a socket of uid {me} (owner uid {st.st_uid}): not used"
    parent = os.path.dirname(os.path.abspath(path))
    st = os.lstat(parent)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid not in (me, 0) or st.st_mode & 0o022:
        return (f"ControlPath {path} lies in a directory of uid {st.st_uid}, mode "
                f"{stat.S_IMODE(st.st_mode):o} (others could replace the socket): not used")
    while parent != "/":  # above it: no one else may move it away (a sticky directory keeps what is ours)
        parent = os.path.dirname(parent)
        st = os.lstat(parent)
        if (not stat.S_ISDIR(st.st_mode) or st.st_uid not in (me, 0)
                or (st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX)):
            return (f"ControlPath {path} lies under {parent} (uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}), "
                    "which others could replace: not used")
    return None


class OpenSSHProcess(LocalProcess):
    """A command run over the host's master by a local `ssh` (see Process); the remote exit
    status comes from the in-band line, so a lost connection (ssh's 255, no line) is Unreachable,
    `lost_note` saying how a dead link is noticed."""

    def __init__(self, argv: list[str], lost_note: str):
        super().__init__(argv)
        self._lost_note = lost_note

    def communicate(self, stdin: bytes, deadline: float, out: OutputBuffer,
                    err: OutputBuffer) -> tuple[bytes, bytes, int]:
        out, err, code = super().communicate(stdin, deadline, out, err)
        m = _EXIT_RE.search(err)
        if m is None:
            said = err[-_ERR_MAX:].decode("utf-8", "replace").strip()
            raise Unreachable(f"connection lost during a command (ssh exit {code}; {self._lost_note})"
                              + (f": {said}" if said else ""))
        return out, err[:m.start()], int(m[1])


class OpenSSHConnection(Connection):
    """One host through the system `ssh`, over a ControlMaster this connection opens."""


    def __init__(self, host, session):
        super().__init__(host, session)
        self._address: str | None = None
        self._resolved = None
        self._master = False
        self._live = False
        self._user_cp = "none"
        # fleetctl's host-key option, first on every ssh command line (open() decides it per host)
        self._first = ["-o", f"StrictHostKeyChecking={strictness(self.settings.accept_new)}"]

    @property
    def address(self) -> str:
        return self._address or self.host.address

    def keepalive(self) -> tuple[float, int]:
        r = self._resolved
        if r is None or not r.server_alive_interval:
            return super().keepalive()
        return r.server_alive_interval, r.server_alive_count_max

    def _keepalive_options(self) -> list[str]:
        """ServerAliveInterval / ServerAliveCountMax for the master this connection opens, where
        the host's ssh_config sets no ServerAliveInterval (`ssh -G` prints 0): the settings'
        (ssh_config(5): the master sends them, and ends, taking every command with it, after
        that many go unanswered)."""
        if self._resolved is not None and self._resolved.server_alive_interval:
            return []
        interval, count = self.keepalive()
        return ["-o", f"ServerAliveInterval={max(1, math.ceil(interval))}", "-o", f"ServerAliveCountMax={count}"]

    def _config(self) -> tuple[str, list[str]]:
        """The run's ssh_config for this host and the host's ssh args without their `-F FILE`
        (which that ssh_config Includes instead: ssh keeps only the last `-F`)."""
        args, own = split_config_option([*self.host.ssh_common_args, *self.host.ssh_extra_args])
        return str(self.session.control_files.config_for(own)), args

    def _argv(self, *extra: str) -> list[str]:
        """ssh with fleetctl's host-key option first, then the host's ansible_ssh_common_args and
        ansible_ssh_extra_args, the run's ssh_config, then ansible_user / ansible_port /
        ansible_ssh_private_key_file (the order of resolve.ssh_g_argv after fleetctl's option,
        which sets nothing but StrictHostKeyChecking, so this ssh dials what `ssh -G` resolved)."""
        h = self.host
        config, args = self._config()
        opts = [["-o", f"{k}={v}"] for k, v in (("User", h.user), ("Port", h.port), ("IdentityFile", h.key_file)) if v]
        return ["ssh", *self._first, *args, "-F", config, *(w for o in opts for w in o), *extra]

    def _user_argv(self, *extra: str) -> list[str]:
        """ssh as the user's own configuration has it, without the run's ssh_config: fleetctl's
        host-key option first (a command whose master is gone connects by itself), the host's ssh
        args, its own `-F FILE` or the user's (`--ssh-config`; none: ssh's defaults), then
        ansible_user / ansible_port / ansible_ssh_private_key_file, BatchMode."""
        h = self.host
        args, own = split_config_option([*h.ssh_common_args, *h.ssh_extra_args])
        config = own or self.session.control_files.user_config
        opts = [["-o", f"{k}={v}"] for k, v in (("User", h.user), ("Port", h.port), ("IdentityFile", h.key_file)) if v]
        return ["ssh", *self._first, *args, *(["-F", str(config)] if config else []), *(w for o in opts for w in o),
                "-o", "BatchMode=yes", *extra]

    def open(self) -> None:
        """Resolve the host (`ssh -G`); when the user's configuration has a live master for it
        (`-O check` with that configuration) use that one; else open the masters of its ProxyJump
        hops (one per hop for the whole run, as ProxyJump's own `ssh -W` will use them) and its
        own (`ssh -M -N -f`), and check it (`-O check`), all within settings.connect_timeout seconds.
        Each of these ssh starts with fleetctl's host-key option for the host it dials
        (hostkey_policy.ssh_options: StrictHostKeyChecking no/off in its config or the inventory's
        args counts as accept-new, with a warning). Raises SshConfigError (exit 4: also an
        inventory that names where host keys are looked up), HostKeyRefused (ssh's host key
        verification failed), Unreachable."""
        started = time.monotonic()
        deadline = started + self.settings.connect_timeout
        h = self.host
        resolved = self._resolved = self.session.resolver.resolve_host(h, deadline)
        self._address = resolved.hostname
        trace.log.info(trace.dialled(h.name, "ssh (OpenSSH)", resolved))
        trace.log.info("%s: ssh -G %.3f s", h.name, time.monotonic() - started)
        self._first = ssh_options(resolved, self.settings.accept_new, h.name)
        self._user_cp = self._users_control_path(deadline)
        refused = users_master(self._user_cp)
        if refused:
            log.warning("fleetctl: %s: the master of your ssh configuration: %s", h.name, refused)
        if (not resolved.host_key_checking_off and refused is None
                and self._check(self._user_argv("--", h.address), deadline) is None):
            self._live = True  # the user's own live master: it verified the host key when it was opened
            return
        for i, hop in enumerate(resolved.proxy_jump):  # bastion masters first, one at a time each
            jump = ["-J", ",".join(map(str, resolved.proxy_jump[:i]))] if i else []
            opts = [*(["-l", hop.user] if hop.user else []), *(["-p", str(hop.port)] if hop.port else []), *jump]
            lock = self.session.control_files.hop_lock((*jump, *opts, hop.host))
            if not lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
                raise Unreachable(f"ProxyJump hop {hop}: no SSH session within the connect timeout")
            try:
                ssh = ["ssh", *ssh_options(resolved.hops[i], self.settings.accept_new, f"ProxyJump hop {hop}"),
                       "-F", self._config()[0], *opts]
                if self._check([*ssh, "--", hop.host], deadline) is not None:
                    open_master(ssh, hop.host, deadline, f"ProxyJump hop {hop}", self.settings.connect_timeout)
            finally:
                lock.release()
        try:
            open_master([*self._argv(), *self._keepalive_options()], h.address, deadline, self.address,
                        self.settings.connect_timeout)
        except Unreachable as e:  # a refused certificate on disk: say why (keyfiles.file_certificate_hint)
            hint = keyfiles.file_certificate_hint(resolved) if "Permission denied" in str(e) else ""
            if type(e) is not Unreachable or not hint:
                raise
            raise Unreachable(f"{e}; {hint}") from None
        self._master = True
        problem = self._check(self._argv("--", h.address), deadline)
        if problem is not None:
            raise Unreachable(f"the SSH master to {self.address} is not running: {problem}")
        trace.log.info("%s: connected (OpenSSH master) in %.3f s", h.name, time.monotonic() - started)

    def _users_control_path(self, deadline: float) -> str:
        """The ControlPath of the user's own configuration for this host, expanded (`ssh -G`
        with _user_argv's options; "none" when it sets none)."""
        r = subprocess.run([*self._user_argv("-G", "--", self.host.address)], stdin=subprocess.DEVNULL,
                           capture_output=True, text=True, timeout=max(1.0, deadline - time.monotonic()),
                           start_new_session=True)
        found = [line.split(None, 1)[1] for line in r.stdout.splitlines() if line.startswith("controlpath ")]
        return found[0].strip() if r.returncode == 0 and found else "none"

    @staticmethod
    def _check(argv: list[str], deadline: float) -> str | None:
        """None if the master `argv` (an ssh command line ending in its destination) names is
        running (`ssh -O check`), else ssh's message."""
        r = subprocess.run([*argv[:-2], "-O", "check", *argv[-2:]], stdin=subprocess.DEVNULL, capture_output=True,
                           timeout=max(1.0, deadline - time.monotonic()), start_new_session=True)
        return None if r.returncode == 0 else r.stderr[-_ERR_MAX:].decode("utf-8", "replace").strip()

    def _start(self, argv: list[str], timeout: float) -> Process:
        if self._live and users_master(self._user_cp) is not None:  # checked again before each use
            raise Unreachable(f"the master of your ssh configuration for {self.address} is no longer yours "
                              f"({users_master(self._user_cp) or 'gone'}): nothing sent over it")
        ssh = self._user_argv if self._live else self._argv
        interval, count = self.keepalive()
        return OpenSSHProcess(ssh("-T", "-o", "ControlMaster=no", "--", self.host.address,
                                  command.exit_status_line(argv)),
                              f"the master's keepalives: {count} unanswered, {interval:g} s apart, end it")

    def release(self) -> None:
        """Nothing now: the master this connection opened may carry the sessions of other
        inventory hosts of the run with the same address, port and user (one ControlPath, %C),
        whose jobs are still running; it holds no descriptor of this process, and the run's end
        (Session.close) ends it."""

    def close(self) -> None:
        """`ssh -O exit` for the master this connection opened (idempotent)."""
        if self._master:
            self._master = False
            subprocess.run(self._argv("-O", "exit", "--", self.host.address), stdin=subprocess.DEVNULL,
                           capture_output=True, timeout=10, start_new_session=True)
