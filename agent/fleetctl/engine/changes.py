"""The change engine: how any change is written to a host, validated, committed or undone.

`apply.py` (playbooks) and `deploy.py` (kernel packages) decide *what* to change, as data: a
`Change` (ledger entries for files or links, the handlers to notify, the checks to run after the
write, the gates to pass: engine/gates). This module is *how*, the same for both (as pyinfra's
`api/operation.py` runs what `operations/` yield):

    change_job(state_dir, work)      the host's lock (flock on the host, held over the connection
                                     for the whole job) -> recover -> work(ctx, recovery)
    recover                          undo changes a killed run left "pending"; restart SGLang
    execute(ctx, result, change)     each gate's baseline (gates.take_baselines: one that fails
                                     refuses the host) -> write, ledger "pending" -> validate_change
                                     -> settle; a connection lost from the write on -> put_back
    put_back                         one reconnect, then finish by the ledger's state (roll back)
    validate_change                  handlers -> checks -> the gates, in order, each against its
                                     baseline (gates.judge)
    settle                           ledger "applied", or rollback (byte-identical) + handlers again

Everything that runs on the host is an action of the `change` probe (probes/change/actions.py) sent
through the connection, or an operator's own handler command (inventory `fleetctl_restart_cmd`,
a playbook handler) built by connection.command.operator_argv. A change stays "pending" until it
is validated, so a run killed at any point leaves a pending entry that the next run undoes
before it does anything else.
"""

from __future__ import annotations

import getpass
import secrets
import socket
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Literal, NamedTuple, TypedDict, Union

from ..config import LOCK_HOLD_EXTRA_S, LOCK_START_S, ROLLBACK_RESERVE_S, STATE_DIR
from ..connection import LockBusy, OutputTooLarge, RemoteTimeout, Unreachable, gone_holder
from ..connection.command import operator_argv
from .context import HostContext, HostResult
from . import containers, inuse
from .gather import install_context
from ..errors import HostFailed, ProbeFailed
from .gates import SMOKE, Gate, GateRun, judge, skipped, take_baselines
from ..probes import redact
from .validate import SmokeOptions, server_problems, smoke, smoke_targets
from ..vocab import ChangeState, HostStatus

RESTART_HANDLER = "restart sglang"
# What Ctrl-C and the run deadline say about a host stopped while a change job was in progress.
STOPPED_NOTE = ("a change there stays pending in its ledger; the next apply, deploy or rollback on it "
                "undoes it (`fleetctl status` shows it)")


def _operator() -> str:
    return f"{getpass.getuser()}@{socket.gethostname()}"


@dataclass
class ChangeOptions:
    """What every changing command shares. smoke: gate options; operator: recorded in the
    ledger ("user@machine"); state_dir: fleetctl's state directory on the hosts; load_gate: the
    command line asked for the load gate (--gate load); load_settings: its load settings
    (engine/load.load_options names), over a playbook's `load` step; no_validate: --no-validate,
    no gate runs (no baseline, no judging) and an install in use is changed all the same
    (engine/inuse.py), recorded as such in the result and the ledger."""

    smoke: SmokeOptions = field(default_factory=SmokeOptions)
    no_validate: bool = False
    load_gate: bool = False
    load_settings: dict = field(default_factory=dict)
    operator: str = field(default_factory=_operator)
    state_dir: str = STATE_DIR


def new_change_id(label: str) -> str:
    """A fresh change id: UTC time, `label` (playbook or "kernel-NAME") and 6 random hex digits."""
    return f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{label}-{secrets.token_hex(3)}"


# ---- the ledger client ---------------------------------------------------------------------

def change_probe(ctx: HostContext, action: str, state_dir: str = STATE_DIR, python: str | None = None,
                 **params) -> dict:
    """Run one action of probes/change/actions.py (apply, commit, rollback, recover, status, compile) on
    the host, with `python` (default: the inventory's or the first on PATH). Returns the
    action's answer; a refusal ({"ok": false}) raises HostFailed "ACTION: error".
    Raises ProbeFailed, RemoteTimeout, Unreachable."""
    res = ctx.probe("change.actions", {"action": action, "state_dir": state_dir, **params}, python=python)
    if not res.get("ok", False):
        raise HostFailed(f"{action}: {res.get('error')}")
    return res


