"""Running a playbook on hosts: plan, check mode, rolling apply, validation gate, rollback, status.

Per host, under the host's lock (flock held over the SSH connection for the whole job):
recover any change a killed run left pending -> gather facts with sources -> plan (pure, see
plan.py) -> baseline smoke decode -> write files (probes/change.py: pre-image hash check, backups,
atomic writes; ledger state "pending") -> notified handlers (restart) -> validation (compile,
reinspect, smoke gate) -> ledger "applied", or automatic rollback to the byte-identical originals.
A change stays "pending" until it is validated, so a run killed at any point leaves a pending
entry that the next run undoes before doing anything else.
"""

from __future__ import annotations

import getpass
import secrets
import socket
import time
from dataclasses import dataclass, field, replace

from .connection import RemoteTimeout, Unreachable
from .connection.command import operator_argv
from .fleet import (CHANGED, FAILED, NOT_ATTEMPTED, OK, SKIPPED, UNREACHABLE, Fleet, HostContext, HostFailed,
                    HostResult, parse_serial)
from .gather import gather
from .inventory import Host
from .plan import HostPlan, plan_host, reinspect_problems
from .playbook import Playbook
from .probes.change import STATE_DIR
from .validate import SmokeOptions, gate, smoke

LOCK_WAIT_S = 5.0
# Seconds of a host's deadline kept for rolling a change back after its validation.
ROLLBACK_RESERVE_S = 120.0
CHANGE_MODULES = ["change"]


@dataclass
class ApplyOptions:
    """check: plan only; serial: Ansible serial spec ("1,25%,100%"); max_fail_percentage: a batch
    failing more than this percentage of its hosts stops the rollout; smoke: gate options."""

    check: bool = False
    serial: str | None = None
    max_fail_percentage: float = 0.0
    smoke: SmokeOptions = field(default_factory=SmokeOptions)
    operator: str = field(default_factory=lambda: f"{getpass.getuser()}@{socket.gethostname()}")
    state_dir: str = STATE_DIR
    confirmed: dict[str, dict[str, str]] = field(default_factory=dict)  # host -> {rel: post_sha256} shown


def new_change_id(playbook: str) -> str:
    """A fresh change id: UTC time, playbook name and 6 random hex digits."""
    return f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{playbook}-{secrets.token_hex(3)}"


def change_probe(ctx: HostContext, action: str, state_dir: str = STATE_DIR, **params) -> dict:
    """Run one action of probes/change.py on the host; a refusal raises HostFailed."""
    res = ctx.probe("change", {"action": action, "state_dir": state_dir, **params}, modules=CHANGE_MODULES)
    if not res.get("ok", False):
        raise HostFailed(f"{action}: {res.get('error')}")
    return res


def _findings(g: dict) -> dict:
    return {"allocator_call_sites": g["allocator_call_sites"], "need_sort_origins": g["need_sort_origins"],
            "files": (g.get("scan") or {}).get("files", {})}


def _plan(ctx: HostContext, playbook: Playbook) -> tuple[dict, HostPlan]:
    g = gather(ctx, with_sources=True)
    plan = plan_host(playbook, ctx.host.name, dict(ctx.host.vars), g["facts"], _findings(g), g.get("sources") or {})
    return g, plan


def _plan_data(plan: HostPlan) -> dict:
    d = plan.to_dict()
    for f in d["files"]:
        f.pop("new_text", None)
    return d


def check_job(playbook: Playbook, state_dir: str = STATE_DIR):
    """Check mode: plan on the host and report what would change; touches nothing. A change left
    pending by a killed run is reported: apply undoes it first, so the host counts as changed."""

    def job(ctx: HostContext) -> HostResult:
        _, plan = _plan(ctx, playbook)
        result = _planned_result(ctx, plan)
        ledger = change_probe(ctx, "status", state_dir)["changes"]
        pending = [c["change_id"] for c in ledger if c["state"] == "pending"]
        if pending:
            result.data["pending"] = pending
            if result.status in (OK, SKIPPED):
                result.status = CHANGED
        return result

    return job


def _planned_result(ctx: HostContext, plan: HostPlan) -> HostResult:
    status = {"change": CHANGED, "ok": OK, "skipped": SKIPPED, "failed": FAILED}[plan.status]
    return HostResult(ctx.host.name, ctx.conn.address, status, plan.reason if status == FAILED else None,
                      data={"plan": _plan_data(plan), "skipped_reason": plan.reason if status == SKIPPED else None})


