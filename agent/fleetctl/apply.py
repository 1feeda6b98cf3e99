"""Running a playbook on hosts: check mode, the check-then-apply flow, rolling batches.

What to change comes from the playbook (plan.py: facts + findings + sources -> a HostPlan, pure
data); how a change is written, validated, committed or rolled back is the change engine's
(changes.py), the same for kernel deploys. Per host, under the host's lock: recover a change a
killed run left pending -> gather facts with sources -> plan -> (the plan must be the one the
operator confirmed) -> changes.execute: baseline smoke, write ("pending"), handlers, checks
(compile, reinspect), smoke gate -> "applied", or rollback to the byte-identical originals.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

from .changes import Change, ChangeOptions, Recovery, change_job, change_probe, compile_problems, execute, \
    new_change_id, pending_ids
from .config import CHECK_TIMEOUT_S
from .fleet import Fleet, HostContext, HostFailed, HostResult, parse_serial
from .gather import gather
from .inventory import Host
from .plan import HostPlan, plan_host, reinspect_problems
from .playbook import Playbook
from .probes import redact
from .vocab import HostStatus, PlanStatus


@dataclass
class ApplyOptions(ChangeOptions):
    """check: plan only; serial: Ansible serial spec ("1,25%,100%"); max_fail_percentage: a batch
    failing more than this percentage of its hosts stops the rollout; confirmed: host -> {rel:
    post_sha256} of the plan the operator was shown (what is written must be what was shown)."""

    check: bool = False
    serial: str | None = None
    max_fail_percentage: float = 0.0
    confirmed: dict[str, dict[str, str]] = field(default_factory=dict)


def _findings(g: dict) -> dict:
    return {"allocator_call_sites": g["allocator_call_sites"], "need_sort_origins": g["need_sort_origins"],
            "files": (g.get("scan") or {}).get("files", {})}


def _plan(ctx: HostContext, playbook: Playbook) -> tuple[dict, HostPlan]:
    g = gather(ctx, with_sources=True)
    plan = plan_host(playbook, ctx.host.name, dict(ctx.host.vars), g["facts"], _findings(g), g.get("sources") or {})
    return g, plan


def _plan_data(plan: HostPlan) -> dict:
    """The plan as reported (tables, --json): no new texts, secrets in commands redacted."""
    d = plan.to_dict()
    for f in d["files"]:
        f.pop("new_text", None)
    for h in d.get("handlers") or []:
        h["command"] = redact.text(h["command"])
    for v in d.get("validate") or []:
        if v.get("offline"):
            v["offline"] = redact.text(v["offline"])
    return d


def _planned_result(ctx: HostContext, plan: HostPlan) -> HostResult:
    status = plan.status.host_status
    return ctx.result(status,
                      plan.reason if status == HostStatus.FAILED else None,
                      data={"plan": _plan_data(plan),
                            "skipped_reason": plan.reason if status == HostStatus.SKIPPED else None})


def check_job(playbook: Playbook, state_dir: str):
    """Check mode: plan on the host and report what would change; touches nothing. A change left
    pending by a killed run is reported ("pending": [ids]): apply undoes it first, so the host
    counts as changed."""

    def job(ctx: HostContext) -> HostResult:
        _, plan = _plan(ctx, playbook)
        result = _planned_result(ctx, plan)
        pending = pending_ids(change_probe(ctx, "status", state_dir)["changes"])
        if pending:
            result.data["pending"] = pending
            if result.status in (HostStatus.OK, HostStatus.SKIPPED):
                result.status = HostStatus.CHANGED
        return result

    return job


def apply_job(playbook: Playbook, change_id: str, opts: ApplyOptions):
    """The apply job for one host (see the module docstring)."""
    return change_job(opts.state_dir, lambda ctx, rec: _apply(ctx, rec, playbook, change_id, opts))


def _apply(ctx: HostContext, rec: Recovery, playbook: Playbook, change_id: str, opts: ApplyOptions) -> HostResult:
    g, plan = _plan(ctx, playbook)
    result = _planned_result(ctx, plan)
    result.data.update(recovered=rec.changes, recovery_handlers=rec.handlers)
    if plan.status != PlanStatus.CHANGE:
        return result
    confirmed = opts.confirmed.get(ctx.host.name)
    if confirmed is not None and confirmed != {f.rel: f.post_sha256 for f in plan.files}:
        raise HostFailed("the plan for this host changed after it was shown and confirmed "
                         "(SGLang changed meanwhile?); nothing was written: run apply again")
    facts = g["facts"]
    steps = {v["step"] for v in plan.validate}

    def checks() -> list[str]:
        problems = []
        if "compile" in steps:
            problems += compile_problems(ctx, facts["python"]["path"], [f.path for f in plan.files])
        if "reinspect" in steps and not problems:
            g2 = gather(ctx, with_sources=True)
            problems += reinspect_problems(playbook, plan, dict(ctx.host.vars), g2["facts"], _findings(g2),
                                           g2.get("sources") or {})
        return problems

    change = Change(
        change_id, playbook.name,
        [{"path": f.path, "pre_sha256": f.pre_sha256, "post_sha256": f.post_sha256, "new_text": f.new_text}
         for f in plan.files],
        facts, facts["sglang"]["location"], plan.handlers, checks, smoke="smoke" in steps,
        offline=next((v.get("offline") for v in plan.validate if v["step"] == "smoke"), None),
        rollback=playbook.on_failure == "rollback")
    return execute(ctx, result, change, opts)


def run_playbook(fleet: Fleet, hosts: list[Host], playbook: Playbook, opts: ApplyOptions,
                 change_id: str | None = None, timeout: float | None = None) -> tuple[str, list[HostResult]]:
    """Check or apply `playbook` in rolling batches (opts.serial). A batch whose failed +
    unreachable share exceeds max_fail_percentage stops the rollout; later hosts are reported
    "not attempted". `timeout`: per-host seconds for this pass (default: the fleet's).
    Returns (change id, results in inventory order). Raises UsageError for a bad serial spec."""
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
            results += [HostResult(h.name, h.address, HostStatus.NOT_ATTEMPTED, stopped,
                                   interrupted=fleet.interrupted) for h in batch]
            continue
        got = fleet.run(batch, apply_job(playbook, cid, opts), f"apply {playbook.name}", timeout=timeout)
        for r in got:
            r.data["batch"] = batch_no
        results += got
        bad = sum(r.status in (HostStatus.FAILED, HostStatus.UNREACHABLE) for r in got)
        if bad and 100.0 * bad / len(got) > opts.max_fail_percentage:
            stopped = (f"not attempted: rollout stopped after a batch of {len(got)} had {bad} failed "
                       f"(max_fail_percentage {opts.max_fail_percentage:g})")
    return cid, results


@dataclass
class ApplyOutcome:
    """What check_then_apply did. change_id: None when nothing was applied; results: one per
    host in inventory order (the check pass's, replaced by the apply pass's where it ran);
    nothing_to_change: the check pass found no host to change (and this was not check mode)."""

    change_id: str | None
    results: list[HostResult]
    nothing_to_change: bool = False


def check_then_apply(fleet: Fleet, hosts: list[Host], playbook: Playbook, opts: ApplyOptions,
                     confirm: Callable[[list[HostResult], list[Host]], None],
                     check_timeout: float | None = None) -> ApplyOutcome:
    """The `fleetctl apply` flow. A check pass always comes first (per-host deadline
    `check_timeout`, default CHECK_TIMEOUT_S); unless opts.check, `confirm(check results, hosts
    to change)` is asked (it raises to stop: nothing is changed), and only the hosts the check
    found to change are applied, in opts.serial batches (so a canary batch is made of hosts
    that really change), each bound to the plan it was shown. Raises UsageError (bad serial),
    whatever `confirm` raises."""
    parse_serial(opts.serial, len(hosts))
    _, results = run_playbook(fleet, hosts, playbook, replace(opts, check=True),
                              timeout=check_timeout or CHECK_TIMEOUT_S)
    if opts.check:
        return ApplyOutcome(None, results)
    to_change = [h for h, r in zip(hosts, results) if r.status == HostStatus.CHANGED]
    if not to_change:
        return ApplyOutcome(None, results, nothing_to_change=True)
    confirm(results, to_change)
    # what is written must be what was shown: each host's planned post-images
    confirmed = {r.host: {f["rel"]: f["post_sha256"] for f in r.data["plan"]["files"]}
                 for r in results if r.status == HostStatus.CHANGED and not r.data.get("pending")}
    cid, applied = run_playbook(fleet, to_change, playbook, replace(opts, check=False, confirmed=confirmed))
    by_name = {r.host: r for r in results} | {r.host: r for r in applied}
    return ApplyOutcome(cid, [by_name[h.name] for h in hosts])
