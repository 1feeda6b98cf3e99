"""`ansible_connection: paramiko` (the default): SSH through Fabric over paramiko.

Host keys are always verified (known_hosts read by knownhosts.py, markers included): an unknown
key is refused unless `accept_new` (then stored, as OpenSSH's StrictHostKeyChecking=accept-new),
a changed key is always refused with both fingerprints, a revoked key is refused, and a host
covered only by a `@cert-authority` line is refused with the reason. Fabric installs paramiko's
AutoAddPolicy, so the policy is replaced on the target and on every ProxyJump hop.

Every wait is bounded: the whole connect (DNS, TCP, banner, key exchange, auth, every hop) by
connect_timeout; the exec request by the command's deadline; a silent dead peer by keepalives
(a want-reply global request every ServerAliveInterval seconds, the transport closed after
ServerAliveCountMax unanswered ones, as ssh_config(5) describes for OpenSSH).
"""

from __future__ import annotations

import base64
import hashlib
import logging
import math
import select
import shlex
import socket
import threading
import time
from pathlib import Path

import fabric
import paramiko

from . import command, knownhosts
from .base import Connection, OutputBuffer, Process, Settings, expand_home, passwd_home
from .errors import HostKeyRefused, RemoteTimeout, Unreachable

# paramiko logs failed handshakes with tracebacks on stderr; fleetctl reports each host's error itself.
logging.getLogger("paramiko").setLevel(logging.CRITICAL)

_ACCEPT_LOCK = threading.Lock()


def fingerprint(key: paramiko.PKey) -> str:
    """OpenSSH-style SHA256 fingerprint of a host key, e.g. 'ssh-ed25519 SHA256:abc...'."""
    digest = base64.b64encode(hashlib.sha256(key.asbytes()).digest()).decode().rstrip("=")
    return f"{key.get_name()} SHA256:{digest}"


class _Policy(paramiko.MissingHostKeyPolicy):
    """What to do with a key that no plain known_hosts line lists for the host."""

    def __init__(self, known: knownhosts.KnownHosts, accept_into: Path | None):
        self.known, self.accept_into = known, accept_into

    def missing_host_key(self, client, hostname, key):
        revoked = self.known.revocation(key)
        if revoked:
            raise HostKeyRefused(f"host key {fingerprint(key)} of {hostname} is revoked "
                                 f"(@revoked at {revoked.where}); nothing was run")
        ca = self.known.authority(hostname)
        if ca:
            raise HostKeyRefused(f"a CA vouches for this host (@cert-authority at {ca.where}); paramiko cannot "
                                 "verify host certificates: use ansible_connection: ssh")
        if self.accept_into is None:
            raise HostKeyRefused(f"unknown host key for {hostname} ({fingerprint(key)}); verify it and add it to "
                                 "known_hosts, or pass --accept-new to store it on first use")
        client.get_host_keys().add(hostname, key.get_name(), key)
        with _ACCEPT_LOCK:
            knownhosts.append(self.accept_into, hostname, key)


class _Keepalive(threading.Thread):
    """Every `interval` seconds, a want-reply global request (keepalive@openssh.com, which
    OpenSSH's sshd answers with a failure message: any answer proves the peer alive); after
    `count` unanswered ones in a row, `on_dead(reason)` is called and the thread ends.
    paramiko's own set_keepalive sends want_reply=False and so never notices a dead peer."""

    def __init__(self, transport: paramiko.Transport, interval: float, count: int, on_dead):
        super().__init__(daemon=True, name="fleetctl-keepalive")
        self.transport, self.interval, self.count, self.on_dead = transport, interval, count, on_dead
        self.stopped = threading.Event()

    def _ask(self) -> None:
        try:
            self.transport.global_request("keepalive@openssh.com", wait=True)
        except Exception:  # noqa: BLE001 - a transport that breaks is noticed by the next tick
            pass

    def run(self) -> None:
        asking: threading.Thread | None = None
        misses = 0
        while not self.stopped.wait(self.interval):
            if not self.transport.is_active():
                return
            if asking is not None and asking.is_alive():
                misses += 1
                if misses >= self.count:
                    self.on_dead(f"no answer to {self.count} keepalives sent {self.interval:g} s apart")
                    return
                continue
            misses = 0
            asking = threading.Thread(target=self._ask, daemon=True, name="fleetctl-keepalive-ask")
            asking.start()