def _run_handlers(ctx: HostContext, handlers: list[dict]) -> list[dict]:
    ran = []
    for h in handlers:
        r = ctx.run(operator_argv(h["command"]))
        ran.append({"name": h["name"], "exit_code": r.exit_code,
                    "output": (r.stdout + r.stderr).decode("utf-8", "replace")[-1000:]})
        if r.exit_code != 0:
            raise HostFailed(f"handler {h['name']!r} failed (exit {r.exit_code}): {ran[-1]['output'].strip()}")
    return ran


def recover(ctx: HostContext, state_dir: str) -> tuple[list[dict], list[dict]]:
    """Undo changes a killed run left pending (probes/change.py `recover`); when there were any,
    restart SGLang with the host's `fleetctl_restart_cmd` (the killed run may have restarted it
    on the changed files). Returns (recovered changes, handlers run)."""
    recovered = change_probe(ctx, "recover", state_dir)["recovered"]
    cmd = ctx.host.vars.get("fleetctl_restart_cmd")
    handlers = _run_handlers(ctx, [{"name": "restart sglang", "command": cmd}]) if recovered and cmd else []
    return recovered, handlers


def _compile_problems(ctx: HostContext, python: str, paths: list[str]) -> list[str]:
    """Syntax errors in `paths` as the interpreter that serves SGLang reads them ("path:line: msg")."""
    res = ctx.probe("change", {"action": "compile", "paths": paths}, modules=CHANGE_MODULES, python=python)
    if not res.get("ok", False):
        raise HostFailed(f"compile: {res.get('error')}")
    return res["problems"]


def locked(state_dir: str, work):
    """A job that runs `work(ctx)` while holding the host's fleetctl lock (STATE_DIR/lock):
    a second run that wants to change the same host fails fast instead of interleaving."""

    def job(ctx: HostContext) -> HostResult:
        lock = ctx.conn.hold_lock(state_dir, timeout=LOCK_WAIT_S,
                                  hold_s=ctx.remaining() + ROLLBACK_RESERVE_S + 60)
        try:
            return work(ctx)
        finally:
            lock.release()

    return job


def apply_job(playbook: Playbook, change_id: str, opts: ApplyOptions):
    """The apply job for one host (see the module docstring)."""
    return locked(opts.state_dir, lambda ctx: _apply(ctx, playbook, change_id, opts))


def _apply(ctx: HostContext, playbook: Playbook, change_id: str, opts: ApplyOptions) -> HostResult:
    recovered, restarted = recover(ctx, opts.state_dir)
    g, plan = _plan(ctx, playbook)
    result = _planned_result(ctx, plan)
    result.data.update(recovered=recovered, recovery_handlers=restarted)
    if plan.status != "change":
        return result
    confirmed = opts.confirmed.get(ctx.host.name)
    if confirmed is not None and confirmed != {f.rel: f.post_sha256 for f in plan.files}:
        raise HostFailed("the plan for this host changed after it was shown and confirmed "
                         "(SGLang changed meanwhile?); nothing was written: run apply again")
    facts = g["facts"]
    python = facts["python"]["path"]
    steps = {v["step"] for v in plan.validate}
    offline = next((v.get("offline") for v in plan.validate if v["step"] == "smoke"), None)
    baseline = smoke(ctx, facts, opts.smoke, offline, reserve=ROLLBACK_RESERVE_S) if "smoke" in steps else None
    files = [{"path": f.path, "pre_sha256": f.pre_sha256, "post_sha256": f.post_sha256, "new_text": f.new_text}
             for f in plan.files]
    change_probe(ctx, "apply", opts.state_dir, change_id=change_id, playbook=playbook.name,
                 operator=opts.operator, files=files, commit=False)
    result.data["change_id"] = change_id

    def checks() -> list[str]:
        problems = []
        if "compile" in steps:
            problems += _compile_problems(ctx, python, [f.path for f in plan.files])
        if "reinspect" in steps and not problems:
            g2 = gather(ctx, with_sources=True)
            problems += reinspect_problems(playbook, plan, dict(ctx.host.vars), g2["facts"], _findings(g2),
                                           g2.get("sources") or {})
        return problems

    return finish_change(ctx, result, change_id, opts.state_dir, plan.handlers, checks, baseline, facts,
                         opts.smoke, offline, rollback=playbook.on_failure == "rollback")