def pending_ids(changes: list[dict]) -> list[str]:
    """The change ids in a ledger summary (status action's "changes") whose state is pending."""
    return [c["change_id"] for c in changes if c["state"] == ChangeState.PENDING]


def compile_problems(ctx: HostContext, python: str, paths: list[str]) -> list[str]:
    """Syntax errors in `paths` as `python` (the interpreter that serves SGLang) reads them:
    ["path:line: msg"]. Raises HostFailed, ProbeFailed, RemoteTimeout, Unreachable."""
    return change_probe(ctx, "compile", python=python, paths=paths)["problems"]


# ---- handlers ------------------------------------------------------------------------------

def restart_handlers(ctx: HostContext) -> list[dict]:
    """The restart handler from the host's `fleetctl_restart_cmd` ([] when unset): the one place
    that turns the inventory var into a handler; inside a container, its container's restart
    (containers.restart_handlers). Shape: [{"name", "command"}]."""
    if ctx.container is not None:
        return containers.restart_handlers(ctx)
    cmd = ctx.host.restart_cmd
    return [{"name": RESTART_HANDLER, "command": cmd}] if cmd else []


def run_handlers(ctx: HostContext, handlers: list[dict]) -> list[dict]:
    """Run each handler's shell command ({"name", "command"}) on the host, in order. Returns
    [{"name", "exit_code", "output" (last 1000 chars, secrets redacted: probes/redact.py)}]; a
    non-zero exit raises HostFailed."""
    ran = []
    for h in handlers:
        ctx.phase(f"restart: {h['name']}")
        r = ctx.run(operator_argv(h["command"]), what=f"handler {h['name']!r}", keep_ends=True)
        out = redact.text((r.stdout[-65536:] + r.stderr[-65536:]).decode("utf-8", "replace"))
        ran.append({"name": h["name"], "exit_code": r.exit_code, "output": out[-1000:]})
        if r.exit_code != 0:
            raise HostFailed(f"handler {h['name']!r} failed (exit {r.exit_code}): {ran[-1]['output'].strip()}")
    return ran


def on_install(install: str | None, state_dir: str, job: Callable[[HostContext], HostResult],
               changing: bool = False) -> Callable[[HostContext], HostResult]:
    """`job` run where install `install` lives: on the host, or inside its container
    (gather.install_context). For a container install the result says what lasts
    (data["lasts"]: containers.LASTS, data["root"]); a `changing` job is refused on a container
    where a change would not survive a restart (containers.refusal), and before and after it the
    host keeps its copy of the install's ledger records (containers.keep_record: the one before is
    how `fleetctl recover` on the host finds a container a killed run was changing)."""

    def wrapped(ctx: HostContext) -> HostResult:
        ictx, inst = install_context(ctx, install)
        if inst is None:
            return job(ctx)
        why = containers.refusal(inst) if changing else None
        if why:
            return ctx.result(HostStatus.FAILED, why, data={"root": inst["root"]})
        if changing:  # before any change: a run killed in the container leaves the host knowing it
            containers.keep_record(ictx, state_dir, install, install_ledger(ictx, state_dir, install), changing=True)
        result = job(ictx)
        result.data.update(root=inst["root"], lasts=containers.LASTS, entered_with=ictx.container["how"])
        if changing:
            containers.keep_record(ictx, state_dir, install, install_ledger(ictx, state_dir, install))
        return result

    wrapped.stopped_note = getattr(job, "stopped_note", None)
    return wrapped


# ---- lock and recovery ---------------------------------------------------------------------

class Recovery(NamedTuple):
    """What `recover` did: the changes it undid (probe entries) and the handlers it ran; on a
    host, how many container change records it keeps (containers.keep_record: the containers
    a change was made in, or begun)."""

    changes: list[dict]
    handlers: list[dict]
    container_records: int = 0