class ParamikoProcess(Process):
    """A command on one SSH channel (see Process)."""

    def __init__(self, conn: "ParamikoConnection", chan: paramiko.Channel):
        self.conn, self.chan = conn, chan

    def communicate(self, stdin: bytes, deadline: float, out: OutputBuffer,
                    err: OutputBuffer) -> tuple[bytes, bytes, int]:
        chan = self.chan
        try:
            chan.settimeout(max(1.0, deadline - time.monotonic()))
            if stdin:
                chan.sendall(stdin)
            chan.shutdown_write()
        except socket.timeout:
            raise RemoteTimeout("the remote command did not take its input by its deadline") from None
        except (paramiko.SSHException, OSError) as e:
            raise self.conn.lost(f"while sending a command its input: {e}") from None
        while True:
            while chan.recv_ready():
                out.add(chan.recv(65536))
            while chan.recv_stderr_ready():
                err.add(chan.recv_stderr(65536))
            if chan.exit_status_ready() and not chan.recv_ready() and not chan.recv_stderr_ready():
                break
            if time.monotonic() > deadline:
                raise RemoteTimeout("the remote command did not end by its deadline")
            select.select([chan], [], [], 0.05)
        code = chan.recv_exit_status()
        if code == -1 and not self.conn.alive():
            # paramiko's exit_status_ready() is also true once the channel closed with the transport
            raise self.conn.lost("during a command")
        return out.value(), err.value(), code

    def readline(self, limit: int, timeout: float) -> bytes:
        buf = b""
        self.chan.settimeout(timeout)
        try:
            while b"\n" not in buf and len(buf) < limit:
                chunk = self.chan.recv(min(256, limit - len(buf)))
                if not chunk:
                    break
                buf += chunk
        except socket.timeout:
            pass
        return buf.split(b"\n", 1)[0]

    def wait(self, timeout: float) -> int | None:
        end = time.monotonic() + timeout
        while not self.chan.exit_status_ready():
            if time.monotonic() >= end:
                return None
            time.sleep(0.02)
        return self.chan.recv_exit_status()

    def close(self) -> None:
        self.chan.close()


