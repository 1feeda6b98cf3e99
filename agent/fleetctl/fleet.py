"""Bounded parallel fan-out over hosts: forks, per-host deadlines, rolling batches, progress.

A host job is a function `job(ctx: HostContext) -> HostResult`; `Fleet.run` opens one verified
connection per host (kept for the whole run and reused by later jobs), gives the job a context whose `remaining()` bounds every remote command by
the host's deadline, and turns connection problems into `unreachable` and everything else into
`failed`, so one bad host never stops the others.
"""

from __future__ import annotations

import math
import time
import traceback
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import Any, Callable

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from . import probes
from .errors import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_PARSE, EXIT_UNREACHABLE, FleetctlError, UsageError
from .inventory import Host
from .transport import HostConnection, LockBusy, RemoteTimeout, Result, SSHSettings, Unreachable

OK, CHANGED, SKIPPED, FAILED, UNREACHABLE, NOT_ATTEMPTED = (
    "ok", "changed", "skipped", "failed", "unreachable", "not attempted")


@dataclass
class HostResult:
    """What happened on one host. status: ok | changed | skipped | failed | unreachable |
    not attempted; elapsed_s in seconds; data: the job's own JSON-able payload."""

    host: str
    address: str
    status: str
    error: str | None = None
    elapsed_s: float = 0.0
    data: dict[str, Any] = field(default_factory=dict)


class HostFailed(Exception):
    """Raised by a job to mark its host failed with a message (no traceback shown)."""


@dataclass
class HostContext:
    """A job's view of its host: the open connection and its deadline (monotonic seconds)."""

    host: Host
    conn: HostConnection
    deadline: float

    def remaining(self) -> float:
        """Seconds left before this host's deadline; raises RemoteTimeout when none are left."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise RemoteTimeout("host deadline reached")
        return left

    def run(self, command: str, stdin: bytes = b"", timeout: float | None = None) -> Result:
        """Run a shell command, bounded by `timeout` seconds and by the host deadline."""
        limit = self.remaining() if timeout is None else min(timeout, self.remaining())
        return self.conn.run(command, timeout=limit, stdin=stdin)

    def probe(self, main: str, params: dict, modules: list[str] | None = None,
              python: str | None = None, timeout: float | None = None) -> dict:
        """Run probe `main` with `params` on the host's interpreter (`python`, or the inventory's,
        or python3 on PATH). Raises probes.ProbeError, RemoteTimeout, Unreachable."""
        py = python or self.host.python
        r = self.run(probes.command(py), stdin=probes.bundle(main, params, modules), timeout=timeout)
        return probes.parse_output(r.stdout, r.stderr, r.exit_code)


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
    if any(r.data.get("parse_error") for r in results):
        return EXIT_PARSE
    if any(r.data.get("interrupted") for r in results):
        return EXIT_INTERRUPTED
    statuses = {r.status for r in results}
    if UNREACHABLE in statuses:
        return EXIT_UNREACHABLE
    if FAILED in statuses or NOT_ATTEMPTED in statuses:
        return EXIT_FAILED
    return EXIT_OK


class Fleet:
    """Runs jobs across hosts with at most `forks` at once, each within `timeout` seconds."""

    def __init__(self, settings: SSHSettings, forks: int = 64, timeout: float = 60.0,
                 progress: bool = False, console: Console | None = None):
        if forks < 1:
            raise UsageError("--forks must be at least 1")
        if timeout <= 0:
            raise UsageError("--timeout must be positive")
        self.settings = settings
        self.forks = forks
        self.timeout = timeout
        self.progress = progress
        self.console = console or Console(stderr=True)
        self._conns: dict[str, HostConnection] = {}
        self.interrupted = False  # set by Ctrl-C: later batches must not start

    def connection(self, host: Host) -> HostConnection:
        """The run's one connection to `host`, opened on first use and reused by every later job.
        Raises Unreachable / HostKeyRefused."""
        conn = self._conns.get(host.name)
        if conn is None:
            conn = HostConnection(host, self.settings)
            try:
                conn.open()
            except Unreachable:
                conn.close()
                raise
            self._conns[host.name] = conn
        return conn

    def close(self) -> None:
        """Close every connection this fleet opened."""
        for conn in self._conns.values():
            conn.close()
        self._conns.clear()

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
            out = job(HostContext(host, conn, start + timeout))
            if isinstance(out, HostResult):
                result = out
            else:
                result.status, result.data = OK, out
        except Unreachable as e:
            result.status, result.error = UNREACHABLE, str(e)
        except RemoteTimeout as e:
            result.status, result.error = FAILED, f"deadline ({timeout:g} s) passed: {e}"
        except (HostFailed, LockBusy, probes.ProbeError) as e:
            result.status, result.error = FAILED, str(e)
        except FleetctlError as e:  # a template or expression error in the playbook, say
            result.status, result.error = FAILED, str(e)
            result.data["parse_error"] = e.exit_code == EXIT_PARSE
        except Exception as e:  # a bug or an unexpected remote state must not stop other hosts
            result.status, result.error = FAILED, f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}"
        result.elapsed_s = round(time.monotonic() - start, 3)
        return result

    def run(self, hosts: list[Host], job: Callable[[HostContext], HostResult | dict],
            label: str = "hosts", timeout: float | None = None) -> list[HostResult]:
        """Run `job` on every host (at most `forks` at once), each within `timeout` seconds
        (default: the fleet's); results in inventory order."""
        timeout = timeout or self.timeout
        results: dict[str, HostResult] = {}
        progress = None
        if self.progress:
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
                    for fut in as_completed(pending):
                        pending.discard(fut)
                        r = fut.result()
                        results[r.host] = r
                        if progress:
                            progress.advance(task)
                except KeyboardInterrupt:
                    if self.interrupted:
                        for fut in pending:
                            self.console.print(
                                f"[bold red]stopped while {futures[fut].name} was in progress:[/] a change there "
                                "stays pending in its ledger; the next apply, deploy or rollback on it undoes "
                                "it (`fleetctl status` shows it)", highlight=False)
                        raise
                    # Hosts already started finish their job (a change completes or rolls back);
                    # hosts not started are left alone. A second Ctrl-C stops waiting.
                    self.interrupted = True
                    for fut in list(pending):
                        if fut.cancel():
                            pending.discard(fut)
                            h = futures[fut]
                            results[h.name] = HostResult(h.name, h.address, NOT_ATTEMPTED,
                                                         "interrupted (Ctrl-C) before this host started",
                                                         data={"interrupted": True})
                    self.console.print(f"[bold yellow]interrupted:[/] waiting for {len(pending)} host(s) in "
                                       "progress to finish; no new host starts (Ctrl-C again to stop waiting)")
        finally:
            pool.shutdown(wait=not self.interrupted or not pending, cancel_futures=True)
            if progress:
                progress.stop()
        return [results[h.name] for h in hosts]
