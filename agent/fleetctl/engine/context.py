"""A job's host: the per-host context every job runs with, and the result it returns.

The context holds the host's connection (`conn`: handlers run there) and the `target` (probes,
the lock and the ledger: the host itself, or a container connection that prefixes the host's
commands with the container's entry), the host's deadline, and the probe runner (bundle, trust
check, timing). The fan-out (fleet.py) makes one per host and job; nothing here knows how a
container is entered.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from .. import probes
from ..connection import Connection, RemoteTimeout, Result, Unreachable
from ..connection.base import OUTPUT_MAX
from ..connection.container import ContainerConnection
from ..errors import HostFailed, ProbeFailed
from ..inventory import Host
from ..vocab import HostStatus


def cut_short(host: str, main: str, e: probes.CutShort) -> str:
    """What a probe's answer cut short (probes.CutShort) says: the host (escaped: a name from the
    inventory), the probe, the bytes received against the limit the controller keeps
    (connection.base.OUTPUT_MAX: output past it is refused whole, never cut), the exit status
    and the end of stderr, then the JSON parser's error."""
    tail = e.tail.encode("unicode_escape").decode("ascii")[-300:]
    return (f"the {main} probe's answer from {host!r} ended early: {e.size} bytes of output received, under "
            f"fleetctl's limit of {OUTPUT_MAX} bytes per command (output past it is refused, never cut), exit "
            f"status {e.exit_code}{'; stderr ends: ' + tail if tail else ''}: the probe was stopped while writing it "
            f"or the connection lost its end; {e}")


@dataclass
class HostResult:
    """What happened on one host. status: a HostStatus; elapsed_s in seconds; data: the job's own
    JSON-able payload. Control signals that decide the exit code: `interrupted` (Ctrl-C stopped
    this host: True, or False for a host a stopped rollout left alone for another reason) and
    `parse_error` (a playbook or template error stopped it); None: not applicable."""

    host: str
    address: str
    status: HostStatus
    error: str | None = None
    elapsed_s: float = 0.0
    data: dict[str, Any] = field(default_factory=dict)
    interrupted: bool | None = None
    parse_error: bool | None = None

    def to_json(self) -> dict:
        """The host's entry in a command's `--json` document: host, address, status, error,
        elapsed_s, the job's data, then `interrupted` / `parse_error` when set."""
        doc = {"host": self.host, "address": self.address, "status": self.status, "error": self.error,
               "elapsed_s": self.elapsed_s, **self.data}
        for k in ("interrupted", "parse_error"):
            if getattr(self, k) is not None:
                doc[k] = getattr(self, k)
        return doc


