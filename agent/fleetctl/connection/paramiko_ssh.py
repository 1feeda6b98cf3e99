"""`ansible_connection: paramiko` (the default): SSH through paramiko, to what OpenSSH resolved.

Where to connect comes from `ssh -G` (resolve.py): HostName, Port, User, only the identity files
it lists (`look_for_keys` off), the certificates beside them and in CertificateFile, and the agent
at IdentityAgent, offered in OpenSSH's order (paramiko_auth.py, pubkey_order.py: IdentitiesOnly
keeps the agent's other keys back), ProxyJump hops in the order written, ProxyCommand,
HostKeyAlias, UserKnownHostsFile and GlobalKnownHostsFile (from ssh_config only: inventory args
that set them are refused, hostkey_policy.py), ConnectTimeout, ServerAlive*. An
option that changes the connection and paramiko cannot honour (resolve.UNSUPPORTED_BY_PARAMIKO)
is exit 4 naming the host. One transport to each bastion is shared by every host of the run
behind it (paramiko_dial.JumpPool), under the same host-key policy (paramiko_dial.py: host keys
always verified) and deadlines.

Every wait is bounded: the whole connect (`ssh -G`, DNS, TCP, banner, key exchange, auth, every
hop) by connect_timeout; the exec request by the command's deadline; a silent dead peer by
keepalives (a want-reply global request every ServerAliveInterval seconds, the transport closed
after ServerAliveCountMax unanswered ones, as ssh_config(5) describes for OpenSSH).
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import threading
import time

from ._paramiko import paramiko  # first: paramiko without invoke (see _paramiko.py)

from ..config import KEY_FILE
from ..errors import SshConfigError
from . import command, polling, trace
from .base import Connection, OutputBuffer, Process
from .paramiko_dial import dial, fingerprint, proxy_command, verifying_client
from .errors import (AUTH_FIX, HostKeyRefused, RemoteTimeout, Unreachable, identity_missing, proxy_failed, refused,
                     stalled, unresolvable)
from .resolve import Resolved, hop_chain

# paramiko logs failed handshakes with tracebacks on stderr; fleetctl reports each host's error itself.
logging.getLogger("paramiko").setLevel(logging.CRITICAL)
# Seconds between open()'s looks at how far the connect has got (trace.Phases): phase times are
# this exact when they are shown (-v); otherwise only the phase that stalled is said, and open()
# looks every IDLE_POLL_S (issue 55: a 10 ms poll cost a host 2 ms of CPU a second of connect,
# and connects take longer as the fleet grows, so its cost per host grew with the fleet).
POLL_S = 0.01
IDLE_POLL_S = 0.2
# The longest a command's wait for output sleeps between looks at its deadline.
WAIT_S = 1.0
# A failure this close to the connect deadline (seconds) is paramiko's own timeout, which it was
# given as what was left of it: reported as the phase that stalled.
STALL_SLACK_S = 0.25
# Seconds a failed connect waits for its ProxyCommand to exit (it closed its stdout as it ended).
PROXY_EXIT_WAIT_S = 0.5

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
            left = deadline - time.monotonic()
            if left < 0:
                raise RemoteTimeout("the remote command did not end by its deadline")
            if chan.eof_received:  # its pipe stays readable from now on: wait for the exit status
                chan.status_event.wait(min(0.05, left))
            else:  # woken by output or EOF (paramiko sets the channel's pipe), not by a clock
                polling.wait([chan.fileno()], timeout=min(WAIT_S, left))
        code = chan.recv_exit_status()
        if code == -1 and not self.conn.alive():
            # paramiko's exit_status_ready() is also true once the channel closed with the transport
            raise self.conn.lost("during a command")
        return out.value(), err.value(), code

    def read_out(self, limit: int, timeout: float) -> bytes:
        self.chan.settimeout(max(0.01, timeout))
        try:
            return self.chan.recv(limit)
        except socket.timeout:
            return b""

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


    def __init__(self, host, session):
        super().__init__(host, session)
        self.resolved: Resolved | None = None
        self._client: paramiko.SSHClient | None = None
        self._lease: list = []
        self._keepalive: _Keepalive | None = None
        self._dead: str | None = None
        self._proxy: paramiko.ProxyCommand | None = None
        self._proxy_said: str | None = None
        self.phases = trace.Phases()

    @property
    def address(self) -> str:
        return self.resolved.hostname if self.resolved else self.host.address

    def keepalive(self) -> tuple[float, int]:
        r = self.resolved
        if r is None or not r.server_alive_interval:
            return super().keepalive()
        return r.server_alive_interval, r.server_alive_count_max

    def _resolve(self, deadline: float) -> Resolved:
        h = self.host
        r = self.session.resolver.resolve_host(h, deadline)
        bad = [o for x in hop_chain(r) for o in x.unsupported_by_paramiko()]
        if bad:
            raise SshConfigError(f"{h.name}: the paramiko connection cannot honour {', '.join(bad)} from ssh_config: "
                                 "use ansible_connection: ssh, or drop the option for this host")
        return r

    def _open(self, deadline: float) -> None:
        self.phases.mark("resolve")
        r = self.resolved = self._resolve(deadline)
        trace.log.info(trace.dialled(self.host.name, "paramiko", r))
        trace.log.debug("%s: ssh -G resolved: %s", self.host.name,
                        "; ".join(f"{k} {' '.join(v)}" for k, v in sorted(r.options.items())))
        self.phases.mark("connect")
        sock = None
        if r.hops:
            transport, self._lease = self.session.jump_pool.lease(hop_chain(r)[:-1], self.settings, deadline)
            sock = transport.open_channel("direct-tcpip", (r.hostname, r.port), ("", 0),
                                          timeout=max(0.1, deadline - time.monotonic()))
        elif r.proxy_command:
            sock = self._proxy = proxy_command(r)
        self._client = verifying_client(r, self.settings, self.host.name)
        dial(self._client, r, sock, deadline)

    def _close_transports(self) -> None:
        if self._client is not None:
            self._client.close()
        self.session.jump_pool.release(self._lease)

    def _observe(self) -> None:
        """Mark the phases (trace.PHASES) the paramiko transport has reached: a transport exists
        once TCP (or the proxy) is up, its remote_version once the banner came, initial_kex_done
        once the key exchange ended. Polled by open() every POLL_S seconds, which bounds the
        phase times' error."""
        t = self._client.get_transport() if self._client is not None else None
        if t is None:
            return
        if self.phases.current == "connect":
            self.phases.mark("banner")
        if t.remote_version and self.phases.current == "banner":
            self.phases.mark("kex")
        if t.initial_kex_done and self.phases.current == "kex":
            self.phases.mark("auth")

    def _proxy_failure(self, wait: float = 0.0) -> str | None:
        """errors.proxy_failed for a ProxyCommand that has exited (waiting up to `wait` seconds
        for it: its stdout closes just before it exits), with its stderr's tail (read without
        blocking, once: the message is kept); None while it runs, or without one."""
        p = self._proxy.process if self._proxy is not None else None
        if self._proxy_said is not None or p is None:
            return self._proxy_said
        try:
            p.wait(wait)
        except subprocess.TimeoutExpired:
            return None
        said = b""
        try:
            os.set_blocking(p.stderr.fileno(), False)
            while len(said) < 1 << 16:
                chunk = p.stderr.read(4096)
                if not chunk:
                    break
                said += chunk
        except (OSError, ValueError):
            pass
        self._proxy_said = proxy_failed(self.resolved.proxy_command, p.returncode, said.decode("utf-8", "replace"))
        return self._proxy_said

    def _missing_identity(self) -> str | None:
        """errors.identity_missing for the inventory's key file (naming its var and file:line),
        else for an IdentityFile of ssh_config, that does not exist; None when all exist."""
        h, r = self.host, self.resolved
        if h.key_file and not os.path.isfile(h.key_file):
            var = next((n for n in reversed(KEY_FILE.names) if n in h.vars), KEY_FILE.name)
            where = h.where.get(var)
            return identity_missing(h.key_file, var + (f" ({where})" if where else ""))
        if r is not None and r.missing_identity_files:
            return identity_missing(str(r.missing_identity_files[0]), "IdentityFile in ssh_config")
        return None

    def _failure(self, e: BaseException, deadline: float) -> str:
        """The message for a connect that failed with `e` (errors' table of kinds): the proxy's
        exit; for an auth failure, a missing identity file first, then paramiko_auth's words
        (naming the user and the keys refused) and AUTH_FIX; the phase that ran out of time,
        a refused port, an unknown name, else paramiko's words."""
        r = self.resolved
        host, port = (r.hostname, r.port) if r else (self.host.address, self.host.port or 22)
        said = self._proxy_failure(wait=PROXY_EXIT_WAIT_S)
        if said:
            return said
        if isinstance(e, (paramiko.AuthenticationException, Unreachable)):
            missing = self._missing_identity()
            return f"{missing}; {e}" if missing else f"{e}: {AUTH_FIX}"
        if isinstance(e, socket.timeout) or time.monotonic() >= deadline - STALL_SLACK_S:
            return stalled(self.phases.current or "resolve", self.phases.in_current(),
                           self.settings.connect_timeout, f"{host}:{port}")
        if isinstance(e, socket.gaierror):
            return unresolvable(host, e.strerror or str(e))
        causes = list(e.errors.values()) if isinstance(e, paramiko.ssh_exception.NoValidConnectionsError) else [e]
        if causes and all(isinstance(c, ConnectionRefusedError) for c in causes):
            return refused(host, port)
        why = "; ".join(c.strerror or str(c) if isinstance(c, OSError) else str(c) or type(c).__name__ for c in causes)
        return f"cannot connect to {host}:{port}: {why}"

    def open(self) -> None:
        """Resolve the host (`ssh -G`), connect, verify the host key and authenticate, all within
        settings.connect_timeout seconds, marking each phase as it starts (trace.Phases; shown
        with -v).

        The deadline holds wherever paramiko or the resolver would block (`Match exec`, DNS, a
        hop's TCP connect, sshd that accepts TCP but never sends a banner, an agent that never
        answers): the connect runs in a worker that is abandoned, and its transports closed, at
        the deadline, or as soon as a ProxyCommand exits before the session is up. Raises
        SshConfigError (exit 4: OpenSSH refuses the config, or an option paramiko cannot honour),
        HostKeyRefused (unknown, changed, revoked or CA-only key, or a host pinned only to keys
        of a type paramiko cannot read) or Unreachable (anything else: a message from errors'
        table of kinds, naming the fix, or the one phase that stalled)."""
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
        poll = POLL_S if trace.log.isEnabledFor(logging.INFO) else IDLE_POLL_S
        while not done.wait(min(poll, max(0.0, deadline - time.monotonic()) + POLL_S)):
            self._observe()
            if time.monotonic() >= deadline or self._proxy_failure():
                break
        self._observe()
        if not done.is_set():
            abandoned.set()
            said = self._proxy_failure() or stalled(
                self.phases.current or "resolve", self.phases.in_current(), self.settings.connect_timeout,
                f"{self.address}:{self.resolved.port if self.resolved else self.host.port or 22}")
            self._close_transports()
            trace.log.info("%s: not connected: %s (%s)", self.host.name, said, self.phases.summary())
            raise Unreachable(said)
        e = box.get("error")
        if e is None:
            trace.log.info("%s: connected: %s", self.host.name, self.phases.summary())
            self._keepalive = _Keepalive(self._client.get_transport(), *self.keepalive(), self._on_dead)
            self._keepalive.start()
            return
        if isinstance(e, paramiko.BadHostKeyException):
            e = HostKeyRefused(
                f"HOST KEY CHANGED for {e.hostname}: known_hosts has {fingerprint(e.expected_key)}, "
                f"the host offered {fingerprint(e.key)}. Possible man-in-the-middle; nothing was run. "
                "If the change is expected, remove the old key (ssh-keygen -R) and retry.")
        elif (isinstance(e, (OSError, EOFError, paramiko.SSHException))  # AuthenticationException among them
              or type(e) is Unreachable and self.phases.current == "auth"):  # paramiko_auth's refusal
            e = Unreachable(self._failure(e, deadline))
        trace.log.info("%s: not connected in the %s phase: %s (%s)", self.host.name, self.phases.current, e,
                       self.phases.summary())
        raise e from None

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
        first = self.phases.current != "open-session"
        self.phases.mark("open-session")
        try:
            chan = transport.open_session(timeout=wait)
        except (paramiko.SSHException, OSError, EOFError) as e:
            if self.alive():  # paramiko's "Timeout opening channel." on a transport still up
                raise RemoteTimeout(stalled("open-session", wait, self.settings.connect_timeout,
                                            f"{self.address}:{self.resolved.port}")) from None
            raise self.lost(f"while opening a channel ({e})") from None
        if first:
            trace.log.info("%s: open-session %.3f s", self.host.name, self.phases.in_current())
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
