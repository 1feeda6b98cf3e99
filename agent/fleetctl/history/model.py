"""The shapes of the run history: what one recorded run and one host's result in it are.

The store (store.py) writes and reads these; `fleetctl history` and the HTML report (report/html.py)
only read them. A host's `doc` is exactly its entry in the command's `--json` document
(`engine.context.HostResult.to_json()`, redacted with `probes.redact` before it is stored), and a
run's `doc` the rest of that document (change_id, kernel, check, ...), so `history show` renders a
run with the same renderer the command used.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..vocab import _Word


class RunState(_Word):
    """Where a recorded run stands: RUNNING (started, not ended: still going, or killed before
    its end, which `store` tells apart by the recording process's liveness where it can look it
    up, else RunRecord.unverified), FINISHED (ended with
    `exit_code`), INTERRUPTED (its process is gone without an end record: SIGKILL, a crash, a
    power loss)."""

    RUNNING = "running"
    FINISHED = "finished"
    INTERRUPTED = "interrupted"


@dataclass(frozen=True)
class HostRecord:
    """One host's result in a run. status: a vocab.HostStatus word; error: its one-line error or
    None; elapsed_s: seconds; doc: the host's `--json` entry (redacted; empty in a listing:
    store.Store.runs(docs=False)); change_ids: the change ids its entry names (every
    "change_id" in it, in order, once each: an apply's or rollback's change, the changes status
    lists, those recover undid)."""

    host: str
    address: str
    status: str
    error: str | None
    elapsed_s: float
    doc: dict[str, Any] = field(default_factory=dict)
    change_ids: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class RunRecord:
    """One recorded run of a host-touching command.

    run_id: a unique id (text); command: the subcommand words ("inspect", "apply", "deploy kernel",
    ...); argv: the command line, redacted; user / control_host: who ran it where; version:
    fleetctl's version; started_at / ended_at: Unix time in seconds (ended_at None while running
    or when interrupted); exit_code: the process's exit code (None without an end); state: a
    RunState; doc: the run's `--json` document without its "hosts"; hosts: one HostRecord per host,
    in the command's order; unverified: True for a RUNNING run whose recorder could not be
    looked up (recorded on another control host, or in another pid namespace of this one): it
    may have died there.
    """

    run_id: str
    command: str
    argv: list[str]
    user: str
    control_host: str
    version: str
    started_at: float
    ended_at: float | None
    exit_code: int | None
    state: RunState
    doc: dict[str, Any] = field(default_factory=dict)
    hosts: list[HostRecord] = field(default_factory=list)
    unverified: bool = False
