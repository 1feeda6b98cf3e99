"""`ansible_connection: paramiko` (the default): SSH through paramiko, to what OpenSSH resolved.

Where to connect comes from `ssh -G` (resolve.py): HostName, Port, User, only the identity files
it lists (`look_for_keys` off) and the agent at IdentityAgent (with IdentitiesOnly, only agent
keys that match an identity file), ProxyJump hops in the order written, ProxyCommand,
HostKeyAlias, UserKnownHostsFile and GlobalKnownHostsFile, ConnectTimeout, ServerAlive*. An
option that changes the connection and paramiko cannot honour (resolve.UNSUPPORTED_BY_PARAMIKO)
is exit 4 naming the host. One transport to each bastion is shared by every host of the run
behind it (JumpPool), under the same host-key policy and deadlines.

Host keys are always verified (known_hosts read by knownhosts.py, markers included): an unknown
key is refused unless `accept_new` (then stored, as OpenSSH's StrictHostKeyChecking=accept-new;
`StrictHostKeyChecking no` in a config counts as accept-new, with a warning), a changed key is
always refused with both fingerprints, a revoked key is refused, and a host covered only by a
`@cert-authority` line is refused with the reason.

Every wait is bounded: the whole connect (`ssh -G`, DNS, TCP, banner, key exchange, auth, every
hop) by connect_timeout; the exec request by the command's deadline; a silent dead peer by
keepalives (a want-reply global request every ServerAliveInterval seconds, the transport closed
after ServerAliveCountMax unanswered ones, as ssh_config(5) describes for OpenSSH).
"""

from __future__ import annotations

import base64
import hashlib
import logging
import select
import socket
import threading
import time
from pathlib import Path

from ._paramiko import paramiko  # first: paramiko without invoke (see _paramiko.py)
from paramiko.auth_strategy import AuthStrategy, InMemoryPrivateKey, OnDiskPrivateKey  # noqa: E402

from ..errors import SshConfigError
from . import command, knownhosts
from .base import Connection, OutputBuffer, Process, Settings
from .errors import HostKeyRefused, RemoteTimeout, Unreachable
from .resolve import Resolved, hop_chain

# paramiko logs failed handshakes with tracebacks on stderr; fleetctl reports each host's error itself.
logging.getLogger("paramiko").setLevel(logging.CRITICAL)
log = logging.getLogger("fleetctl")

_ACCEPT_LOCK = threading.Lock()


def fingerprint(key: paramiko.PKey) -> str:
    """OpenSSH-style SHA256 fingerprint of a host key, e.g. 'ssh-ed25519 SHA256:abc...'."""
    digest = base64.b64encode(hashlib.sha256(key.asbytes()).digest()).decode().rstrip("=")
    return f"{key.get_name()} SHA256:{digest}"


class _Policy(paramiko.MissingHostKeyPolicy):
    """What to do with a key that no plain known_hosts line lists for the host's key name
    (`Resolved.host_key_name`: HostKeyAlias, `host` or `[host]:port`)."""

    def __init__(self, known: knownhosts.KnownHosts, name: str, accept_into: Path | None, hashed: bool):
        self.known, self.name, self.accept_into, self.hashed = known, name, accept_into, hashed

    def missing_host_key(self, client, hostname, key):
        revoked = self.known.revocation(key)
        if revoked:
            raise HostKeyRefused(f"host key {fingerprint(key)} of {self.name} is revoked "
                                 f"(@revoked at {revoked.where}); nothing was run")
        ca = self.known.authority(self.name)
        if ca:
            raise HostKeyRefused(f"a CA vouches for this host (@cert-authority at {ca.where}); paramiko cannot "
                                 "verify host certificates: use ansible_connection: ssh")
        if self.accept_into is None:
            raise HostKeyRefused(f"unknown host key for {self.name} ({fingerprint(key)}); verify it and add it to "
                                 "known_hosts, or pass --accept-new to store it on first use")
        client.get_host_keys().add(hostname, key.get_name(), key)
        with _ACCEPT_LOCK:
            knownhosts.append(self.accept_into, self.name, key, self.hashed)


def _verifying_client(r: Resolved, settings: Settings) -> paramiko.SSHClient:
    """A paramiko client that verifies `r`'s host key against `r`'s known_hosts files (user
    files, then the global ones as read-only pins) under its key name."""
    client = paramiko.SSHClient()
    name = r.host_key_name
    known = knownhosts.lookup(name, [*r.known_hosts, *r.global_known_hosts])
    # paramiko looks the key up as `host` / `[host]:port` of the address it dials
    dialled = r.hostname if r.port == 22 else f"[{r.hostname}]:{r.port}"
    for ktype, key in (known.keys.lookup(name) or {}).items():  # lookup() filed them under `name`
        client.get_host_keys().add(dialled, ktype, key)
    accept = settings.accept_new
    if r.host_key_checking_off:
        log.warning("fleetctl: %s: StrictHostKeyChecking no/off in ssh_config is treated as accept-new (a "
                    "changed key is still refused)", r.name)
        accept = True
    client.set_missing_host_key_policy(_Policy(known, name, r.known_hosts[0] if accept and r.known_hosts else None,
                                               r.hash_known_hosts))
    return client


