"""`fleetctl history`: the runs recorded on this control node (history.store), read only.

`list` filters them (host, command, since, status) and `show RUN` (both open the file read-only:
a mistyped --history is an error, never a new file) prints a run's report again with
the command's own renderer (cli.fleet.renderer) from its stored `--json` document, diffs
included, and `prune` deletes the old ones. Each takes `--json`.
"""

from __future__ import annotations

import json
import re
import shlex
import sys
import time
from dataclasses import asdict
from typing import Annotated, Optional

import typer

from ..errors import UsageError
from ..history.model import RunRecord, RunState
from ..history.store import Store
from ..report.document import envelope
from ..vocab import HostStatus
from .console import err, out
from ..report.text import table, text
from .options import HistoryOpt, JsonOut

app = typer.Typer(no_args_is_help=True, help=(
    "The runs recorded on this control node (every command that works on hosts; not those made through "
    "the Ansible collection)."))

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def age_s(value: str, option: str) -> float:
    """Seconds in an age such as 90d, 12h, 30m, 45s or 2w (a number and a unit; a bare number is
    days). Raises UsageError (exit 5) naming `option` for anything else."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", value)
    if not m:
        raise UsageError(f"{option} {value}: want a number and a unit (s, m, h, d, w), such as 7d or 12h")
    return float(m.group(1)) * _UNITS[m.group(2) or "d"]


def _when(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t is not None else ""


def _outcome(run: RunRecord) -> str:
    if run.state == RunState.FINISHED:
        return f"exit {run.exit_code}"
    return f"running on {run.control_host} (unverified)" if run.unverified else str(run.state)


def _counts(run: RunRecord) -> str:
    counts: dict[str, int] = {}
    for h in run.hosts:
        counts[h.status] = counts.get(h.status, 0) + 1
    return " ".join(f"{k}={v}" for k, v in sorted(counts.items()))


def _changes(run: RunRecord) -> str:
    """The run's change id, else those its hosts name (two, then how many more)."""
    if run.doc.get("change_id"):
        return run.doc["change_id"]
    ids = list(dict.fromkeys(c for h in run.hosts for c in h.change_ids))
    return "\n".join(ids[:2] + ([f"(+{len(ids) - 2} more)"] if len(ids) > 2 else []))


def _meta(run: RunRecord) -> dict:
    """A run's fields for --json, without its hosts (RunRecord's names; state as its word)."""
    d = asdict(run)
    d.pop("hosts")
    d["state"] = str(run.state)
    return d


@app.command("list")
def list_runs(host: Annotated[Optional[str], typer.Option("--host", help="Only runs that worked on this host.")] = None,
              command: Annotated[Optional[str], typer.Option("--command", help=(
                  "Only runs of this command (inspect, apply, deploy kernel, ...)."))] = None,
              since: Annotated[Optional[str], typer.Option("--since", metavar="AGE", help=(
                  "Only runs started within AGE: 7d, 12h, 30m."))] = None,
              status: Annotated[Optional[str], typer.Option("--status", help=(
                  "Only runs in this state (running, finished, interrupted), or with a host of this "
                  "status (ok, changed, skipped, failed, unreachable, not attempted)."))] = None,
              history: HistoryOpt = None, json_out: JsonOut = False) -> None:
    """List the recorded runs, oldest first: id, start, command line, outcome, hosts per status, change ids."""
    cutoff = time.time() - age_s(since, "--since") if since is not None else None
    store = Store.open(history, readonly=True)
    try:
        runs = store.runs(since=cutoff, host=host, command=command, status=status, docs=False)
    finally:
        store.close()
    for damaged in store.damaged:
        err.print(text(f"note: {damaged}; left out"), highlight=False, soft_wrap=True)
    if json_out:
        docs = [{**_meta(r), "hosts": [{k: v for k, v in asdict(h).items() if k != "doc"} for h in r.hosts]}
                for r in runs]
        sys.stdout.write(json.dumps(envelope({"runs": docs}, 0, None), indent=1) + "\n")
        return
    rows = [[r.run_id, _when(r.started_at), shlex.join(r.argv[1:]), _outcome(r), _counts(r), _changes(r),
             f"{r.ended_at - r.started_at:.1f}s" if r.ended_at is not None else "", f"{r.user}@{r.control_host}"]
            for r in runs]
    table(f"run history: {store.path}", ["run", "started", "command line", "outcome", "hosts", "change ids", "took", "by"],
          rows, out)