class ParamikoConnection(Connection):
    """A verified SSH connection to one inventory host, Fabric over paramiko.

    Settings layer as Fabric does: the ssh_config (Settings.ssh_config, else the passwd home's
    ~/.ssh/config and /etc/ssh/ssh_config: HostName, User, Port, IdentityFile, ProxyJump,
    UserKnownHostsFile, ServerAliveInterval, ServerAliveCountMax) first, then the inventory's
    ansible_user / ansible_port / ansible_ssh_private_key_file on top.
    """

    kind = "paramiko"

    def __init__(self, host, settings: Settings):
        super().__init__(host, settings)
        config = fabric.Config(runtime_ssh_path=str(settings.ssh_config) if settings.ssh_config else None,
                               user_ssh_path=str(passwd_home() / ".ssh" / "config"))
        t = settings.connect_timeout
        connect_kwargs = {"banner_timeout": t, "auth_timeout": t, "channel_timeout": t}
        if host.key_file:
            connect_kwargs["key_filename"] = [host.key_file]
        self._conn = fabric.Connection(host.address, user=host.user, port=host.port, config=config,
                                       connect_timeout=max(1, math.ceil(t)), connect_kwargs=connect_kwargs)
        cfg = self._conn.ssh_config
        self._keepalive_s = float(cfg.get("serveraliveinterval") or settings.server_alive_interval)
        self._keepalive_n = int(cfg.get("serveralivecountmax") or settings.server_alive_count_max)
        self._keepalive: _Keepalive | None = None
        self._dead: str | None = None
        for conn in self._chain():  # the target and every ProxyJump hop: same policy and deadline
            conn.connect_timeout = max(1, math.ceil(t))
            self._verify_host_keys(conn)

    def _chain(self) -> list[fabric.Connection]:
        out, conn = [], self._conn
        while isinstance(conn, fabric.Connection):
            out.append(conn)
            conn = conn.gateway
        return out

    def _known_hosts_files(self, conn: fabric.Connection) -> list[Path]:
        configured = conn.ssh_config.get("userknownhostsfile")
        if configured:
            return [expand_home(p) for p in shlex.split(configured)]
        return [passwd_home() / ".ssh" / "known_hosts"]

    def _verify_host_keys(self, conn: fabric.Connection) -> None:
        """Load known_hosts into `conn`'s client and replace Fabric's AutoAddPolicy."""
        files = self._known_hosts_files(conn)
        known = knownhosts.load(files)
        keys = conn.client.get_host_keys()
        for name in known.keys.keys():
            for ktype, key in known.keys.lookup(name).items():
                keys.add(name, ktype, key)
        conn.client.set_missing_host_key_policy(_Policy(known, files[0] if self.settings.accept_new else None))

    @property
    def address(self) -> str:
        return self._conn.host

    def _close_transports(self) -> None:
        for conn in self._chain():
            transport = conn.client.get_transport()
            if transport is not None:
                transport.close()

    def open(self) -> None:
        """Connect, verify the host key and authenticate within settings.connect_timeout seconds.

        The deadline holds wherever paramiko or the resolver would block (DNS, a hop's TCP
        connect, sshd that accepts TCP but never sends a banner, an agent that never answers):
        the connect runs in a worker that is abandoned, and its transports closed, at the
        deadline. Raises HostKeyRefused (unknown, changed, revoked or CA-only key) or
        Unreachable (anything else)."""
        done, abandoned = threading.Event(), threading.Event()
        box: dict = {}

        def connect():
            try:
                self._conn.open()
            except BaseException as e:  # noqa: BLE001 - handed to the caller below
                box["error"] = e
            finally:
                done.set()
                if abandoned.is_set():
                    self.close()

        threading.Thread(target=connect, daemon=True, name=f"fleetctl-connect-{self.host.name}").start()
        if not done.wait(self.settings.connect_timeout):
            abandoned.set()
            self._close_transports()
            raise Unreachable(f"no SSH session within the connect timeout ({self.settings.connect_timeout:g} s): "
                              "no DNS answer, TCP connect, banner, key exchange or auth answer")
        e = box.get("error")
        if e is None:
            transport = self._conn.client.get_transport()
            self._keepalive = _Keepalive(transport, self._keepalive_s, self._keepalive_n, self._on_dead)
            self._keepalive.start()
            return
        if isinstance(e, HostKeyRefused):
            raise e
        if isinstance(e, paramiko.BadHostKeyException):
            raise HostKeyRefused(
                f"HOST KEY CHANGED for {e.hostname}: known_hosts has {fingerprint(e.expected_key)}, "
                f"the host offered {fingerprint(e.key)}. Possible man-in-the-middle; nothing was run. "
                "If the change is expected, remove the old key (ssh-keygen -R) and retry.") from None
        if isinstance(e, paramiko.AuthenticationException):
            raise Unreachable(f"authentication failed: {e}") from None
        if isinstance(e, (OSError, EOFError, paramiko.SSHException)):
            raise Unreachable(f"cannot connect to {self.address}: {e or type(e).__name__}") from None
        raise e

    def _on_dead(self, reason: str) -> None:
        self._dead = reason
        self._close_transports()

    def alive(self) -> bool:
        """Whether the SSH transport is still up."""
        transport = self._conn.client.get_transport()
        return transport is not None and transport.is_active()

    def lost(self, when: str) -> Unreachable:
        """The error for a connection found lost `when`, with the keepalive's reason if it saw it."""
        return Unreachable(f"connection lost {when}" + (f": {self._dead}" if self._dead else ""))

    def _start(self, argv: list[str], timeout: float) -> Process:
        if not self.alive():
            raise self.lost("before a command")
        transport = self._conn.client.get_transport()
        wait = min(self.settings.connect_timeout, timeout)
        try:
            chan = transport.open_session(timeout=wait)
        except (paramiko.SSHException, OSError, EOFError) as e:
            if self.alive():  # paramiko's "Timeout opening channel." on a transport still up
                raise RemoteTimeout(f"the host did not open a channel within {wait:g} s") from None
            raise self.lost(f"while opening a channel ({e})") from None
        # paramiko waits for the exec reply without a timeout: close the channel at the deadline
        hit = threading.Event()
        timer = threading.Timer(timeout, lambda: (hit.set(), chan.close()))
        timer.daemon = True
        timer.start()
        try:
            chan.exec_command(command.shell_line(argv))
        except (paramiko.SSHException, OSError, EOFError) as e:
            if hit.is_set():
                raise RemoteTimeout(f"the host did not start the command within {timeout:g} s") from None
            raise self.lost(f"while starting a command ({e})") from None
        finally:
            timer.cancel()
        if hit.is_set():  # the exec reply came just as the deadline closed the channel
            raise RemoteTimeout(f"the host did not start the command within {timeout:g} s")
        return ParamikoProcess(self, chan)

    def close(self) -> None:
        """Close the connection and every hop (idempotent)."""
        if self._keepalive is not None:
            self._keepalive.stopped.set()
        try:
            self._conn.close()
        except Exception:  # noqa: BLE001 - closing a half-open paramiko transport may raise; nothing to keep
            pass
