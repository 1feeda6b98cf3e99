"""Bounded parallel fan-out over hosts: forks, per-host deadlines, rolling batches, progress.

A host job is a function `job(ctx: context.HostContext) -> HostResult`; `Fleet.run` opens one
verified connection per host (by the run's connection.Session, from the host's
ansible_connection; kept for the whole run and reused by later jobs), gives the job a context
whose `remaining()` bounds every remote command by the host's deadline, and turns connection
problems (Unreachable) into `unreachable` and every other per-host error (errors.HostError)
into `failed`, so one bad host never stops the others. A run-level deadline
(`run_timeout`) ends the whole command: hosts still in progress then are failed and their
connections closed, hosts not started are not attempted. A job may carry `stopped_note`
(text: what being stopped mid-job leaves behind, e.g. changes.STOPPED_NOTE), which the Ctrl-C and
run-deadline messages add; the fan-out itself knows nothing about what jobs do.
"""

from __future__ import annotations

import math
import signal
import threading
import time
import traceback
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from typing import Callable

from rich.markup import escape
from rich.console import Console

from ..connection import Connection, Session, Settings, Unreachable
from ..errors import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_PARSE, EXIT_UNREACHABLE, FleetctlError, HostError
from ..inventory import Host
from ..limits import FDS_PER_HOST, forks_allowed
from ..vocab import HostStatus
from .context import HostContext, HostResult
from .progress import RunProgress

def parse_serial(spec: str | None, total: int) -> list[int]:
    """Batch sizes for `--serial` (Ansible's serial): "2", "25%", or a list "1,25%,100%"
    (the last size repeats). None: one batch of all. Raises ValueError naming the bad part."""
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
            raise ValueError(f"{part!r} is not a positive number or a percentage in (0, 100]") from None
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
    if HostStatus.UNREACHABLE in statuses:
        return EXIT_UNREACHABLE
    if HostStatus.FAILED in statuses or HostStatus.NOT_ATTEMPTED in statuses:
        return EXIT_FAILED
    return EXIT_OK


# Seconds between two looks at the hosts' futures and the signals counted meanwhile (Fleet.run)
WAIT_TICK_S = 0.2


