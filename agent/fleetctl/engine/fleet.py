"""Bounded parallel fan-out over hosts: forks, per-host deadlines, rolling batches, progress.

A host job is a function `job(ctx: HostContext) -> HostResult`; `Fleet.run` opens one verified
connection per host (from the `connect` factory, by the host's ansible_connection; kept for the
whole run and reused by later jobs), gives the job a context whose `remaining()` bounds every
remote command by the host's deadline, and turns connection problems into `unreachable` and
everything else into `failed`, so one bad host never stops the others. A run-level deadline
(`run_timeout`) ends the whole command: hosts still in progress then are failed and their
connections closed, hosts not started are not attempted. A job may carry `stopped_note`
(text: what being stopped mid-job leaves behind, e.g. changes.STOPPED_NOTE), which the Ctrl-C and
run-deadline messages add; the fan-out itself knows nothing about what jobs do.
"""

from __future__ import annotations

import math
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor, as_completed
from concurrent.futures import TimeoutError as FuturesTimeout
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from rich.markup import escape
from rich.console import Console

from .. import probes
from ..errors import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_PARSE, EXIT_UNREACHABLE, FleetctlError, UsageError
from ..connection import BecomeFailed, Connection, LockBusy, OutputTooLarge, RemoteTimeout, Result, Settings, Unreachable, connect
from ..inventory import Host
from ..vocab import HostStatus

# The host statuses under their short names (for callers that import them from here).
OK, CHANGED, SKIPPED, FAILED, UNREACHABLE, NOT_ATTEMPTED = (
    HostStatus.OK, HostStatus.CHANGED, HostStatus.SKIPPED, HostStatus.FAILED, HostStatus.UNREACHABLE,
    HostStatus.NOT_ATTEMPTED)


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


class HostFailed(Exception):
    """Raised by a job to mark its host failed with a message (no traceback shown)."""


# The trust probe and the module whose check it runs.
TRUST_MODULES = [*probes.FACTS_MODULES, "trust"]


@dataclass
class HostContext:
    """A job's view of its host: the open connection, its deadline (monotonic seconds), and a
    way to replace a lost connection (`reconnected`). `container`: None on the host itself;
    for a job on a container install (see `inside`), {"entry": command.container_entry
    prefix, "how": how it is entered, "root": the install's root dict, "python": the
    container's interpreter}: probes and the lock then run inside, commands (`run`: handlers)
    on the host."""

    host: Host
    conn: Connection
    deadline: float
    reconnect: Callable[[], Connection] | None = None
    # Where this job's time went (seconds): connect_s (opening the connection, 0 when reused),
    # and for the probes run: probes (count), upload_bytes (bundles sent), remote_s (sending the
    # bundle, the run there and reading its output), parse_s (reading the result here).
    timing: dict = field(default_factory=dict)
    container: dict | None = None

    def inside(self, container: dict) -> "HostContext":
        """This context with probes and the lock entered into `container` (shape: see above)."""
        return replace(self, container=container)

    def hold_lock(self, state_dir: str, timeout: float, hold_s: float):
        """fleetctl's lock on this host, or inside the container (Connection.hold_lock)."""
        if self.container is None:
            return self.conn.hold_lock(state_dir, timeout=timeout, hold_s=hold_s)
        return self.conn.hold_lock(state_dir, timeout=timeout, hold_s=hold_s, inside=self.container["entry"],
                                   python=self.container["python"])

    def reconnected(self) -> "HostContext":
        """This context on a new connection to the host (the old one is closed). Raises
        Unreachable when the host cannot be reached again."""
        if self.reconnect is None:
            raise Unreachable("connection lost, and this job cannot reconnect")
        return replace(self, conn=self.reconnect())

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
        """Run `argv` (a list of words) on the host, bounded by `timeout` seconds and by the host
        deadline; output bounded as Connection.run says (`what`, `keep_ends`).
        Raises RemoteTimeout, Unreachable, OutputTooLarge."""
        limit = self.remaining() if timeout is None else min(timeout, self.remaining())
        return self.conn.run(argv, timeout=limit, stdin=stdin, what=what, keep_ends=keep_ends)

    def probe(self, main: str, params: dict, modules: list[str] | None = None,
              python: str | None = None, timeout: float | None = None) -> dict:
        """Run probe `main` with `params` on the host's interpreter (`python`, or the inventory's,
        or python3 on PATH). A named interpreter is first checked by the trust probe under
        python3 on PATH (once per connection): one that root must not run (probes/facts.py
        `untrusted`) raises HostFailed naming the file. Inside a container (`container`) the
        probe runs under the container's own interpreter (default: the install's), entered by
        the container's prefix; no trust probe there (the image's files are the container's;
        the runtime confines it, or, entered with nsenter, the report says it is trusted as
        host root). Raises probes.ProbeError, RemoteTimeout, Unreachable, OutputTooLarge."""
        if self.container is not None:
            return self._run_probe(main, params, modules, python or self.container["python"], timeout)
        py = python or self.host.python
        if py and py not in self.conn.trusted_interpreters:
            why = self._run_probe("trust", {"python": py}, TRUST_MODULES, None, timeout)["untrusted"]
            if why:
                raise HostFailed(f"interpreter {py} refused: {why} (fleetctl runs it as root)")
            self.conn.trusted_interpreters.add(py)
        return self._run_probe(main, params, modules, py, timeout)

    def _run_probe(self, main: str, params: dict, modules: list[str] | None, python: str | None,
                   timeout: float | None) -> dict:
        entry = self.container["entry"] if self.container is not None else []
        stdin = probes.bundle(main, params, modules)
        t0 = time.monotonic()
        r = self.run([*entry, *probes.command(python, main)], stdin=stdin, timeout=timeout, what=f"the {main} probe")
        t1 = time.monotonic()
        out = probes.parse_output(r.stdout, r.stderr, r.exit_code)
        t = self.timing
        t.update(probes=t.get("probes", 0) + 1, upload_bytes=t.get("upload_bytes", 0) + len(stdin),
                 remote_s=round(t.get("remote_s", 0) + t1 - t0, 3),
                 parse_s=round(t.get("parse_s", 0) + time.monotonic() - t1, 3))
        return out