def recover(ctx: HostContext, state_dir: str = STATE_DIR) -> Recovery:
    """Undo changes a killed run left pending (probes/change/actions.py `recover`); when there were any,
    run the restart handler (the killed run may have restarted SGLang on the changed files)."""
    records = {"records": f"{state_dir}/{containers.RECORDS}"} if ctx.container is None else {}
    res = change_probe(ctx, "recover", state_dir, **records)
    recovered = res["recovered"]
    return Recovery(recovered, run_handlers(ctx, restart_handlers(ctx)) if recovered else [],
                    res.get("container_records", 0))


def install_ledger(ctx: HostContext, state_dir: str, install: str) -> list[dict]:
    """The ledger summary (status action's "changes") of install `install`, read where ctx works."""
    return [c for c in change_probe(ctx, "status", state_dir)["changes"] if c.get("install") == install]


def locked(state_dir: str, work: Callable[[HostContext], HostResult]):
    """A job that runs `work(ctx)` while holding the host's fleetctl lock (STATE_DIR/lock):
    a second run that wants to change the same host fails fast (LockBusy) instead of
    interleaving. The job carries `stopped_note` for Fleet's Ctrl-C and run-deadline messages."""

    def job(ctx: HostContext) -> HostResult:
        lock = take_lock(ctx, state_dir, ROLLBACK_RESERVE_S + LOCK_HOLD_EXTRA_S)
        try:
            return work(ctx)
        finally:
            lock.release()

    job.stopped_note = STOPPED_NOTE
    return job


def change_job(state_dir: str, work: Callable[[HostContext, Recovery], HostResult]):
    """The job every changing command runs: under the host's lock, `recover` first, then
    `work(ctx, recovery)`."""
    return locked(state_dir, lambda ctx: work(ctx, recover(ctx, state_dir)))


# ---- one change: write, validate, settle ---------------------------------------------------

class FileWrite(TypedDict):
    """A file a change writes (probes/change/actions.py `apply`): its new text, over the content
    of sha256 `pre_sha256` (None: the file must not exist), giving `post_sha256`."""

    path: str
    pre_sha256: str | None
    post_sha256: str
    new_text: str


class LinkSwap(TypedDict):
    """A symbolic link a change points from `pre_target` (None: no link there) to `post_target`."""

    path: str
    kind: Literal["link"]
    pre_target: str | None
    post_target: str


ApplyEntry = Union[FileWrite, LinkSwap]


@dataclass
class Change:
    """One change to one host, as data (what apply and deploy hand to `execute`).

    files: the change probe's apply entries (FileWrite, LinkSwap); label: the ledger's
    "playbook" field; handlers: [{"name", "command", "wait_for_health_s"?}] run after the write
    and after a rollback; checks: () -> [problem] run after the handlers; gates: the gates to
    pass after them (engine/gates: each takes its baseline before the write and judges after
    the checks, in this order; the smoke gate first); facts: the host's facts (interpreter,
    servers); rollback: False keeps a change that fails validation (playbook on_failure: keep);
    install: the install id the ledger entry is for; root: the directory every file must lie in
    (links resolved; the install's package directory, or the kernels dir), on a network file
    system only when the host's fleetctl_shared_tree says so."""

    change_id: str
    label: str
    files: list[ApplyEntry]
    facts: dict
    root: str
    handlers: list[dict] = field(default_factory=list)
    checks: Callable[[], list[str]] = lambda: []
    gates: list[Gate] = field(default_factory=list)
    rollback: bool = True
    install: str | None = None

    @property
    def smoke_gated(self) -> bool:
        """Whether the change has the smoke gate (then a rollback's restart is followed by a health check)."""
        return any(g.name == SMOKE for g in self.gates)