@app.command()
def show(run: Annotated[str, typer.Argument(help="A run id (or its first characters), or last.")],
         history: HistoryOpt = None, json_out: JsonOut = False) -> None:
    """Print a recorded run again: who ran what, when and with which outcome, then the report the
    command printed (from its stored results), with its diffs."""
    from ..engine.context import HostResult
    from .fleet import _render, renderer

    store = Store.open(history, readonly=True)
    try:
        rec = store.run(run)
    finally:
        store.close()
    if json_out:
        own = {k: v for k, v in rec.doc.items() if k not in ("schema_version", "run_id", "exit_code")}
        sys.stdout.write(json.dumps(envelope({"run": _meta(rec), **own, "hosts": [h.doc for h in rec.hosts]},
                                             rec.exit_code, rec.run_id), indent=1) + "\n")
        return
    took = f", took {rec.ended_at - rec.started_at:.1f}s" if rec.ended_at is not None else ""
    out.print(text(f"run {rec.run_id}: {shlex.join(rec.argv)}"), highlight=False, soft_wrap=True)
    out.print(text(f"by {rec.user}@{rec.control_host} (fleetctl {rec.version}), started {_when(rec.started_at)}"
                   f"{took}: {_outcome(rec)}"), highlight=False, soft_wrap=True)
    if not rec.hosts:
        out.print(text("no host results recorded: the run ended before its results came out"
                       if rec.state == RunState.FINISHED else f"no host results recorded: the run is {rec.state}"))
        return
    results = []
    for h in rec.hosts:
        data = dict(h.doc)
        flags = {k: data.pop(k, None) for k in ("interrupted", "parse_error")}
        for k in ("host", "address", "status", "error", "elapsed_s"):
            data.pop(k, None)
        status = HostStatus(h.status) if h.status in {s.value for s in HostStatus} else h.status
        results.append(HostResult(h.host, h.address, status, h.error, h.elapsed_s, data, **flags))
    try:
        render = renderer(rec.command, rec.doc, diff=True, details="--details" in rec.argv)
    except KeyError:
        out.print(text(f"note: this fleetctl does not know the command {rec.command} (recorded by fleetctl "
                       f"{rec.version}): its hosts' results only"), highlight=False, soft_wrap=True)
        render = _host_table
    _render(results, render, rec.doc.get("change_id"))


def _host_table(results, console) -> None:
    """The hosts' results of a run of a command this fleetctl has no renderer for: host, status,
    error, seconds."""
    table("hosts", ["host", "status", "error", "took"],
          [[r.host, str(r.status), r.error or "", f"{r.elapsed_s:.1f}s"] for r in results], console)


@app.command()
def prune(older_than: Annotated[str, typer.Option("--older-than", metavar="AGE", help=(
              "Delete the runs started more than AGE ago: 90d, 12h."))],
          history: HistoryOpt = None, json_out: JsonOut = False) -> None:
    """Delete old runs, with their hosts' results and the diffs no other run holds."""
    seconds = age_s(older_than, "--older-than")
    store = Store.open(history)
    try:
        n = store.prune(seconds)
    finally:
        store.close()
    if json_out:
        sys.stdout.write(json.dumps(envelope({"pruned": n, "older_than_s": seconds}, 0, None)) + "\n")
    else:
        out.print(f"pruned {n} run(s) started more than {older_than} ago from {store.path}", highlight=False)