def parse_serial(spec: str | None, total: int) -> list[int]:
    """Batch sizes for `--serial` (Ansible's serial): "2", "25%", or a list "1,25%,100%"
    (the last size repeats). None: one batch of all. Raises UsageError on a bad spec."""
    if not spec:
        return [total]
    sizes = []
    for part in spec.split(","):
        part = part.strip()
        try:
            if part.endswith("%"):
                pct = float(part[:-1])
                if not 0 < pct <= 100:
                    raise ValueError
                sizes.append(max(1, math.floor(total * pct / 100)))
            else:
                n = int(part)
                if n < 1:
                    raise ValueError
                sizes.append(n)
        except ValueError:
            raise UsageError(f"--serial: {part!r} is not a positive number or a percentage in (0, 100]") from None
    batches, left, i = [], total, 0
    while left > 0:
        n = min(sizes[min(i, len(sizes) - 1)], left)
        batches.append(n)
        left -= n
        i += 1
    return batches


def exit_code(results: list[HostResult]) -> int:
    """Ansible's exit code for a set of host results: 4 if a playbook or template error stopped a
    host, 130 if Ctrl-C stopped the run, 3 if any unreachable, 2 if any failed."""
    if any(r.parse_error for r in results):
        return EXIT_PARSE
    if any(r.interrupted for r in results):
        return EXIT_INTERRUPTED
    statuses = {r.status for r in results}
    if UNREACHABLE in statuses:
        return EXIT_UNREACHABLE
    if FAILED in statuses or NOT_ATTEMPTED in statuses:
        return EXIT_FAILED
    return EXIT_OK