def finish_change(ctx: HostContext, result: HostResult, change_id: str, state_dir: str, handlers: list[dict],
                  checks, baseline: dict | None, facts: dict, smoke_opts: SmokeOptions, offline: str | None,
                  rollback: bool = True) -> HostResult:
    """Validate a written change (validate_change) and settle it (settle). A connection lost on
    the way is retried once (a new connection, within the connect timeout) and the change rolled
    back under the rollback reserve; when the host cannot be reached again, raises Unreachable
    saying the change stays pending (the next apply, rollback or deploy undoes it: `recover`).
    The host lock stays with the lost session until sshd notices it or its hold time ends."""
    try:
        problems = validate_change(ctx, result, handlers, checks, baseline, facts, smoke_opts, offline)
        return settle(ctx, result, change_id, state_dir, handlers, problems, rollback=rollback)
    except Unreachable as e:
        lost = e
    try:
        ctx = ctx.reconnected()
        return settle(ctx, result, change_id, state_dir, handlers,
                      [f"the connection was lost during validation ({lost}); reconnected to roll back"])
    except Unreachable as e:
        raise Unreachable(f"change {change_id} pending: the next apply, rollback or deploy undoes it "
                          f"({lost}; reconnecting: {e})") from None


def validate_change(ctx: HostContext, result: HostResult, handlers: list[dict], checks, baseline: dict | None,
                    facts: dict, smoke_opts: SmokeOptions, offline: str | None) -> list[str]:
    """After a change is written: run the notified handlers, `checks()` (-> [problem]), then the
    smoke gate against `baseline`. Returns the problems; any error on the way (a handler that
    fails, a deadline, a probe crash) is a problem too, so the caller always settles the change.
    Smoke waits leave ROLLBACK_RESERVE_S of the host's deadline for the rollback.
    Sets result.data["handlers"] and ["validation"]."""
    problems: list[str] = []
    try:
        result.data["handlers"] = _run_handlers(ctx, handlers)
        problems += checks()
        if problems:
            return problems
        if baseline is None or (not baseline["servers"] and baseline["offline"] is None):
            result.data["validation"] = {"status": "skipped (no server)"}
            return problems
        if baseline["servers"] and not handlers:
            # without a restart the server still runs the old code: its decode proves nothing
            result.data["validation"] = {"status": "skipped (not restarted: no fleetctl_restart_cmd)"}
            if baseline["offline"] is None:
                return problems
            baseline = {"servers": [], "offline": baseline["offline"]}
        # a restart handler may ask for a longer health wait (a real server reloads its weights)
        waits = [h.get("wait_for_health_s") or 0 for h in handlers]
        after_opts = replace(smoke_opts, health_timeout=max([smoke_opts.health_timeout, *waits]))
        after = smoke(ctx, facts, after_opts, offline, reserve=ROLLBACK_RESERVE_S,
                      servers=bool(baseline["servers"]))
        verdict = gate(ctx.host, baseline, after, smoke_opts)
        result.data["validation"] = verdict.to_dict()
        if verdict.failed:
            problems.append(f"validation failed: {verdict.message}")
    except Unreachable:
        raise  # nothing more can be done now; the change stays pending and the next run undoes it
    except Exception as e:  # noqa: BLE001 - every other failure must still lead to the rollback
        problems.append(str(e) if isinstance(e, (HostFailed, RemoteTimeout)) else f"{type(e).__name__}: {e}")
    return problems


def settle(ctx: HostContext, result: HostResult, change_id: str, state_dir: str, handlers: list[dict],
           problems: list[str], rollback: bool = True) -> HostResult:
    """Finish a pending change: commit it ("applied") when there are no problems; else roll it
    back (byte-identical) and run the handlers again, or, without `rollback`, commit it and mark
    the host failed. Runs under its own ROLLBACK_RESERVE_S deadline, so a host whose validation
    used up its deadline is still put back."""
    ctx = replace(ctx, deadline=max(ctx.deadline, time.monotonic() + ROLLBACK_RESERVE_S))
    if problems and rollback:
        reason = "; ".join(problems)
        change_probe(ctx, "rollback", state_dir, change_id=change_id, reason=reason)
        try:
            _run_handlers(ctx, handlers)
        except HostFailed as e:
            reason += f"; after the rollback: {e}"
        result.status, result.error = FAILED, f"rolled back: {reason}"
        result.data["rolled_back"] = True
        return result
    change_probe(ctx, "commit", state_dir, change_id=change_id, reason="; ".join(problems) or None)
    result.status = CHANGED
    if problems:
        result.status, result.error = FAILED, "; ".join(problems) + " (on_failure: keep)"
    return result