def execute(ctx: HostContext, result: HostResult, change: Change, opts: ChangeOptions) -> HostResult:
    """Write `change` and see it through: each of change.gates takes its baseline
    (gates.take_baselines, on the servers of change.facts: validate.smoke_targets; a baseline
    that fails or cannot run refuses the host), the write (pre-image hashes checked, backups,
    atomic; ledger "pending"), then validation and settling (validate_change, settle). A
    connection lost from the write on is put right by put_back. A change to an install in use
    by processes that no armed gate validates is refused before the write (inuse.refusal);
    with opts.no_validate no gate runs, result.data["validation"] says skipped
    (inuse.NO_VALIDATE) and the ledger's commit reason inuse.VALIDATION_SKIPPED. Returns `result` with status
    changed, or failed with the reason (rolled back unless change.rollback is False). Sets
    result.data["change_id"], ["handlers"], each gate's entry (its name: "validation",
    "load_gate", "route_gate"), ["rolled_back"]. Raises HostFailed (a refused write or
    baseline: nothing changed), Unreachable (see put_back)."""
    inside = ctx.container is not None
    targets = smoke_targets(ctx.host, change.facts, opts.smoke, inside=inside) if change.gates else []
    run = GateRun(change.facts, targets, opts.smoke)
    armed = [] if opts.no_validate else take_baselines(ctx, change.gates, run)
    # validated: a decode or offline check armed, or a server of the install a playbook chose not to gate
    validated = any(g.name == SMOKE for g, _ in armed) or bool(change.facts.get("servers"))
    refused = None if opts.no_validate else inuse.refusal(change.facts, validated)
    if refused:
        raise HostFailed(refused)
    result.data["change_id"] = change.change_id
    try:
        change_probe(ctx, "apply", opts.state_dir, change_id=change.change_id, playbook=change.label,
                     operator=opts.operator, files=change.files, root=change.root,
                     shared_tree=ctx.host.shared_tree, commit=False, install=change.install)
        result.status = HostStatus.CHANGED
        problems = validate_change(ctx, result, change, run, armed)
        if opts.no_validate:
            result.data[SMOKE] = skipped(inuse.NO_VALIDATE)
        return settle(ctx, result, change, opts.state_dir, problems, opts.smoke,
                      inuse.VALIDATION_SKIPPED if opts.no_validate else None)
    except Unreachable as e:
        return put_back(ctx, result, change, opts, e)


def put_back(ctx: HostContext, result: HostResult, change: Change, opts: ChangeOptions,
             lost: Unreachable) -> HostResult:
    """The connection was lost while `change` was being written, validated or settled: reconnect
    once (within the connect timeout) and, under the rollback reserve, finish by what the host's
    ledger says: a pending change is rolled back (and its handlers run), an applied one stands,
    one never written changed nothing. When the host cannot be reached again, raises Unreachable
    saying the change stays pending (the next apply, rollback or deploy undoes it: `recover`).
    The rollback runs under the host lock, taken again on the new connection (relock)."""
    try:
        ctx = ctx.reconnected()
        ctx = replace(ctx, deadline=max(ctx.deadline, time.monotonic() + ROLLBACK_RESERVE_S))
        lock = relock(ctx, opts.state_dir)
    except Unreachable as e:
        raise Unreachable(f"change {change.change_id} pending: the next apply, rollback or deploy undoes it "
                          f"({lost}; reconnecting: {e})") from None
    except LockBusy as e:
        raise HostFailed(f"change {change.change_id} pending: the next apply, rollback or deploy undoes it "
                         f"({lost}; reconnected, but the host lock could not be taken again: {e})") from None
    try:
        ledger = {c["change_id"]: c["state"] for c in change_probe(ctx, "status", opts.state_dir)["changes"]}
        state = ledger.get(change.change_id)
        if state == ChangeState.PENDING:
            return settle(ctx, result, replace(change, rollback=True), opts.state_dir,
                          [f"the connection was lost ({lost}); reconnected and took the host lock again "
                           "to roll back"], opts.smoke)
    except Unreachable as e:
        raise Unreachable(f"change {change.change_id} pending: the next apply, rollback or deploy undoes it "
                          f"({lost}; reconnecting: {e})") from None
    finally:
        lock.release()
    if state == ChangeState.APPLIED:
        result.status = HostStatus.CHANGED
        return result
    result.status = HostStatus.FAILED
    result.error = (f"the connection was lost ({lost}) before the change was written; nothing changed"
                    if state is None else f"the connection was lost ({lost}); the change is {state}")
    return result