class Fleet:
    """Runs jobs across hosts with at most `forks` at once, each within `timeout` seconds, the
    whole command within `run_timeout` seconds (None: no run-level deadline). `connect(host,
    settings)` makes a host's connection (default: by its ansible_connection)."""

    def __init__(self, settings: Settings, forks: int = 64, timeout: float = 60.0,
                 progress: bool = False, console: Console | None = None, run_timeout: float | None = None,
                 connect: Callable[[Host, Settings], Connection] = connect):
        if forks < 1:
            raise UsageError("--forks must be at least 1")
        if timeout <= 0:
            raise UsageError("--timeout must be positive")
        if run_timeout is not None and run_timeout <= 0:
            raise UsageError("--run-timeout must be positive")
        self.settings = settings
        self.connect = connect
        self.run_timeout = run_timeout
        self.run_deadline = None if run_timeout is None else time.monotonic() + run_timeout
        self.expired = False  # set when the run-level deadline passed: no host starts any more
        self.forks = forks
        self.timeout = timeout
        self.progress = progress
        self.console = console or Console(stderr=True)
        self._conns: dict[str, Connection] = {}
        self._conns_lock = threading.Lock()  # workers add connections while close() may run (review L8)
        self._closing = False  # set by close(): no connection is opened or kept after it
        self.interrupted = False  # set by Ctrl-C: later batches must not start

    def connection(self, host: Host) -> Connection:
        """The run's one connection to `host`, opened on first use and reused by every later job.
        Raises Unreachable / HostKeyRefused, and Unreachable when the fleet is closing (a second
        Ctrl-C): a connection that finished opening meanwhile is closed, never used."""
        with self._conns_lock:
            conn = None if self._closing else self._conns.get(host.name)
            closing = self._closing
        if closing:
            raise Unreachable("not connected: the run is stopping")
        if conn is None:
            conn = self.connect(host, self.settings)
            try:
                conn.open()
            except Unreachable:
                conn.close()
                raise
            with self._conns_lock:
                closing = self._closing
                if not closing:
                    self._conns[host.name] = conn
            if closing:
                conn.close()
                raise Unreachable("not connected: the run is stopping")
        return conn

    def reconnect(self, host: Host) -> Connection:
        """Close the run's connection to `host` and open a new one (one try, within the connect
        timeout). Raises Unreachable / HostKeyRefused."""
        with self._conns_lock:
            old = self._conns.pop(host.name, None)
        if old is not None:
            old.close()
        return self.connection(host)

    def close(self) -> None:
        """Close every connection this fleet opened, then the run's shared connection state
        (Settings.close: OpenSSH masters)."""
        with self._conns_lock:
            self._closing = True
            conns = list(self._conns.values())
            self._conns.clear()
        for conn in conns:
            conn.close()
        self.settings.close()

    def __enter__(self) -> "Fleet":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _one(self, host: Host, job: Callable[[HostContext], HostResult | dict], timeout: float) -> HostResult:
        start = time.monotonic()
        result = HostResult(host.name, host.address, FAILED)
        try:
            conn = self.connection(host)
            result.address = conn.address
            out = job(HostContext(host, conn, start + timeout, lambda: self.reconnect(host),
                                  timing={"connect_s": round(time.monotonic() - start, 3)}))
            if isinstance(out, HostResult):
                result = out
            else:
                result.status, result.data = OK, out
        except Unreachable as e:
            result.status, result.error = UNREACHABLE, str(e)
        except RemoteTimeout as e:
            result.status, result.error = FAILED, f"deadline ({timeout:g} s) passed: {e}"
        except (BecomeFailed, HostFailed, LockBusy, OutputTooLarge, probes.ProbeError) as e:
            result.status, result.error = FAILED, str(e)
        except FleetctlError as e:  # a template or expression error in the playbook, say
            result.status, result.error = FAILED, str(e)
            result.parse_error = e.exit_code == EXIT_PARSE
        except Exception as e:  # a bug or an unexpected remote state must not stop other hosts
            result.status, result.error = FAILED, f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}"
        result.elapsed_s = round(time.monotonic() - start, 3)
        return result

    def run(self, hosts: list[Host], job: Callable[[HostContext], HostResult | dict],
            label: str = "hosts", timeout: float | None = None) -> list[HostResult]:
        """Run `job` on every host (at most `forks` at once), each within `timeout` seconds
        (default: the fleet's); results in inventory order."""
        timeout = timeout or self.timeout
        note = getattr(job, "stopped_note", None)
        results: dict[str, HostResult] = {}
        if self.expired:
            return [HostResult(h.name, h.address, NOT_ATTEMPTED, self._expired_msg()) for h in hosts]
        progress = None
        if self.progress:
            # imported only for a progress bar (a terminal): 26 ms of a --json run's start otherwise
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
            progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                TimeElapsedColumn(), console=self.console, transient=True)
            progress.start()
            task = progress.add_task(label, total=len(hosts))
        pool = ThreadPoolExecutor(max_workers=min(self.forks, max(1, len(hosts))))
        futures = {pool.submit(self._one, h, job, timeout): h for h in hosts}
        pending = set(futures)
        try:
            while pending:
                try:
                    left = None if self.run_deadline is None else max(0.0, self.run_deadline - time.monotonic())
                    for fut in as_completed(pending, timeout=left):
                        pending.discard(fut)
                        r = fut.result()
                        results[r.host] = r
                        if progress:
                            progress.advance(task)
                except FuturesTimeout:
                    self._expire(pending, futures, results, note)
                    break
                except KeyboardInterrupt:
                    if self.interrupted:
                        for fut in pending:
                            self.console.print(f"[bold red]stopped while {escape(futures[fut].name)} was in progress"
                                               + (f":[/] {escape(note)}" if note else "[/]"), highlight=False)
                        raise
                    # Hosts already started finish their job (whatever it started, it ends);
                    # hosts not started are left alone. A second Ctrl-C stops waiting.
                    self.interrupted = True
                    for fut in list(pending):
                        if fut.cancel():
                            pending.discard(fut)
                            h = futures[fut]
                            results[h.name] = HostResult(h.name, h.address, NOT_ATTEMPTED,
                                                         "interrupted (Ctrl-C) before this host started",
                                                         interrupted=True)
                    self.console.print(f"[bold yellow]interrupted:[/] waiting for {len(pending)} host(s) in "
                                       "progress to finish; no new host starts (Ctrl-C again to stop waiting)")
        finally:
            pool.shutdown(wait=not (self.interrupted or self.expired) or not pending, cancel_futures=True)
            if progress:
                progress.stop()
        return [results[h.name] for h in hosts]

    def _expired_msg(self) -> str:
        return f"not attempted: the run's deadline (--run-timeout {self.run_timeout:g} s) passed"

    def _expire(self, pending: set, futures: dict, results: dict, note: str | None = None) -> None:
        """The run-level deadline passed: hosts not started are not attempted; hosts in progress
        are failed and their connections closed (which ends every wait on them); `note` is the
        job's stopped_note."""
        self.expired = True
        for fut in list(pending):
            h = futures[fut]
            if fut.cancel():
                results[h.name] = HostResult(h.name, h.address, NOT_ATTEMPTED, self._expired_msg())
            else:
                results[h.name] = HostResult(
                    h.name, h.address, FAILED,
                    f"the run's deadline (--run-timeout {self.run_timeout:g} s) passed while this host was in "
                    "progress: its connection was closed" + (f"; {note}" if note else ""))
                conn = self._conns.get(h.name)
                if conn is not None:
                    conn.close()
