"""Recording a host-touching command in the run history, in three calls from the CLI: `start` when
the command is about to work on hosts (options.fleet_command arms it, FleetOptions.fleet begins
it: a usage, pattern or inventory error before that is no run), `results` when its `--json` document comes out
(cli.fleet._finish, the one place every command's results pass through) and `end` with the
process's exit code (cli.main, every way out: results, errors, Ctrl-C, SIGTERM).

Everything is redacted here before the store sees it, with the one redactor (probes.redact): the
command line with `redact.argv`, and every string of the run's document (the hosts' entries
included, which the hosts redacted already) with `redact.text`, argument lists ("argv") with
`redact.argv`. Before that, every occurrence of each secret value the command handed over
(`secrets`: the inventory's vault values and what was rendered from them, become and vault
passwords, API-key vars) is replaced by redact.REDACTED in every string, keys and the command
line included, whatever quoted it (as probes.traffic.load.scrub does with a server's API key); record
never reads the inventory itself. Option values that are files (--vault-password-file) are paths, stored as given;
their contents are never read here.

Recording never stops the fleet job nor changes its exit code: a history file that cannot be
used (unwritable, locked past the busy timeout, not a SQLite file, of a newer schema) is one
warning on stderr, and the run goes on unrecorded.
"""

from __future__ import annotations

import getpass
import json
import os
import contextlib
import re
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from secrets import token_hex
from typing import Any, Iterable, Iterator

from .. import __version__
from ..probes import redact
from .store import Store, boot_id, pid_namespace, process_started

ARGV_KEYS = frozenset(("argv", "cmdline"))  # keys whose value is an argument list (probes/procs, units)


@dataclass
class _Recording:
    store: Store
    run_id: str
    argv: list[str]
    document: dict | None = None


_current: list[_Recording] = []  # the run being recorded in this process (none or one)
_armed: list[tuple[str, str | None]] = []  # the run to record once it begins (arm, begin)
_secrets: set[str] = set()  # the secret values this process knows (secrets)


def _warn(e: Exception, what: str = "this run is") -> None:
    sys.stderr.write(f"fleetctl: warning: {e}; {what} not recorded in the history\n")


def _user() -> str:
    """Who runs fleetctl: the login name (getpass), else the uid (a process without a passwd entry)."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return str(os.getuid())


def redacted(value: Any, key: str | None = None) -> Any:
    """A JSON value with every string redacted (redact.text), a list of strings under one of
    ARGV_KEYS as an argument list (redact.argv)."""
    if isinstance(value, str):
        return redact.text(value)
    if isinstance(value, list):
        if key in ARGV_KEYS and all(isinstance(v, str) for v in value):
            return redact.argv(value)
        return [redacted(v) for v in value]
    if isinstance(value, dict):
        return {k: redacted(v, k) for k, v in value.items()}
    return value


def secrets(values: Iterable[str]) -> None:
    """Add `values` (text; empty ones ignored) to the secrets this process knows: `end` replaces
    each occurrence of any of them in what it stores (scrubbed)."""
    _secrets.update(v for v in values if isinstance(v, str) and v)


def scrubbed(value: Any, known: Iterable[str]) -> Any:
    """A JSON value with every occurrence of each string of `known` in its strings (keys
    included) replaced by redact.REDACTED, the longest first (a secret holding another goes whole)."""
    known = sorted(set(known), key=len, reverse=True)
    if not known:
        return value
    pattern = re.compile("|".join(map(re.escape, known)))

    def walk(v: Any) -> Any:
        if isinstance(v, str):
            return pattern.sub(redact.REDACTED, v)
        if isinstance(v, list):
            return [walk(x) for x in v]
        if isinstance(v, dict):
            return {walk(k): walk(x) for k, x in v.items()}
        return v

    return walk(value)


def run_id(now: float) -> str:
    """A new run id, sortable by start time: 20261202T055100Z-3f9a1c (UTC, then 24 random bits)."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now)) + "-" + token_hex(3)


def start(command: str, path: str | None, argv: list[str] | None = None) -> None:
    """Record that `command` (its words: "inspect", "deploy kernel") starts now in the history at
    `path` (None: store.default_path()), with the command line `argv` (default sys.argv; stored
    redacted) and who runs it where. A history that cannot be written is warned about once."""
    _current.clear()
    now = time.time()
    rid = run_id(now)
    words = ["fleetctl", *redact.argv(scrubbed(list(sys.argv[1:] if argv is None else argv), _secrets))]
    try:
        store = Store.open(path)
    except Exception as e:  # noqa: BLE001 - recording never stops the run (a HistoryError, or a bug here)
        _warn(e)
        return
    # kept before its row is written: a Ctrl-C or SIGTERM (KeyboardInterrupt) raised once the row
    # is in, before this function returns, still has `end` record the run's end (before, the run
    # stayed "running" in the history: found by the soak, issue 54, finding 12); one raised before
    # the write has `end` update no row, and the run is not in the history
    rec = _Recording(store, rid, words)
    _current.append(rec)
    try:
        store.start(rid, command, words, _user(), socket.gethostname(), __version__, now, os.getpid(),
                    process_started(os.getpid()), boot_id(), pid_namespace())
    except Exception as e:  # noqa: BLE001 - recording never stops the run (a HistoryError, or a bug here)
        _current.remove(rec)
        store.close()
        _warn(e)


def arm(command: str, path: str | None) -> None:
    """Say which run `begin` starts recording (`command`, the history at `path`): a command
    arms its run when it starts, and begins it only once it is about to work on hosts, so that
    usage, pattern and inventory errors before that are no runs in the history."""
    _armed[:] = [(command, path)]


def begin() -> None:
    """Start recording the run `arm` named (start); nothing when none is armed."""
    if _armed:
        start(*_armed.pop())


def current_run_id() -> str | None:
    """The id of the run being recorded (None: none is, or its history could not be written)."""
    return _current[0].run_id if _current else None


def results(document: dict) -> None:
    """Keep the run's `--json` document (its "hosts" and the rest) for `end` to record."""
    if _current:
        _current[0].document = document


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM ignored inside the block (set from the main thread, the only one where
    Python sets handlers): a Ctrl-C or a SIGTERM while the end waits for the lock (at most the
    store's busy timeout, BUSY_TIMEOUT_MS) neither breaks the write nor changes the exit code,
    which is decided already; the process ends right after it. The previous handlers are back
    after the block."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def end(exit_code: int) -> None:
    """Record the run's end with the process's exit code and the document `results` kept (none
    when the command ended before its results: an error, a refusal, a Ctrl-C outside a fleet
    run), with SIGINT and SIGTERM held off (_signals_held)."""
    if not _current:
        return
    with _signals_held():
        _end(_current.pop(), exit_code)


def _end(rec: _Recording, exit_code: int) -> None:
    try:
        doc = redacted(scrubbed(json.loads(json.dumps(rec.document or {}, default=str)), _secrets))
        hosts = doc.pop("hosts", [])
        rec.store.end(rec.run_id, exit_code, time.time(), doc, hosts, argv=scrubbed(rec.argv, _secrets))
    except Exception as e:  # noqa: BLE001 - recording never changes the exit code (HistoryError, or a bug here)
        _warn(e, "its end is")
    finally:
        rec.store.close()