def take_lock(ctx: HostContext, state_dir: str, extra_s: float):
    """The host's lock for the rest of ctx's run (+ `extra_s` seconds). Busy with a holder that
    is a run of this control node which has ended (connection.base.gone_holder: its link was cut
    as it ended, soak finding 14), the lock is asked for again each second until that holder's
    heartbeat window (lock_beat_s + LOCK_START_S) has passed: its remote holder frees it by then.
    Returns the base.HostLock. Raises LockBusy at once for a holder that runs or is not known to
    be gone, and past the window (saying which pid ended); Unreachable, RemoteTimeout."""
    until = None
    while True:
        try:
            return ctx.hold_lock(state_dir, timeout=LOCK_START_S, hold_s=ctx.remaining() + extra_s)
        except LockBusy as e:
            pid = gone_holder(e.holder)
            if pid is None:
                raise
            now = time.monotonic()
            until = until if until is not None else now + ctx.target.lock_beat_s() + LOCK_START_S
            if now > until:
                raise LockBusy(f"{e}: its run, pid {pid} on this machine, has ended, but the host still held "
                               f"the lock {ctx.target.lock_beat_s() + LOCK_START_S:g} s later", holder=e.holder) from None
            time.sleep(1.0)


def relock(ctx: HostContext, state_dir: str):
    """The host's lock taken again on `ctx`'s new connection after a reconnect. The lost
    session's holder ends by itself once its heartbeats stop (Connection.hold_lock: within the
    keepalive window; at once when sshd saw the session close), so while the lock is busy it is
    asked for again until that window has passed. Returns the base.HostLock. Raises LockBusy
    past the window (another run holds it), Unreachable, RemoteTimeout."""
    until = time.monotonic() + ctx.target.lock_beat_s() + LOCK_START_S
    while True:
        try:
            return ctx.hold_lock(state_dir, timeout=LOCK_START_S, hold_s=ctx.remaining() + LOCK_HOLD_EXTRA_S)
        except LockBusy:
            if time.monotonic() > until:
                raise
            time.sleep(1.0)


def validate_change(ctx: HostContext, result: HostResult, change: Change, run: GateRun,
                    armed: list[tuple[Gate, object]]) -> list[str]:
    """After a change is written: run its handlers, `change.checks()` (-> [problem]), then the
    gates with a baseline (`armed`: gates.take_baselines), in order, each against its baseline
    (gates.judge: until one fails; with no handler, the one rule for a server not restarted),
    with the health wait the handlers ask for (their longest wait_for_health_s, when over
    run.smoke's). Returns the problems; any error on the way (a handler that fails, a deadline,
    a probe crash) is a problem too, so the caller always settles the change. Probe runs leave
    run.reserve seconds of the host's deadline for the rollback. Raises only Unreachable. Sets
    result.data["handlers"] and each judged gate's entry."""
    problems: list[str] = []
    handlers = change.handlers
    try:
        result.data["handlers"] = run_handlers(ctx, handlers)
        problems += change.checks()
        if problems:
            return problems
        # a restart handler may ask for a longer health wait (a real server reloads its weights)
        waits = [h.get("wait_for_health_s") or 0 for h in handlers]
        after = replace(run, smoke=replace(run.smoke, health_timeout=max([run.smoke.health_timeout, *waits])))
        ctx.phase("gate")
        problems += judge(ctx, result, armed, after, restarted=bool(handlers))
    except Unreachable:
        raise  # nothing more can be done now; the change stays pending and the next run undoes it
    except Exception as e:  # noqa: BLE001 - every other failure must still lead to the rollback
        problems.append(str(e) if isinstance(e, (HostFailed, RemoteTimeout)) else f"{type(e).__name__}: {e}")
    return problems