class _AgentAt(paramiko.agent.AgentSSH):
    """The SSH agent listening on the unix socket `path` (IdentityAgent), asked within `timeout`
    seconds. Raises OSError when it cannot be reached."""

    def __init__(self, path: str, timeout: float):
        super().__init__()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        sock.connect(path)
        self._connect(sock)


class _OpenSSHAuth(AuthStrategy):
    """Public keys as OpenSSH offers them (ssh_config(5), IdentityFile, IdentitiesOnly): the agent's
    keys (only those matching an identity file with IdentitiesOnly), then the identity files the
    agent does not hold. A file that cannot be loaded (passphrase, unknown type) is skipped with a
    warning, as BatchMode ssh does."""

    def __init__(self, r: Resolved, timeout: float):
        super().__init__(ssh_config=None)
        self.r = r
        files = []
        for path in r.identity_files:
            try:
                files.append((path, paramiko.PKey.from_path(path)))
            except (paramiko.SSHException, OSError, ValueError) as e:
                log.warning("fleetctl: %s: identity file %s skipped (%s)", r.name, path, e)
        agent_keys = []
        if r.identity_agent:
            try:
                agent_keys = list(_AgentAt(r.identity_agent, timeout).get_keys())
            except (OSError, paramiko.SSHException) as e:
                log.warning("fleetctl: %s: agent %s not used (%s)", r.name, r.identity_agent, e)
        file_blobs = {k.asbytes() for _, k in files}
        if r.identities_only:
            agent_keys = [k for k in agent_keys if k.asbytes() in file_blobs]
        agent_blobs = {k.asbytes() for k in agent_keys}
        self.sources = [InMemoryPrivateKey(r.user, k) for k in agent_keys] + [
            OnDiskPrivateKey(r.user, "ssh-config", str(p), k) for p, k in files if k.asbytes() not in agent_blobs]

    def get_sources(self):
        yield from self.sources


def _connect(client: paramiko.SSHClient, r: Resolved, sock, deadline: float) -> None:
    """Connect `client` to `r` (over `sock`, or dialling itself), authenticate, by `deadline`."""
    left = max(0.1, deadline - time.monotonic())
    tcp = left if r.connect_timeout is None else min(left, r.connect_timeout)
    client.connect(r.hostname, r.port, r.user, sock=sock, timeout=tcp, banner_timeout=left, auth_timeout=left,
                   channel_timeout=left, auth_strategy=_OpenSSHAuth(r, left))


def _proxy_command(r: Resolved):
    """A socket-like ProxyCommand for `r` (run by `sh -c`, as ssh runs it through the shell)."""
    return paramiko.ProxyCommand(command.shell_line(["sh", "-c", r.proxy_command]))


