"""The HTML fleet report's page (`fleetctl report -o fleet.html`, cli.htmlreport): one
self-contained file built from the run history alone (history.store's RunRecords; no host is
contacted).

    overview(runs)  host x SGLang installs x applied changes x active kernels x drift x last
                    validation x last diagnosis x last run: each cell the latest recorded run
                    that carries it (inspect or status; status; validate; diagnose), with its
                    time and run; applied changes and active kernels replayed through the
                    later apply, deploy kernel, rollback and recover runs (_replay)
    render(runs, generated_at, since, source, total)  the page: the overview, a timeline of the
                    changes (svg.timeline), the load gates' charts (svg.gate_bars), then
                    each run (newest first) with its hosts, gate checks and diffs (a diagnose
                    run: svg.diagnose_bars of its verdict groups)

One run's odd data never fails the page: a figure that is not a finite number is "not measured",
a missing key shows as nothing, and a run whose section still cannot be drawn shows as a section
that says so and names `fleetctl history show RUN`. Each string shown is cut to CAP characters
(a diff to DIFF_CAP) with how many are left and that same pointer.

The page is a Jinja2 template (templates/fleet-report.html.j2) with autoescape on, and every
value it prints first passes through report.visible (`finalize`): host text is HTML-escaped and
its control characters (terminal escapes included) are shown as \\xNN, never interpreted. The
only markup that is not escaped is the SVG svg.py builds, itself escaped by ElementTree. The
CSS is inline, there is no script, and a Content-Security-Policy meta (default-src 'none', the
style element allowed by its sha256) makes the browser refuse any load from the network.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib.resources import files
from typing import Any

from jinja2 import Environment, PackageLoader, StrictUndefined
from markupsafe import Markup

from ..history.model import HostRecord, RunRecord
from ..vocab import ChangeState, HostStatus
from . import svg
from .gates import GATES
from .text import coalesce, gate_status, visible

# Commands whose host results are changes (the timeline), unless run in check mode.
CHANGING = ("apply", "deploy kernel", "rollback", "recover")
# The errors odd host data raises in a reader (an int too large for a float: OverflowError).
MALFORMED = (KeyError, TypeError, AttributeError, ValueError, IndexError, ArithmeticError)
# The most characters of one string (a host's error, a detail, a cell line) and of one diff shown.
CAP, DIFF_CAP = 4096, 16384


def clip(value: Any, run_id: str | None = None, cap: int = CAP) -> str:
    """`value` as visible text (report.visible) of at most `cap` characters: a longer one keeps
    its head and says how many characters are left and where to read them all."""
    s = visible(value)
    if len(s) <= cap:
        return s
    note = f" … {{}} more characters; fleetctl history show {run_id or 'RUN'}"
    keep = cap - len(note.format(len(s)))
    return s[:keep] + note.format(len(s) - keep)


def when(t: float | None) -> str:
    """Unix seconds as 'YYYY-MM-DD HH:MM:SSZ' (UTC), '' for None."""
    return "" if t is None else datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")


@dataclass(frozen=True)
class Cell:
    """One overview cell: its lines, and the run it comes from (run_id, its start `at` in Unix
    seconds, its command and the host's status there)."""

    lines: list[str]
    run_id: str
    at: float
    command: str
    status: str


def _installs(doc: dict) -> list[str] | None:
    """'VERSION KIND ID' per install (inspect's or status's `installs`), or None when the entry
    has none (a host that failed before they were read)."""
    if not isinstance(doc.get("installs"), list):
        return None
    lines = []
    for i in doc["installs"]:
        sg = i.get("sglang")
        version, kind = (sg.get("version"), sg.get("install")) if isinstance(sg, dict) else (sg, i.get("install"))
        lines.append(f"{version} {kind} {i.get('id')}")
    lines += [f"not inspected: {e.get('id')}: {e.get('reason')}" for e in doc.get("not_inspected") or []]
    return lines or [f"none: {(doc.get('facts') or {}).get('sglang_reason') or 'no SGLang install found'}"]


def _changes(doc: dict) -> list[str] | None:
    if not isinstance(doc.get("changes"), list):
        return None
    return [f"{c.get('change_id')} ({c.get('playbook')})"
            + (" PENDING" if c.get("state") == ChangeState.PENDING else "")
            for c in doc["changes"] if c.get("state") in (ChangeState.APPLIED, ChangeState.PENDING)] or ["none"]


def _kernels(doc: dict) -> list[str] | None:
    if not isinstance(doc.get("kernels"), dict):
        return None
    return [f"{name} {str(key)[:12]}" for name, key in doc["kernels"].items()] or ["none"]


def _drift(doc: dict) -> list[str] | None:
    if not isinstance(doc.get("drift"), list):
        return None
    return ([f"{d.get('path')}: {d.get('problem')} ({d.get('change_id')})" for d in doc["drift"]]
            + [f"{m.get('path')}: {m.get('problem')}" for m in doc.get("modified") or []]) or ["none"]


def _num(v: Any, unit: str) -> str:
    f = svg.measured(v)
    return "not measured" if f is None else svg.figure(f, unit)


def _validation(doc: dict) -> list[str] | None:
    """Per server: the smoke decode's median latency and, with --load, the load run's figures."""
    if "servers" not in doc and "load" not in doc:
        return [doc["error"]] if doc.get("error") else None
    lines = []
    for s in doc.get("servers") or []:
        lat = svg.measured(s.get("e2e_latency_s") or s.get("latency_s"))
        lines.append(f":{s.get('port')} smoke " + (_num(lat * 1000, "ms") if lat is not None else "not measured")
                     + (f" {s['error']}" if s.get("error") else ""))
    load = doc.get("load") or {}
    if load.get("not_run"):
        lines.append(f"load: not run: {load['not_run']}")
    for s in load.get("servers") or []:
        m = s.get("load") or {}
        lines.append(f":{s.get('port')} load {load.get('profile')}: " + (
            f"{m.get('completed')} of {m.get('requested')}, {_num(m.get('output_throughput'), 'tok/s')}, p99 TTFT "
            f"{_num(m.get('p99_ttft_ms'), 'ms')}, p99 ITL {_num(m.get('p99_itl_ms'), 'ms')}" if m
            else f"not run: {s.get('not_run')}" if s.get("not_run") else str(s.get("error"))))
    return lines + ([doc["error"]] if doc.get("error") else []) or ["no server"]


def _diagnosis(doc: dict) -> list[str] | None:
    """Per server: its diagnose verdict, why, and the action (engine/diagnose/verdict.py)."""
    if "servers" not in doc:
        return [doc["error"]] if doc.get("error") else None
    lines = [f":{s.get('port')} {(s.get('verdict') or {}).get('verdict')}: {(s.get('verdict') or {}).get('why')}"
             + (f" -> {s['verdict']['action']}" if (s.get("verdict") or {}).get("action") else "")
             for s in doc.get("servers") or []]
    return lines + ([doc["error"]] if doc.get("error") else []) or ["no server"]


# The overview's columns: (title, the commands whose entries carry it, what it reads from an entry).
COLUMNS = (("SGLang installs", ("inspect", "status"), _installs),
           ("applied changes", ("status",), _changes),
           ("active kernels", ("status",), _kernels),
           ("drift", ("status",), _drift),
           ("last validation", ("validate",), _validation),
           ("last diagnosis", ("diagnose",), _diagnosis))


def _lines(read, doc: dict) -> list[str] | None:
    try:
        return read(doc)
    except MALFORMED as e:
        return ["malformed data from the host: " + f"{type(e).__name__}: {e}"]


# The overview's columns a change alters (their index in COLUMNS): applied changes, active kernels.
CHANGES_COL, KERNELS_COL = 1, 2
# What an overview cell of a host reads when the host was unreachable and no earlier run read it.
UNREACHABLE_CELL = "unknown (unreachable)"


@dataclass
class _HostState:
    """What the history says one host holds, as its runs are replayed oldest first: the applied
    (and pending) changes {change_id: (playbook, state)} and the active kernels {name: build
    key}, each None until a status read it or unknown after a change this history cannot
    follow; undo: per change id seen made, what it replaced ("kernel", name, the previous build
    key or None) or ("change",) for a playbook's change."""

    changes: dict[str, tuple[str, str]] | None = None
    kernels: dict[str, str] | None = None
    undo: dict[str, tuple] = dataclasses.field(default_factory=dict)


def _playbook(run: RunRecord) -> str:
    """The playbook an apply run named (its first word after "apply"), '?' when argv has none."""
    words = [a for a in run.argv[1:] if not a.startswith("-")]
    return words[0] if words else "?"


def _replay(state: _HostState, run: RunRecord, h: HostRecord) -> set[int]:
    """Update `state` with host `h`'s result in `run` (status: what it read; apply, deploy
    kernel, rollback, recover not in check mode: what they changed) and return the COLUMNS
    indexes it altered. A change this history cannot follow (a rollback of a change it never saw
    made, an apply that failed without being rolled back) makes the column unknown (None
    values with a note) rather than keeping a stale value."""
    d, cid = h.doc, h.doc.get("change_id") or run.doc.get("change_id")
    if run.command == "status" and isinstance(d.get("changes"), list) and isinstance(d.get("kernels"), dict):
        state.changes = {c.get("change_id"): (c.get("playbook"), c.get("state")) for c in d["changes"]
                         if c.get("state") in (ChangeState.APPLIED, ChangeState.PENDING)}
        state.kernels = dict(d["kernels"])
        return set()
    if run.command not in CHANGING or _check_mode(run) or h.status not in (HostStatus.CHANGED, HostStatus.FAILED):
        altered = set()
    elif run.command == "apply" and cid:
        if h.status == HostStatus.CHANGED:
            state.changes = {**(state.changes or {}), cid: (_playbook(run), ChangeState.APPLIED)}
            state.undo[cid] = ("change",)
        elif not str(h.error or "").startswith("rolled back"):
            state.changes = None
        altered = {CHANGES_COL}
    elif run.command == "deploy kernel" and cid and h.status == HostStatus.CHANGED and d.get("build_key"):
        name = run.doc.get("kernel")
        state.undo[cid] = ("kernel", name, (state.kernels or {}).get(name))
        state.kernels = {**(state.kernels or {}), name: d["build_key"]} if state.kernels is not None else None
        altered = {KERNELS_COL}
    elif run.command == "rollback" and cid and h.status == HostStatus.CHANGED:
        undo = state.undo.pop(cid, None)
        if undo and undo[0] == "kernel" and state.kernels is not None:
            state.kernels = {k: v for k, v in state.kernels.items() if k != undo[1]}
            if undo[2] is not None:
                state.kernels[undo[1]] = undo[2]
            altered = {KERNELS_COL}
        elif state.changes is not None and cid in state.changes:
            state.changes = {k: v for k, v in state.changes.items() if k != cid}
            altered = {CHANGES_COL}
        else:
            state.changes = state.kernels = None
            altered = {CHANGES_COL, KERNELS_COL}
    else:
        altered = set()
    recovered = d.get("recovered") if run.command in CHANGING and not _check_mode(run) else None
    for r in recovered or []:
        if state.changes is not None and r.get("change_id") in state.changes and r.get("state") != ChangeState.APPLIED:
            state.changes = {k: v for k, v in state.changes.items() if k != r.get("change_id")}
            altered.add(CHANGES_COL)
    return altered


def _state_lines(state: _HostState, col: int, run: RunRecord) -> list[str]:
    """The lines of the applied changes' or active kernels' cell from `state` after a change."""
    held = state.changes if col == CHANGES_COL else state.kernels
    if held is None:
        return [f"unknown: changed by {run.command} {when(run.started_at)} in a way the history does not "
                f"show; run fleetctl status"]
    if col == CHANGES_COL:
        return _changes({"changes": [{"change_id": k, "playbook": p, "state": s} for k, (p, s) in held.items()]})
    return _kernels({"kernels": held})


def overview(runs: list[RunRecord]) -> list[tuple[str, list[Cell | None], Cell]]:
    """One row per host, in the order hosts first appear: (host, a Cell or None per COLUMNS
    entry, the host's last run). A column's cell is the latest run (by start) of one of its
    commands whose entry for the host carries that column's data; the applied changes and
    active kernels are the latest status's, as later apply, deploy kernel, rollback and recover
    runs changed them (the cell then names that run; see _replay). An unreachable host's entry
    carries no data: its older cells stay, and a column no run read says UNREACHABLE_CELL."""
    rows: dict[str, tuple[list[Cell | None], list[Cell], _HostState]] = {}
    for run in sorted(runs, key=lambda r: r.started_at):
        for h in run.hosts:
            cells, last, state = rows.setdefault(h.host, ([None] * len(COLUMNS), [], _HostState()))
            last[:] = [Cell([f"{run.command} {h.status}"] + ([clip(h.error, run.run_id)] if h.error else []),
                            run.run_id, run.started_at, run.command, h.status)]
            if h.status in (HostStatus.UNREACHABLE, HostStatus.NOT_ATTEMPTED):
                continue
            for n, (_, commands, read) in enumerate(COLUMNS):
                lines = _lines(read, {**h.doc, "error": h.error}) if run.command in commands else None
                if lines is not None:
                    cells[n] = Cell([clip(line, run.run_id) for line in lines], run.run_id, run.started_at,
                                    run.command, h.status)
            try:
                altered = _replay(state, run, h)
            except MALFORMED:
                continue  # the cells read from this entry already say it is malformed
            for n in sorted(altered):
                cells[n] = Cell([clip(line, run.run_id) for line in _state_lines(state, n, run)], run.run_id,
                                run.started_at, run.command, h.status)
    return [(host, [c or (Cell([UNREACHABLE_CELL], last[0].run_id, last[0].at, last[0].command, last[0].status)
                          if last[0].status == HostStatus.UNREACHABLE else None) for c in cells], last[0])
            for host, (cells, last, _) in rows.items()]


def _check_mode(run: RunRecord) -> bool:
    return bool(run.doc.get("check")) or "--check" in run.argv


def events(runs: list[RunRecord]) -> list[svg.Event]:
    """The timeline's points: each host result of a CHANGING run not in check mode, at the run's
    end (its start when it has none)."""
    out = []
    for run in runs:
        if run.command not in CHANGING or _check_mode(run):
            continue
        cid = run.doc.get("change_id")
        for h in run.hosts:
            label = (f"{run.command} {h.doc.get('change_id') or cid or ''} {h.status}"
                     + (f": {h.error}" if h.error else ""))
            out.append(svg.Event(h.host, run.ended_at or run.started_at, h.status,
                                 clip(f"{when(run.started_at)} {label}", run.run_id), run.command))
    return out


def _diffs(run: RunRecord) -> list[tuple[str, str]]:
    """(hosts, diff text) of a run's plans, identical diffs across hosts coalesced."""
    def text(h: HostRecord) -> str:
        plans = h.doc.get("plans") or ([h.doc["plan"]] if isinstance(h.doc.get("plan"), dict) else [])
        return "".join(str(f.get("diff") or "") for p in plans if isinstance(p, dict) for f in p.get("files") or [])

    return [(", ".join(hosts), diff) for hosts, diff in coalesce((h.host, text(h)) for h in run.hosts) if diff]


def _detail(command: str, h: HostRecord) -> str:
    """A host's outcome in one line: its error, else why it was skipped, else what the command
    found (inspect: the installs; status: the applied changes and drift; validate: the
    validation) or did (edits, the gates' verdicts, the kernel build, the files a rollback
    restored, the pending changes undone)."""
    d = h.doc
    if h.error:
        return h.error
    if d.get("skipped_reason"):
        return f"skipped: {d['skipped_reason']}"
    found = {"inspect": [("", _installs)], "status": [("applied: ", _changes), ("drift: ", _drift)],
             "validate": [("", _validation)], "diagnose": [("", _diagnosis)]}.get(command)
    if found:
        return "; ".join(label + ", ".join(read(d) or ["?"]) for label, read in found)
    parts = []
    plans = d.get("plans") or ([d["plan"]] if isinstance(d.get("plan"), dict) else [])
    if plans:
        parts.append(f"{sum(len(p.get('edits') or []) for p in plans)} edit(s) in "
                     f"{sum(len(p.get('files') or []) for p in plans)} file(s)")
    for key, label, _ in GATES:
        if (d.get(key) or {}).get("status"):
            parts.append(f"{label} {gate_status(d[key])}")
    if d.get("build_key"):
        parts.append(f"{d.get('backend') or ''} build {str(d['build_key'])[:12]}"
                     + (" (reused)" if d.get("reused") else ""))
    if d.get("commit_note"):
        parts.append(str(d["commit_note"]))
    if d.get("nothing"):
        parts.append(f"nothing to do: {d['nothing']}")
    elif command == "rollback":
        parts.append(f"restored {len(d.get('files') or [])} file(s)/link(s)")
    parts += [f"recovered {c.get('change_id')} -> {c.get('state')}" for c in d.get("recovered") or []]
    if command == "recover" and not d.get("recovered"):
        parts.append("nothing pending")
    return "; ".join(parts)


def _checks(run_id: str, h: HostRecord) -> list[dict]:
    """The gate checks of a host's result, gate by gate (GATES: the smoke gate's, the load gate's,
    then the route gate's: engine/gates/route.CHECKS), each as target, name, passed and detail (None where an
    older record lacks one; detail clipped)."""
    checks = [c for key, _, _ in GATES for c in (h.doc.get(key) or {}).get("checks") or []]
    return [{"target": c.get("target"), "name": c.get("name"), "passed": bool(c.get("passed")),
             "detail": clip(c.get("detail"), run_id)} for c in checks if isinstance(c, dict)]


def _gates(h: HostRecord) -> list[tuple[str, Markup]]:
    """(server, its svg.gate_bars) per server of the host's load gate that has both runs."""
    try:
        return _gate_charts(h)
    except MALFORMED:
        return []  # the run's section says what the host's data holds


def _gate_charts(h: HostRecord) -> list[tuple[str, Markup]]:
    gate = h.doc.get("load_gate") or {}
    out = []
    for row in gate.get("servers") or []:
        if not isinstance(row, dict) or not row.get("baseline") or not row.get("after"):
            continue
        names = {"load-throughput": "output_throughput", "load-ttft": "p99_ttft_ms", "load-itl": "p99_itl_ms"}
        verdicts = {names[c["name"]]: c.get("passed") for c in gate.get("checks") or []
                    if c.get("target") == row.get("target") and c.get("name") in names}
        out.append((row.get("target"), svg.gate_bars(str(row.get("target")), row["baseline"], row["after"],
                                                      row.get("limits") or {}, verdicts)))
    return out


def _run_view(run: RunRecord) -> dict:
    """What the template shows of one run: its hosts (record, change id, detail, gate checks,
    whether it has a load-gate chart), diffs, duration, check mode and outcome ("exit N", else
    its state)."""
    hosts = []
    for h in run.hosts:
        try:
            hosts.append({"record": h, "change_id": h.doc.get("change_id") or run.doc.get("change_id"),
                          "detail": clip(_detail(run.command, h), run.run_id), "checks": _checks(run.run_id, h),
                          "elapsed": _num(h.elapsed_s, "s"),
                          "gated": bool((h.doc.get("load_gate") or {}).get("servers"))})
        except MALFORMED as e:
            hosts.append({"record": h, "change_id": None, "elapsed": _num(h.elapsed_s, "s"), "checks": [],
                          "detail": clip(f"malformed data: {type(e).__name__}: {e}", run.run_id), "gated": False})
    duration = _num(run.ended_at - run.started_at, "s") if run.ended_at is not None else ""
    diffs = [(hosts_, clip(diff, run.run_id, DIFF_CAP)) for hosts_, diff in _diffs(run)]
    return {"run": run, "hosts": hosts, "diffs": diffs, "duration": duration, "check": _check_mode(run),
            "diagnosis": _diagnose_chart(run),
            "outcome": f"exit {run.exit_code}" if run.exit_code is not None else str(run.state)}


def _diagnose_chart(run: RunRecord) -> Markup | None:
    """A diagnose run's roll-up (engine/diagnose.groups of its hosts' servers) as svg.diagnose_bars;
    None for another command, a run with no server, or data of an odd shape."""
    if run.command != "diagnose":
        return None
    from ..engine.diagnose import groups

    try:
        rolled = groups([{"host": h.host, "servers": h.doc.get("servers") or []} for h in run.hosts])
        return svg.diagnose_bars(rolled) if rolled else None
    except MALFORMED:
        return None


def _shown(value: Any) -> Any:
    """Jinja's finalize: every printed value but svg.py's markup and the run sections through
    clip (None: '')."""
    return value if isinstance(value, Markup) else clip(value)


def _tolerated(run: RunRecord) -> RunRecord:
    """`run` with the shapes the page reads: a dict doc (a null one: {}), argv a list of words,
    each host's doc a dict, its name and address clipped (they key the overview and timeline)."""
    return dataclasses.replace(
        run, doc=run.doc if isinstance(run.doc, dict) else {},
        argv=[str(a) for a in run.argv] if isinstance(run.argv, list) else [str(run.argv)],
        hosts=[dataclasses.replace(h, host=clip(h.host, run.run_id), address=clip(h.address, run.run_id),
                                   doc=h.doc if isinstance(h.doc, dict) else {}) for h in run.hosts])


def _section(run: RunRecord) -> Markup:
    """One run's section (the template's run macro); when its data still breaks it, a section
    with the run's id, command and start that says so and where to read the record."""
    macros = _ENV.get_template("fleet-report-run.html.j2").module
    try:
        return macros.run_section(_run_view(run))
    except Exception as e:  # one run's odd record must not fail the whole page
        return macros.broken_section(run, clip(f"{type(e).__name__}: {e}", run.run_id))


_ENV = Environment(loader=PackageLoader("fleetctl.report", "templates"), autoescape=True, finalize=_shown,
                   undefined=StrictUndefined, trim_blocks=True, lstrip_blocks=True)
_ENV.filters["when"] = when
CSS = (files("fleetctl.report") / "templates" / "fleet-report.css").read_text()


def csp() -> str:
    """The page's Content-Security-Policy: nothing may load (default-src 'none'), the one style
    element is allowed by its sha256, and no base URL or form target can be set."""
    digest = base64.b64encode(hashlib.sha256(CSS.encode()).digest()).decode()
    return f"default-src 'none'; style-src 'sha256-{digest}'; base-uri 'none'; form-action 'none'"


def render(runs: list[RunRecord], generated_at: float, since: str | None = None, source: str = "",
           total: int | None = None) -> str:
    """The report page (HTML text) of `runs` (oldest first, as Store.runs gives them):
    generated_at (Unix seconds) and since (the --since text or None) for its header, total
    (how many runs there were when `runs` is only the newest of them) and source (the history
    file) for its footer."""
    ordered = sorted((_tolerated(r) for r in runs), key=lambda r: r.started_at)
    rows = overview(ordered)
    evs = events(ordered)
    hosts = [host for host, _, _ in rows]
    chart = svg.timeline(hosts, evs, min(e.at for e in evs), max(e.at for e in evs)) if evs else None
    gates = [(run, h, target, bars) for run in reversed(ordered) for h in run.hosts for target, bars in _gates(h)]
    return _ENV.get_template("fleet-report.html.j2").render(
        csp=csp(), css=Markup(CSS), generated=when(generated_at), since=since, source=source, total=total,
        columns=[c[0] for c in COLUMNS], overview=rows, timeline=chart, events=len(evs), gates=gates,
        marks=svg.MARKS, statuses=[s.value for s in HostStatus],
        runs=[_section(r) for r in reversed(ordered)])