@dataclass
class HostContext:
    """A job's view of its host: `conn`, the open connection to the host itself (handlers,
    uploads, the host's own records); `target`, where probes, the lock and the ledger run (`conn`,
    or a connection.container.ContainerConnection around it: see `inside`); the deadline
    (monotonic seconds) and a way to replace a lost connection (`reconnected`). `container`:
    None on the host; inside a container, what engine/containers found of it ({"how": how it
    was entered, "root": the install's root dict, "found": the facts probe's entry})."""

    host: Host
    conn: Connection
    deadline: float
    reconnect: Callable[[], Connection] | None = None
    # Where this job's time went (seconds): connect_s (opening the connection, 0 when reused),
    # and for the probes run: probes (count), upload_bytes (bundles sent), remote_s (sending the
    # bundle, the run there and reading its output), parse_s (reading the result here).
    timing: dict = field(default_factory=dict)
    target: Connection | None = None
    container: dict | None = None
    # Told each phase the job enters (engine.fleet.Fleet: the progress shown per host).
    on_phase: Callable[[str], None] | None = None

    def __post_init__(self) -> None:
        if self.target is None:
            self.target = self.conn

    def phase(self, name: str) -> None:
        """Say that this host's job enters phase `name` (one of engine.fleet.PHASES, or one with
        a detail after a colon: "restart: restart sglang"); shown by the run's progress."""
        if self.on_phase is not None:
            self.on_phase(name)

    def inside(self, target: ContainerConnection, container: dict) -> "HostContext":
        """This context with probes, the lock and the ledger on `target` (a container connection
        around `conn`), `container` saying what it is (shape: see above)."""
        return replace(self, target=target, container=container)

    def hold_lock(self, state_dir: str, timeout: float, hold_s: float):
        """fleetctl's lock where this job works: on the host, or in its container (Connection.hold_lock)."""
        return self.target.hold_lock(state_dir, timeout=timeout, hold_s=hold_s)

    def reconnected(self) -> "HostContext":
        """This context on a new connection to the host (the old one is closed; a container
        target is entered again over the new one). Raises Unreachable when the host cannot be
        reached again."""
        if self.reconnect is None:
            raise Unreachable("connection lost, and this job cannot reconnect")
        conn = self.reconnect()
        target = conn if self.target is self.conn else self.target.around(conn)
        return replace(self, conn=conn, target=target)

    def result(self, status: HostStatus, error: str | None = None, data: dict | None = None) -> HostResult:
        """A HostResult for this host (its name, the address connected to) with `status`."""
        return HostResult(self.host.name, self.conn.address, status, error, data=data if data is not None else {})

    def remaining(self) -> float:
        """Seconds left before this host's deadline; raises RemoteTimeout when none are left."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise RemoteTimeout("host deadline reached")
        return left

    def run(self, argv: list[str], stdin: bytes = b"", timeout: float | None = None, what: str | None = None,
            keep_ends: bool = False) -> Result:
        """Run `argv` (a list of words) on the host itself, bounded by `timeout` seconds and by
        the host deadline; output bounded as Connection.run says (`what`, `keep_ends`).
        Raises RemoteTimeout, Unreachable, OutputTooLarge."""
        return self._run(self.conn, argv, stdin, timeout, what, keep_ends)

    def _run(self, conn: Connection, argv: list[str], stdin: bytes, timeout: float | None, what: str | None,
             keep_ends: bool = False) -> Result:
        limit = self.remaining() if timeout is None else min(timeout, self.remaining())
        return conn.run(argv, timeout=limit, stdin=stdin, what=what, keep_ends=keep_ends)

    def probe(self, main: str, params: dict, python: str | None = None, timeout: float | None = None) -> dict:
        """Run probe `main` with `params` (its bundle: probes.modules_for) on the target (the host, or its container) under
        `python` (a path), else the target's interpreter (on the host the inventory's, with its
        options: Host.interpreter; in a container the install's), else the recorded one or
        python3 on PATH. On a target that checks interpreters (the host), the same command checks
        the interpreter and every directory above it before it runs it (probes/trust.py GUARD; no
        second round trip, nothing cached): one that root must not run raises HostFailed naming
        the file; the target's own older than 3.8 is passed over for a running server's or
        another 3.8+ one (probes.command; `python`, an install's, never is), and with none
        HostFailed says so ("the probes need Python 3.8+; ...").
        In a container the interpreter is the container's own, run with no more power than its
        process has (connection/container.py). Raises ProbeFailed, RemoteTimeout, Unreachable,
        OutputTooLarge."""
        t = self.target
        py, options = (python or t.python, ()) if python or not t.checks_interpreters else \
            (self.host.interpreter or (None, ()))
        stdin = probes.bundle(main, params)
        t0 = time.monotonic()
        r = self._run(t, probes.command(py, guard=t.checks_interpreters, options=options, fallback=python is None),
                      stdin, timeout, f"the {main} probe")
        t1 = time.monotonic()
        try:
            out = probes.parse_output(r.stdout, r.stderr, r.exit_code)
        except probes.Untrusted as e:
            raise HostFailed(f"interpreter {py or 'python3 on PATH'} refused: {e} (fleetctl runs it as root)") from None
        except probes.NoPython as e:
            raise HostFailed(str(e)) from None
        except probes.CutShort as e:
            raise ProbeFailed(cut_short(self.host.name, main, e)) from None
        except probes.ProbeError as e:
            raise ProbeFailed(str(e)) from None
        t = self.timing
        t.update(probes=t.get("probes", 0) + 1, upload_bytes=t.get("upload_bytes", 0) + len(stdin),
                 remote_s=round(t.get("remote_s", 0) + t1 - t0, 3),
                 parse_s=round(t.get("parse_s", 0) + time.monotonic() - t1, 3))
        return out