class _Jump:
    """One shared connection to a bastion (the chain of hosts that leads to it is its key)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.client: paramiko.SSHClient | None = None
        self.users = 0


class JumpPool:
    """The run's connections to ProxyJump hosts: one per chain, shared by every host behind it
    (security review L12: one bastion session per host exhausts sshd's MaxStartups), opened by
    the first host that needs it, closed when the last one lets go."""

    def __init__(self):
        self._lock = threading.Lock()
        self._jumps: dict[tuple, _Jump] = {}

    def lease(self, chain: list[Resolved], settings: Settings, deadline: float) -> tuple[paramiko.Transport, list]:
        """Open (or share) every connection of `chain` (dialled in order, each through the one
        before), by `deadline`; -> (the last one's transport, the lease to hand to release()).
        Raises HostKeyRefused, Unreachable, paramiko errors as SSHClient.connect does."""
        held: list[tuple[tuple, _Jump]] = []
        transport = None
        try:
            for i, hop in enumerate(chain):
                key = tuple((h.hostname, h.port, h.user) for h in chain[:i + 1])
                with self._lock:
                    jump = self._jumps.setdefault(key, _Jump())
                if not jump.lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
                    raise Unreachable(f"ProxyJump hop {hop.name}: no session within the connect timeout")
                try:
                    live = jump.client is not None and jump.client.get_transport() is not None \
                        and jump.client.get_transport().is_active()
                    if not live:
                        if transport is not None:
                            sock = transport.open_channel("direct-tcpip", (hop.hostname, hop.port), ("", 0),
                                                          timeout=max(0.1, deadline - time.monotonic()))
                        else:
                            sock = _proxy_command(hop) if hop.proxy_command else None
                        client = _verifying_client(hop, settings)
                        _connect(client, hop, sock, deadline)
                        jump.client = client
                    jump.users += 1
                    held.append((key, jump))
                    transport = jump.client.get_transport()
                finally:
                    jump.lock.release()
        except BaseException:
            self.release(held)
            raise
        return transport, held

    def release(self, held: list) -> None:
        """Let go of a lease; a connection no host uses any more is closed."""
        for key, jump in reversed(held):
            with jump.lock:
                jump.users -= 1
                if jump.users <= 0 and jump.client is not None:
                    jump.client.close()
                    jump.client = None
        held.clear()


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

    def read_err(self, limit: int, timeout: float) -> bytes:
        self.chan.settimeout(max(0.01, timeout))
        try:
            return self.chan.recv_stderr(limit)
        except socket.timeout:
            return b""

    def write(self, data: bytes) -> None:
        try:
            self.chan.sendall(data)
        except (paramiko.SSHException, OSError) as e:
            raise self.conn.lost(f"while answering sudo's prompt: {e}") from None

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
    """A verified SSH connection to one inventory host, over paramiko, to what `ssh -G` resolved
    for its address with the inventory's ansible_user / ansible_port /
    ansible_ssh_private_key_file given as `-o` options (they win, as in Ansible)."""

    kind = "paramiko"

    def __init__(self, host, session):
        super().__init__(host, session)
        self.resolved: Resolved | None = None
        self._client: paramiko.SSHClient | None = None
        self._lease: list = []
        self._keepalive: _Keepalive | None = None
        self._dead: str | None = None

    @property
    def address(self) -> str:
        return self.resolved.hostname if self.resolved else self.host.address

    def _resolve(self, deadline: float) -> Resolved:
        h = self.host
        r = self.session.resolver.resolve_host(h, deadline)
        bad = [o for x in hop_chain(r) for o in x.unsupported_by_paramiko()]
        if bad:
            raise SshConfigError(f"{h.name}: the paramiko connection cannot honour {', '.join(bad)} from ssh_config: "
                                 "use ansible_connection: ssh, or drop the option for this host")
        return r

    def _open(self, deadline: float) -> None:
        r = self.resolved = self._resolve(deadline)
        sock = None
        if r.hops:
            transport, self._lease = self.session.jump_pool.lease(hop_chain(r)[:-1], self.settings, deadline)
            sock = transport.open_channel("direct-tcpip", (r.hostname, r.port), ("", 0),
                                          timeout=max(0.1, deadline - time.monotonic()))
        elif r.proxy_command:
            sock = _proxy_command(r)
        self._client = _verifying_client(r, self.settings)
        _connect(self._client, r, sock, deadline)

    def _close_transports(self) -> None:
        if self._client is not None:
            self._client.close()
        self.session.jump_pool.release(self._lease)

    def open(self) -> None:
        """Resolve the host (`ssh -G`), connect, verify the host key and authenticate, all within
        settings.connect_timeout seconds.

        The deadline holds wherever paramiko or the resolver would block (`Match exec`, DNS, a
        hop's TCP connect, sshd that accepts TCP but never sends a banner, an agent that never
        answers): the connect runs in a worker that is abandoned, and its transports closed, at
        the deadline. Raises SshConfigError (exit 4: OpenSSH refuses the config, or an option
        paramiko cannot honour), HostKeyRefused (unknown, changed, revoked or CA-only key) or
        Unreachable (anything else)."""
        done, abandoned = threading.Event(), threading.Event()
        box: dict = {}
        deadline = time.monotonic() + self.settings.connect_timeout

        def connect():
            try:
                self._open(deadline)
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
                              "no ssh -G result, DNS answer, TCP connect, banner, key exchange or auth answer")
        e = box.get("error")
        if e is None:
            r = self.resolved
            interval = r.server_alive_interval or self.settings.server_alive_interval
            self._keepalive = _Keepalive(self._client.get_transport(), interval, r.server_alive_count_max,
                                         self._on_dead)
            self._keepalive.start()
            return
        if isinstance(e, (HostKeyRefused, SshConfigError)):
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
        transport = self._client.get_transport() if self._client is not None else None
        return transport is not None and transport.is_active()

    def lost(self, when: str) -> Unreachable:
        """The error for a connection found lost `when`, with the keepalive's reason if it saw it."""
        return Unreachable(f"connection lost {when}" + (f": {self._dead}" if self._dead else ""))

    def _start(self, argv: list[str], timeout: float) -> Process:
        if not self.alive():
            raise self.lost("before a command")
        transport = self._client.get_transport()
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
        """Close the connection, and let go of its ProxyJump hops (idempotent)."""
        if self._keepalive is not None:
            self._keepalive.stopped.set()
        try:
            self._close_transports()
        except Exception:  # noqa: BLE001 - closing a half-open paramiko transport may raise; nothing to keep
            pass