class _Signals:
    """SIGINT and SIGTERM counted, not raised, while Fleet.run waits on its hosts: the handler
    that was there runs (cli/signals.py's SIGTERM handler records that the run was terminated), the
    KeyboardInterrupt it raises is swallowed, and run() acts on the count between two waits. A
    KeyboardInterrupt raised inside concurrent.futures' waits can leave a future's condition
    lock held (CPython bpo-29988: an exception between a lock's acquire and the `with` block),
    after which the worker that completes that future blocks for ever: a Ctrl-C that hung the
    run instead of letting the host in progress finish. A signal the process ignores (SIG_IGN)
    is not counted."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.count = 0
        self.previous: dict[int, object] = {}

    @classmethod
    def install(cls) -> "_Signals | None":
        """The counter, its handlers installed; None off the main thread (where Python lets no
        handler be set, and a KeyboardInterrupt cannot arrive)."""
        if threading.current_thread() is not threading.main_thread():
            return None
        self = cls()
        for signum in cls.SIGNALS:
            prev = signal.getsignal(signum)
            self.previous[signum] = prev
            if prev is not signal.SIG_IGN:
                signal.signal(signum, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        prev = self.previous.get(signum)
        if callable(prev):
            try:
                prev(signum, frame)
            except KeyboardInterrupt:
                pass
        self.count += 1

    def take(self) -> bool:
        """Whether a signal was counted and not yet taken (it is then taken)."""
        if self.count <= 0:
            return False
        self.count -= 1
        return True

    def restore(self) -> None:
        """Put the handlers that were there back."""
        for signum, prev in self.previous.items():
            if prev is not signal.SIG_IGN and prev is not None:
                signal.signal(signum, prev)


class Fleet:
    """Runs jobs across hosts with at most `forks` at once, each within `timeout` seconds, the
    whole command within `run_timeout` seconds (None: no run-level deadline). The run's
    connection.Session (made from `settings`) makes each host's connection, unless `connect(host)`
    is given. `progress`: how each run shows its hosts' phases on `console` (engine.progress.MODES,
    None: not at all)."""

    def __init__(self, settings: Settings, forks: int = 64, timeout: float = 60.0,
                 progress: str | None = None, console: Console | None = None, run_timeout: float | None = None,
                 connect: Callable[[Host], Connection] | None = None):
        if forks < 1 or timeout <= 0 or (run_timeout is not None and run_timeout <= 0):
            raise ValueError(f"forks {forks} (at least 1), timeout {timeout} and run_timeout {run_timeout} "
                             "(positive) out of range")
        self.session = Session(settings)
        self.connect = connect or self.session.connect
        self.run_timeout = run_timeout
        self.run_deadline = None if run_timeout is None else time.monotonic() + run_timeout
        self.expired = False  # set when the run-level deadline passed: no host starts any more
        self.forks = forks_allowed(forks)  # what the open-files limit allows at once (limits.py)
        if self.forks < forks:
            (console or Console(stderr=True)).print(
                f"[yellow]note:[/] --forks {forks}: the open-files limit (ulimit -n) allows {self.forks} hosts "
                f"at once ({FDS_PER_HOST} descriptors each); working on {self.forks} at a time", highlight=False)
        self.timeout = timeout
        self.progress = progress  # engine.progress.MODES: "bar", "lines", or None
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
            conn = self.connect(host)
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

    def release(self, host: Host) -> None:
        """Release the run's connection to `host`, if any (Connection.release: closed, except an
        OpenSSH master, which other inventory hosts of the run may share): its job was its last
        (Fleet.run's `last`), so a fleet wider than --forks holds at most --forks connections,
        their descriptors, threads (paramiko's transport) and buffers at once."""
        with self._conns_lock:
            conn = self._conns.pop(host.name, None)
        if conn is not None:
            conn.release()

    def close(self) -> None:
        """Close every connection this fleet opened, then the run's session (Session.close:
        OpenSSH masters)."""
        with self._conns_lock:
            self._closing = True
            conns = list(self._conns.values())
            self._conns.clear()
        for conn in conns:
            conn.close()
        self.session.close()

    def __enter__(self) -> "Fleet":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _one(self, host: Host, job: Callable[[HostContext], HostResult], timeout: float,
             progress: RunProgress, last: bool = False) -> HostResult:
        start = time.monotonic()
        result = HostResult(host.name, host.address, HostStatus.FAILED)
        try:
            progress.phase(host.name, "connect")
            conn = self.connection(host)
            result.address = conn.address
            result = job(HostContext(host, conn, start + timeout, lambda: self.reconnect(host),
                                     timing={"connect_s": round(time.monotonic() - start, 3)},
                                     on_phase=lambda name: progress.phase(host.name, name)))
        except Unreachable as e:
            result.status, result.error = HostStatus.UNREACHABLE, str(e)
        except HostError as e:  # this host's job failed (a probe, the lock, sudo, a deadline, a refusal)
            result.status, result.error = HostStatus.FAILED, e.describe(timeout)
        except FleetctlError as e:  # a template or expression error in the playbook, say
            result.status, result.error = HostStatus.FAILED, str(e)
            result.parse_error = e.exit_code == EXIT_PARSE
        except Exception as e:  # a bug or an unexpected remote state must not stop other hosts
            result.status, result.error = HostStatus.FAILED, f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}"
        if last:
            self.release(host)
        result.elapsed_s = round(time.monotonic() - start, 3)
        progress.done(host.name, result.status, result.elapsed_s)
        return result

    def run(self, hosts: list[Host], job: Callable[[HostContext], HostResult],
            label: str = "hosts", timeout: float | None = None, last: bool = False) -> list[HostResult]:
        """Run `job` on every host (at most `forks` at once), each within `timeout` seconds
        (default: the fleet's); results in inventory order. `last`: no later run of this fleet
        uses these hosts, so each host's connection is closed when its job ends (release)."""
        timeout = timeout or self.timeout
        note = getattr(job, "stopped_note", None)
        results: dict[str, HostResult] = {}
        if self.expired:
            return [HostResult(h.name, h.address, HostStatus.NOT_ATTEMPTED, self._expired_msg()) for h in hosts]
        progress = RunProgress(label, len(hosts), self.console, self.progress)
        progress.start()
        pool = ThreadPoolExecutor(max_workers=min(self.forks, max(1, len(hosts))))
        futures = {pool.submit(self._one, h, job, timeout, progress, last): h for h in hosts}
        pending = set(futures)
        signals = _Signals.install()
        try:
            while pending:
                try:
                    left = None if self.run_deadline is None else max(0.0, self.run_deadline - time.monotonic())
                    done, _ = wait(pending, timeout=WAIT_TICK_S if left is None else min(WAIT_TICK_S, left),
                                   return_when=FIRST_COMPLETED)
                    for fut in done:
                        pending.discard(fut)
                        r = fut.result()
                        results[r.host] = r
                    if pending and left is not None and left <= 0:
                        self._expire(pending, futures, results, note)
                        break
                    if signals and signals.take():
                        raise KeyboardInterrupt
                except KeyboardInterrupt:
                    if self.interrupted:
                        self._abandon(pending, futures, results, note)
                        break
                    # Hosts already started finish their job (whatever it started, it ends);
                    # hosts not started are left alone. A second Ctrl-C stops waiting.
                    self.interrupted = True
                    for fut in list(pending):
                        if fut.cancel():
                            pending.discard(fut)
                            h = futures[fut]
                            results[h.name] = HostResult(h.name, h.address, HostStatus.NOT_ATTEMPTED,
                                                         "interrupted (Ctrl-C) before this host started",
                                                         interrupted=True)
                    self.console.print(f"[bold yellow]interrupted:[/] waiting for {len(pending)} host(s) in "
                                       "progress to finish; no new host starts (Ctrl-C again to stop waiting)")
                    if signals and signals.take():  # a second signal came before this one was handled
                        self._abandon(pending, futures, results, note)
                        break
        finally:
            if signals:
                signals.restore()
            pool.shutdown(wait=not (self.interrupted or self.expired) or not pending, cancel_futures=True)
            progress.stop()
        return [results[h.name] for h in hosts]

    def _abandon(self, pending: set, futures: dict, results: dict, note: str | None = None) -> None:
        """A second Ctrl-C: stop waiting. Each host in progress is failed as interrupted (its
        connection closed, which ends every wait on it; a connect still in progress is abandoned:
        its connection is closed as soon as it opens, Fleet.connection) and named on the console
        with the job's stopped_note `note`; the hosts that finished keep their results, which
        the command then prints and records. The worker threads left are not waited for:
        cli.main ends the process without joining them (cli.abandoned_threads)."""
        with self._conns_lock:
            self._closing = True
            conns = [self._conns.pop(futures[fut].name, None) for fut in pending]
        for fut in pending:
            h = futures[fut]
            self.console.print(f"[bold red]stopped while {escape(h.name)} was in progress"
                               + (f":[/] {escape(note)}" if note else "[/]"), highlight=False)
            results[h.name] = HostResult(h.name, h.address, HostStatus.FAILED,
                                         "interrupted (Ctrl-C twice) while this host was in progress: its "
                                         "connection was closed" + (f"; {note}" if note else ""), interrupted=True)
        for conn in conns:
            if conn is not None:
                conn.close()

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
                results[h.name] = HostResult(h.name, h.address, HostStatus.NOT_ATTEMPTED, self._expired_msg())
            else:
                results[h.name] = HostResult(
                    h.name, h.address, HostStatus.FAILED,
                    f"the run's deadline (--run-timeout {self.run_timeout:g} s) passed while this host was in "
                    "progress: its connection was closed" + (f"; {note}" if note else ""))
                conn = self._conns.get(h.name)
                if conn is not None:
                    conn.close()