def run_playbook(fleet: Fleet, hosts: list[Host], playbook: Playbook, opts: ApplyOptions,
                 change_id: str | None = None, timeout: float | None = None) -> tuple[str, list[HostResult]]:
    """Check or apply `playbook` in rolling batches (opts.serial). A batch whose failed +
    unreachable share exceeds max_fail_percentage stops the rollout; later hosts are reported
    "not attempted". `timeout`: per-host seconds for this pass (default: the fleet's).
    Returns (change id, results in inventory order)."""
    cid = change_id or new_change_id(playbook.name)
    if opts.check:
        return cid, fleet.run(hosts, check_job(playbook, opts.state_dir), "check", timeout=timeout)
    results: list[HostResult] = []
    start = 0
    stopped = None
    for batch_no, size in enumerate(parse_serial(opts.serial, len(hosts)), start=1):
        batch = hosts[start:start + size]
        start += size
        if fleet.interrupted:
            stopped = stopped or "not attempted: interrupted (Ctrl-C)"
        if stopped:
            results += [HostResult(h.name, h.address, NOT_ATTEMPTED, stopped,
                                   data={"interrupted": fleet.interrupted}) for h in batch]
            continue
        got = fleet.run(batch, apply_job(playbook, cid, opts), f"apply {playbook.name}", timeout=timeout)
        for r in got:
            r.data["batch"] = batch_no
        results += got
        bad = sum(r.status in (FAILED, UNREACHABLE) for r in got)
        if bad and 100.0 * bad / len(got) > opts.max_fail_percentage:
            stopped = (f"not attempted: rollout stopped after a batch of {len(got)} had {bad} failed "
                       f"(max_fail_percentage {opts.max_fail_percentage:g})")
    return cid, results


def rollback_job(change_id: str | None, force: bool, state_dir: str = STATE_DIR, handler_cmd_var: str = "fleetctl_restart_cmd"):
    """Roll back `change_id` (None: the host's last applied change) and restart SGLang with the
    host's `fleetctl_restart_cmd` when it is set."""

    def work(ctx: HostContext) -> HostResult:
        recovered, restarted = recover(ctx, state_dir)
        if recovered and not change_id:
            # the interrupted change was the last one: undoing it was the rollback asked for
            return HostResult(ctx.host.name, ctx.conn.address, CHANGED,
                              data={"change_id": recovered[-1]["change_id"], "recovered": recovered,
                                    "files": [f["path"] for r in recovered for f in r["files"]],
                                    "handlers": restarted})
        params = {"change_id": change_id} if change_id else {"last": True}
        res = change_probe(ctx, "rollback", state_dir, force=force, reason="operator rollback", **params)
        if res.get("nothing"):
            return HostResult(ctx.host.name, ctx.conn.address, OK, data={**res, "recovered": recovered})
        cmd = ctx.host.vars.get(handler_cmd_var)
        handlers = _run_handlers(ctx, [{"name": "restart sglang", "command": cmd}]) if cmd else []
        return HostResult(ctx.host.name, ctx.conn.address, CHANGED,
                          data={**res, "recovered": recovered, "handlers": handlers})

    return locked(state_dir, work)


def status_job(state_dir: str = STATE_DIR):
    """Ledger summary and drift for one host: applied changes whose files no longer carry them,
    and installed SGLang files that differ from the distribution's RECORD with no ledger entry."""

    def job(ctx: HostContext) -> HostResult:
        g = gather(ctx)
        sg = g["facts"].get("sglang") or {}
        res = change_probe(ctx, "status", state_dir, location=sg.get("location"), dist="sglang")
        res["sglang"] = sg.get("version")
        pending = [c["change_id"] for c in res["changes"] if c["state"] == "pending"]
        problems = ([f"change {c} is pending (interrupted, or a run in progress): the next apply or "
                     "rollback undoes it" for c in pending] +
                    [f"{d['path']}: {d['problem']}" for d in res["drift"]] +
                    [f"{m['path']}: {m['problem']}" for m in res.get("modified") or []])
        status, error = (FAILED, "; ".join(problems)) if problems else (OK, None)
        return HostResult(ctx.host.name, ctx.conn.address, status, error, data=res)

    return job
