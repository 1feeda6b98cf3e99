"""One SSH connection per host (Fabric over paramiko): deadlines, host-key policy, run, put, lock.

Everything fleetctl does to a host goes through `HostConnection`: it is opened once per run and
reused for every command, probe and upload to that host.

Host keys are always verified: keys come from ~/.ssh/known_hosts and the UserKnownHostsFile of
~/.ssh/config; an unknown key is refused unless `accept_new` (then it is appended, as OpenSSH's
StrictHostKeyChecking=accept-new does); a changed key is always refused with both fingerprints.
Fabric itself installs paramiko's AutoAddPolicy, so the policy is replaced explicitly here.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import math
import os
import select
import shlex
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import fabric
import paramiko

from .inventory import Host

# paramiko logs failed handshakes with tracebacks on stderr; fleetctl reports each host's error itself.
logging.getLogger("paramiko").setLevel(logging.CRITICAL)

# Exit status of coreutils `timeout` when the command ran past its deadline (124), or needed the
# follow-up SIGKILL (128 + 9).
_TIMEOUT_EXITS = (124, 137)
# Seconds between the remote `timeout`'s SIGTERM and its SIGKILL.
_KILL_AFTER_S = 2


class Unreachable(Exception):
    """The host could not be connected to or authenticated with (Ansible's "unreachable")."""


class HostKeyRefused(Unreachable):
    """The host's key is unknown (without accept_new) or differs from known_hosts; nothing was run."""


class RemoteTimeout(Exception):
    """A remote command ran past its deadline; it was killed on the host."""


@dataclass(frozen=True)
class SSHSettings:
    """How to reach hosts.

    connect_timeout: seconds for TCP connect + banner + key exchange + auth together.
    accept_new: store unknown host keys instead of refusing them.
    known_hosts: known_hosts files to use instead of ~/.ssh/known_hosts (tests, odd setups).
    """

    connect_timeout: float = 10.0
    accept_new: bool = False
    known_hosts: tuple[Path, ...] = ()


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


def fingerprint(key: paramiko.PKey) -> str:
    """OpenSSH-style SHA256 fingerprint of a host key, e.g. 'ssh-ed25519 SHA256:abc...'."""
    digest = base64.b64encode(hashlib.sha256(key.asbytes()).digest()).decode().rstrip("=")
    return f"{key.get_name()} SHA256:{digest}"


class _RefuseUnknown(paramiko.MissingHostKeyPolicy):
    def missing_host_key(self, client, hostname, key):
        raise HostKeyRefused(
            f"unknown host key for {hostname} ({fingerprint(key)}); verify it and add it to "
            "known_hosts, or pass --accept-new to store it on first use"
        )


@dataclass
class _AcceptNew(paramiko.MissingHostKeyPolicy):
    """Store a host key seen for the first time (OpenSSH accept-new); a changed key still fails."""

    path: Path
    lock: threading.Lock = field(default_factory=threading.Lock)

    def missing_host_key(self, client, hostname, key):
        client.get_host_keys().add(hostname, key.get_name(), key)
        with self.lock:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            with open(self.path, "a") as f:
                f.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")


_ACCEPT_LOCK = threading.Lock()


class HostConnection:
    """A verified SSH connection to one inventory host.

    Connection settings layer as Fabric does: ~/.ssh/config (HostName, User, Port, IdentityFile,
    ProxyJump) first, then the inventory's ansible_user / ansible_port /
    ansible_ssh_private_key_file on top.
    """

    def __init__(self, host: Host, settings: SSHSettings):
        self.host = host
        self.settings = settings
        connect_kwargs = {
            "banner_timeout": settings.connect_timeout,
            "auth_timeout": settings.connect_timeout,
            "channel_timeout": settings.connect_timeout,
        }
        if host.key_file:
            connect_kwargs["key_filename"] = [host.key_file]
        self._conn = fabric.Connection(
            host.address,
            user=host.user,
            port=host.port,
            connect_timeout=max(1, math.ceil(settings.connect_timeout)),
            connect_kwargs=connect_kwargs,
        )
        # ProxyJump hops are Connections of their own (Fabric builds them from ~/.ssh/config):
        # each one gets the same host-key policy as the target.
        conn = self._conn
        while isinstance(conn, fabric.Connection):
            self._verify_host_keys(conn)
            conn = conn.gateway

    def _verify_host_keys(self, conn: fabric.Connection) -> None:
        """Load known_hosts into `conn`'s client and replace Fabric's AutoAddPolicy."""
        configured = conn.ssh_config.get("userknownhostsfile")
        if self.settings.known_hosts:
            files = list(self.settings.known_hosts)
        elif configured:
            files = [Path(os.path.expanduser(p)) for p in shlex.split(configured)]
        else:
            files = [Path(os.path.expanduser("~/.ssh/known_hosts"))]
        for path in files:
            if path.exists():
                conn.client.get_host_keys().load(str(path))
        if self.settings.accept_new:
            conn.client.set_missing_host_key_policy(_AcceptNew(files[0], _ACCEPT_LOCK))
        else:
            conn.client.set_missing_host_key_policy(_RefuseUnknown())

    @property
    def address(self) -> str:
        """The address actually dialled (after ~/.ssh/config's HostName)."""
        return self._conn.host

    def open(self) -> None:
        """Connect, verify the host key and authenticate within settings.connect_timeout seconds.

        The deadline holds even where paramiko would block (sshd that accepts TCP but never sends
        a banner, an agent that never answers): a watchdog closes the transport at the deadline.
        Raises HostKeyRefused (unknown or changed key) or Unreachable (anything else).
        """
        deadline_hit = threading.Event()

        def watchdog():
            deadline_hit.set()
            conn = self._conn
            while isinstance(conn, fabric.Connection):  # the target and every ProxyJump hop
                transport = conn.client.get_transport()
                if transport is not None:
                    transport.close()
                conn = conn.gateway

        timer = threading.Timer(self.settings.connect_timeout, watchdog)
        timer.daemon = True
        timer.start()
        try:
            self._conn.open()
        except HostKeyRefused:
            raise
        except paramiko.BadHostKeyException as e:
            raise HostKeyRefused(
                f"HOST KEY CHANGED for {e.hostname}: known_hosts has {fingerprint(e.expected_key)}, "
                f"the host offered {fingerprint(e.key)}. Possible man-in-the-middle; nothing was run. "
                "If the change is expected, remove the old key (ssh-keygen -R) and retry."
            ) from None
        except paramiko.AuthenticationException as e:
            raise Unreachable(f"authentication failed: {e}") from None
        except (OSError, EOFError, paramiko.SSHException) as e:
            if deadline_hit.is_set():
                raise Unreachable(
                    f"no SSH session within the connect timeout ({self.settings.connect_timeout:g} s): "
                    "no banner, key exchange or auth answer"
                ) from None
            raise Unreachable(f"cannot connect to {self.address}: {e or type(e).__name__}") from None
        finally:
            timer.cancel()
        if deadline_hit.is_set():
            self.close()
            raise Unreachable(
                f"no SSH session within the connect timeout ({self.settings.connect_timeout:g} s)")

    def run(self, command: str, timeout: float, stdin: bytes = b"") -> Result:
        """Run a shell command on the host, killed there if it outlives `timeout` seconds.

        The command runs as `timeout -k 2 T sh -c COMMAND` so the remote process group dies at its
        deadline even if this side is gone. `stdin` bytes are sent, then EOF.
        Raises RemoteTimeout at the deadline, Unreachable if the connection drops.
        """
        limit = max(1, math.ceil(timeout))
        wrapped = f"timeout -k {_KILL_AFTER_S} {limit} sh -c {shlex.quote(command)}"
        start = time.monotonic()
        deadline = start + limit + _KILL_AFTER_S + 3
        transport = self._conn.client.get_transport()
        if transport is None or not transport.is_active():
            raise Unreachable("connection lost")
        try:
            chan = transport.open_session(timeout=self.settings.connect_timeout)
            chan.settimeout(max(1.0, deadline - time.monotonic()))
            chan.exec_command(wrapped)
            if stdin:
                chan.sendall(stdin)
            chan.shutdown_write()
        except socket.timeout:
            raise RemoteTimeout(f"remote command did not take its input within {limit} s") from None
        except (paramiko.SSHException, OSError) as e:
            raise Unreachable(f"connection failed while starting a command: {e}") from None
        out, err = bytearray(), bytearray()
        try:
            while True:
                while chan.recv_ready():
                    out += chan.recv(65536)
                while chan.recv_stderr_ready():
                    err += chan.recv_stderr(65536)
                if chan.exit_status_ready() and not chan.recv_ready() and not chan.recv_stderr_ready():
                    break
                if chan.closed and not chan.exit_status_ready():
                    raise Unreachable("connection closed during a command")
                if time.monotonic() > deadline:
                    raise RemoteTimeout(f"remote command did not end within {limit} s")
                select.select([chan], [], [], 0.05)
            code = chan.recv_exit_status()
        finally:
            chan.close()
        elapsed = time.monotonic() - start
        if code in _TIMEOUT_EXITS and elapsed >= limit - 0.5:
            raise RemoteTimeout(f"remote command ran past its deadline of {limit} s and was killed on the host")
        return Result(code, bytes(out), bytes(err), elapsed)

    def put_bytes(self, data: bytes, remote_path: str, timeout: float, mode: int = 0o644) -> None:
        """Upload `data` (bytes) to `remote_path` over SFTP (parent directory must exist); each
        SFTP request must answer within `timeout` seconds. Raises RemoteTimeout, Unreachable."""
        try:
            sftp = self._conn.sftp()
            sftp.get_channel().settimeout(timeout)
            with sftp.open(remote_path, "wb") as f:
                f.write(data)
            sftp.chmod(remote_path, mode)
        except socket.timeout:
            raise RemoteTimeout(f"upload of {remote_path} did not finish within {timeout:g} s") from None
        except (EOFError, paramiko.SSHException) as e:
            raise Unreachable(f"connection failed during an upload: {e}") from None

    def hold_lock(self, state_dir: str, timeout: float, hold_s: float) -> "RemoteLock":
        """Take fleetctl's per-host lock (flock on STATE_DIR/lock) for as long as this is open,
        and at most `hold_s` seconds.

        The lock is held by a remote `flock` whose child waits for EOF on its stdin: closing the
        channel, or this process dying, releases it; so does `hold_s` passing (a network
        partition that sshd does not notice cannot keep a stale lock for hours). Raises LockBusy at once when another run
        holds it (quoting who and since when), or when the lock cannot be taken within `timeout` s.
        """
        return RemoteLock(self, state_dir, timeout, hold_s)

    def close(self) -> None:
        """Close the connection (idempotent)."""
        try:
            self._conn.close()
        except Exception:  # closing a half-open paramiko transport may raise; nothing to keep
            pass


class LockBusy(Exception):
    """Another fleetctl run holds the host's lock."""


class RemoteLock:
    """See HostConnection.hold_lock."""

    def __init__(self, conn: HostConnection, state_dir: str, timeout: float, hold_s: float):
        lock = f"{state_dir}/lock"
        owner = f"{state_dir}/lock.owner"
        who = f"{os.environ.get('USER', 'root')}@{socket.gethostname()} pid {os.getpid()}"
        script = (
            f"mkdir -p {shlex.quote(state_dir)} && "
            f"exec flock -n -E 75 {shlex.quote(lock)} sh -c "
            + shlex.quote(f"printf '%s since %s\\n' {shlex.quote(who)} \"$(date -u +%FT%TZ)\" > {shlex.quote(owner)}; "
                          f"echo LOCKED; exec timeout {max(1, math.ceil(hold_s))} cat >/dev/null")
        )
        transport = conn._conn.client.get_transport()
        if transport is None or not transport.is_active():
            raise Unreachable("connection lost")
        try:
            self._chan = transport.open_session(timeout=conn.settings.connect_timeout)
            self._chan.settimeout(timeout)
            self._chan.exec_command(script)
        except (paramiko.SSHException, OSError) as e:
            raise Unreachable(f"connection failed while taking the lock: {e}") from None
        buf = b""
        try:
            while b"\n" not in buf:
                chunk = self._chan.recv(256)
                if not chunk:
                    break
                buf += chunk
        except socket.timeout:
            pass
        if buf.strip() != b"LOCKED":
            end = time.monotonic() + timeout
            while not self._chan.exit_status_ready() and time.monotonic() < end:
                time.sleep(0.02)
            code = self._chan.recv_exit_status() if self._chan.exit_status_ready() else None
            self._chan.close()
            if code == 75:
                holder = conn.run(f"cat {shlex.quote(owner)} 2>/dev/null || true", timeout=timeout)
                raise LockBusy(f"another fleetctl run is changing this host ({holder.stdout.decode().strip() or 'holder unknown'})")
            raise LockBusy(f"could not take the lock {lock} (exit {code})")

    def release(self) -> None:
        """Release the lock (closing the channel ends the remote flock)."""
        self._chan.close()