def settle(ctx: HostContext, result: HostResult, change: Change, state_dir: str,
           problems: list[str], smoke_opts: SmokeOptions | None = None, note: str | None = None) -> HostResult:
    """Finish a pending change: commit it ("applied") when there are no problems; else roll it
    back (byte-identical) and run its handlers again, or, without change.rollback, commit it and
    mark the host failed. A rollback whose handlers restarted a server is followed by the
    health wait and one smoke decode (`smoke_opts`, when change.smoke_gated): result.data
    ["after_rollback"], and the reason says when the server did not come back (review L13).
    Runs under its own ROLLBACK_RESERVE_S deadline, so a host whose validation used up its
    deadline is still put back. A commit the host's full state dir made take another way (the
    ledger's reserve, or its pending line marked applied in place) says how in result.data
    ["commit_note"]. `note`: the commit's reason in the ledger when there are no problems
    (inuse.VALIDATION_SKIPPED). Raises HostFailed, ProbeFailed, RemoteTimeout, Unreachable (from the
    probe)."""
    ctx = replace(ctx, deadline=max(ctx.deadline, time.monotonic() + ROLLBACK_RESERVE_S))
    if problems and change.rollback:
        reason = "; ".join(problems)
        change_probe(ctx, "rollback", state_dir, change_id=change.change_id, reason=reason)
        try:
            ran = run_handlers(ctx, change.handlers)
        except HostFailed as e:
            ran, reason = [], reason + f"; after the rollback: {e}"
        if ran and change.smoke_gated and smoke_opts is not None:
            reason += _health_after_rollback(ctx, result, change, smoke_opts)
        result.status, result.error = HostStatus.FAILED, f"rolled back: {reason}"
        result.data["rolled_back"] = True
        return result
    committed = change_probe(ctx, "commit", state_dir, change_id=change.change_id, reason="; ".join(problems) or note)
    if committed.get("note"):  # the host's state dir is full: how the commit still got recorded (review L7)
        result.data["commit_note"] = committed["note"]
    result.status = HostStatus.CHANGED
    if problems:
        result.status, result.error = HostStatus.FAILED, "; ".join(problems) + " (on_failure: keep)"
    return result


def undo_changes(ctx: HostContext, done: list[Change], state_dir: str, reason: str) -> list[str]:
    """Roll back changes that were applied earlier in this run (latest first), with their
    handlers, so that a host whose later change failed is left untouched. Returns their ids.
    Raises HostFailed, ProbeFailed, RemoteTimeout, Unreachable."""
    ctx = replace(ctx, deadline=max(ctx.deadline, time.monotonic() + ROLLBACK_RESERVE_S))
    for change in reversed(done):
        change_probe(ctx, "rollback", state_dir, change_id=change.change_id, reason=reason)
        run_handlers(ctx, change.handlers)
    return [c.change_id for c in done]


def _health_after_rollback(ctx: HostContext, result: HostResult, change: Change, opts: SmokeOptions) -> str:
    """The health wait and one decode after a rollback's restart; sets result.data
    ["after_rollback"] ([{host, port, ok, error, health_wait_s}]) and returns "" or the text to
    add to the failure reason."""
    try:
        after = smoke(ctx, change.facts, replace(opts, repeat=1), reserve=5.0)
    except (RemoteTimeout, ProbeFailed, HostFailed, OutputTooLarge) as e:
        result.data["after_rollback"] = {"error": str(e)}
        return f"; after the rollback, the health check failed: {e}"
    result.data["after_rollback"] = [{k: s.get(k) for k in ("host", "port", "ok", "error", "health_wait_s")}
                                     for s in after["servers"]]
    bad = server_problems(after)  # a server refused (nothing sent) is no healthy one
    return f"; after the rollback the server is not healthy: {'; '.join(bad)}" if bad else ""
