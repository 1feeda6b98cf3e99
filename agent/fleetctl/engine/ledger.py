"""The ledger commands: `fleetctl rollback`, `recover` and `status`, each a host job over the
host's ledger (probes/change/ledger.py, read and written by the probes/change/actions.py actions through
changes.change_probe) and the change engine's lock and
recovery (changes.change_job). Each job's result data is a TypedDict beside it.
"""

from __future__ import annotations

import time
from typing import TypedDict

from ..config import STATE_DIR
from ..vocab import ChangeState, HostStatus
from . import containers
from ..connection import LockBusy
from ..errors import HostFailed, ProbeFailed
from .changes import (Recovery, change_job, change_probe, install_ledger, on_install, pending_ids, restart_handlers,
                      run_handlers)
from .context import HostContext, HostResult
from .gather import find_install, gather

# a recorded container that could not be recovered (entered, locked: one a killed run left
# restarting) is tried again after RECOVER_RETRY_S, RECOVER_TRIES times in all
RECOVER_TRIES, RECOVER_RETRY_S = 3, 3.0


class RollbackData(TypedDict, total=False):
    """`rollback` data: the change rolled back, its files (paths) and those restored by force,
    or with --forget the changes dropped (forgotten: probes/change/actions.py forget answers:
    {change_id, upgraded, removed, left}), the routing evidence removed with the last kernel change (probes/evidence.py remove); or `nothing` (why there was nothing to roll back); recovered (changes a killed run left
    pending, undone first), handlers (the restart handler's outcome)."""

    change_id: str
    files: list
    forced: list
    forgotten: list
    evidence_removed: str
    nothing: str
    recovered: list
    handlers: list


class RecoverData(TypedDict):
    """`recover` data: recovered (probes/change/actions.py recover entries; a container's with
    its "install"), handlers, containers (recover_containers: one entry per recorded container
    running)."""

    recovered: list
    handlers: list
    containers: list


class StatusData(TypedDict, total=False):
    """`status` data: the change probe's status answer (ok, changes, drift, modified,
    record_error, kernels, space), per install (installs: [{id, sglang, install, modified,
    record_error, metadata_warning? (stale or duplicate dist-infos: probes/facts/distinfo.py) |
    git, git_error}]), lost container changes, and the sglang summary line."""

    ok: bool
    changes: list
    drift: list
    modified: list
    record_error: str | None
    kernels: dict
    space: dict
    installs: list
    lost: list
    sglang: str | None


def rollback_job(change_id: str | None, force: bool, state_dir: str = STATE_DIR, install: str | None = None,
                 forget: bool = False):
    """The `fleetctl rollback` job: roll back `change_id` (None: the host's last applied change,
    of install `install` when given; `force`: restore files changed since) and run the restart
    handler. A run that changed several installs recorded "<change_id>.<n>" per install: the
    run's id rolls back all of them (latest first). A change a killed run left pending is undone
    first; when no id was given, that was the rollback asked for. `forget` (with a change id):
    instead of restoring, drop a change whose release an upgrade replaced (the probe's forget:
    it checks the tree first, removes the files the change created that the upgrade left, and
    records the change superseded); no restart. Result data: the probe's answer (change_id,
    files, forced, evidence_removed when the last kernel change went, or nothing; forgotten) +
    recovered, handlers."""

    def work(ctx: HostContext, rec: Recovery) -> HostResult:
        if rec.changes and not change_id:
            return ctx.result(HostStatus.CHANGED,
                              data={"change_id": rec.changes[-1]["change_id"], "recovered": rec.changes,
                                    "files": [f["path"] for r in rec.changes for f in r["files"]],
                                    "handlers": rec.handlers})
        ids = _rollback_ids(change_probe(ctx, "status", state_dir)["changes"], change_id, install)
        if not ids:
            return ctx.result(HostStatus.OK, data={"nothing": f"no applied change of install {install}",
                                                   "recovered": rec.changes})
        if forget:
            gone = [change_probe(ctx, "forget", state_dir, change_id=cid, reason="operator rollback --forget")
                    for cid in reversed(ids)]
            return ctx.result(HostStatus.CHANGED, data={"change_id": change_id, "forgotten": gone, "files": [],
                                                        "forced": [], "recovered": rec.changes, "handlers": []})
        res: RollbackData = {"change_id": change_id or ids[0], "files": [], "forced": []}
        for cid in reversed(ids):
            params = {"change_id": cid} if cid else {"last": True}
            one = change_probe(ctx, "rollback", state_dir, force=force, reason="operator rollback",
                               host=ctx.host.name, **params)
            if one.get("nothing"):
                return ctx.result(HostStatus.OK, data={**one, "recovered": rec.changes})
            res["change_id"] = change_id or one.get("change_id")
            res["files"] += one.get("files", [])
            res["forced"] += one.get("forced") or []
            if one.get("evidence_removed"):  # the last kernel change: the routing evidence went with it
                res["evidence_removed"] = one["evidence_removed"]
        handlers = run_handlers(ctx, restart_handlers(ctx))
        return ctx.result(HostStatus.CHANGED,
                          data={**res, "recovered": rec.changes, "handlers": handlers})

    return on_install(install, state_dir, change_job(state_dir, work), changing=True)


def _rollback_ids(ledger: list[dict], change_id: str | None, install: str | None) -> list[str | None]:
    """Ledger ids to roll back, oldest first: `change_id` itself, or the "<change_id>.<n>" entries
    of a run over several installs; without an id, the last applied change of `install` ([None]:
    the probe's own "last" when no install is named; [] when that install has none)."""
    if change_id:
        parts = [c["change_id"] for c in ledger if c["change_id"].startswith(change_id + ".")
                 and c["change_id"][len(change_id) + 1:].isdigit()]
        return parts if parts and change_id not in {c["change_id"] for c in ledger} else [change_id]
    if install is None:
        return [None]
    mine = [c["change_id"] for c in ledger if c["state"] == ChangeState.APPLIED and c.get("install") == install]
    return mine[-1:]


def recover_job(state_dir: str = STATE_DIR):
    """The `fleetctl recover` job: undo the changes a killed run left pending (restarting
    SGLang when there were any) and apply nothing: on the host, then in each running container
    the host keeps a change record of (recover_containers). Changed when it undid something, ok
    when nothing was pending, failed when a file had unknown content and was left alone (ledger
    "failed") or a recorded container could not be recovered. Result data: recovered
    (probes/change/actions.py recover entries; a container's with its "install"), handlers,
    containers (recover_containers)."""

    def work(ctx: HostContext, rec: Recovery) -> HostResult:
        inside = recover_containers(ctx, state_dir) if rec.container_records else []
        recovered = rec.changes + [{**c, "install": r["install"]} for r in inside for c in r.get("recovered", [])]
        failed = [c for c in recovered if c["state"] != ChangeState.ROLLED_BACK]
        errors = [f"change {c['change_id']}: {c['reason']}" for c in failed]
        errors += [f"{r['install']}: {r['error']}" for r in inside if r.get("error")]
        status = HostStatus.FAILED if errors else HostStatus.CHANGED if recovered else HostStatus.OK
        data: RecoverData = {"recovered": recovered,
                             "handlers": rec.handlers + [h for r in inside for h in r.get("handlers", [])],
                             "containers": inside}
        return ctx.result(status, "; ".join(errors) or None, data=data)

    return change_job(state_dir, work)


def recover_containers(ctx: HostContext, state_dir: str = STATE_DIR) -> list[dict]:
    """`recover` inside each container whose change record the host keeps still marked
    `changing` (on_install writes it so before a change there begins, and unmarked after it: the
    containers a killed run was changing), under that container's own lock, its restart handler run when
    something was undone, its record then written again. A container a killed run was changing
    that is stopped, or cannot be entered (stuck stopping: the run's own restart handler cut
    short), is restarted first (containers.restart_handler); one that is gone took its writable
    layer, and any pending change with it (`status` reports its applied ones lost:
    containers.lost_changes). A record not marked changing has nothing pending and is passed over.
    A container not recovered (just restarted, not entered, its lock held) is tried again,
    RECOVER_TRIES times in all, RECOVER_RETRY_S seconds apart. Returns [{"install", "recovered", "handlers"}
    or {"install", "error"}: a container that could not be started, entered or locked], one per
    recorded container recovered or tried. Raises ProbeFailed, RemoteTimeout, Unreachable."""
    g = gather(ctx, scan=False, records=state_dir)
    # only a record still marked changing can have a change pending behind it: a run that ended
    # wrote its record again, unmarked
    todo = {(r.get("root") or {}).get("container_id"): r for r in g.get("container_records", []) if r.get("changing")}
    todo.pop(None, None)
    out, errors, restarted = [], {}, {}
    for attempt in range(RECOVER_TRIES):
        if attempt:  # a container restarting, or just started, is seen again
            time.sleep(RECOVER_RETRY_S)
            g = gather(ctx, scan=False, records=state_dir)
        running = {(c.get("root") or {}).get("container_id"): c for c in g["facts"].get("containers", [])}
        errors = {}
        for cid, record in list(todo.items()):
            install = record.get("install")
            found = running.get(cid)
            if found is not None and found.get("entered_with") and not found.get("error"):
                def work(ictx: HostContext, rec: Recovery, install=install) -> HostResult:
                    containers.keep_record(ictx, state_dir, install, install_ledger(ictx, state_dir, install))
                    return ictx.result(HostStatus.OK, data={"recovered": rec.changes, "handlers": rec.handlers})

                try:
                    res = change_job(state_dir, work)(containers.enter(ctx, found, found["entered_with"]))
                except (LockBusy, HostFailed, ProbeFailed) as e:
                    errors[cid] = (install, f"not recovered: {e}")
                    continue
                out.append({"install": install, "recovered": res.data["recovered"],
                            "handlers": restarted.get(cid, []) + res.data["handlers"]})
                del todo[cid]
            elif found is not None and not found.get("entered_with"):
                errors[cid] = (install, f"not recovered: {found.get('note')}")
            elif cid in restarted:
                errors[cid] = (install, f"not recovered: {found.get('error') if found else 'not running'}")
            else:  # a run was changing it and it is stopped, or stopping: its own restart was cut short
                handler = containers.restart_handler(record["root"])
                if handler is None:
                    errors[cid] = (install, "not recovered: a run was changing it and it is not running; start it "
                                            "and run recover again")
                    continue
                try:
                    restarted[cid] = run_handlers(ctx, [handler])
                    errors[cid] = (install, "not recovered: restarted, but not seen running since")
                except HostFailed as e:
                    if containers.GONE in str(e).lower():  # recreated or removed: its layer went with it
                        del todo[cid]
                    else:
                        errors[cid] = (install, f"not recovered: {e}")
        if not todo:
            break
    return out + [{"install": install, "error": e} for install, e in errors.values()]


def status_job(state_dir: str = STATE_DIR, install: str | None = None):
    """The `fleetctl status` job: ledger summary and drift for one host, per install (`install`:
    only that one, and only its changes): applied changes whose files no longer carry them;
    files modified outside fleetctl with no ledger entry to explain them, judged against the
    distribution's RECORD for a wheel, and against git (probes/facts/gittree.py: run as the tree's
    owner) for an editable install or checkout in a git work tree (a tree without `.git` is
    judged by the ledger alone). On the host, container installs are left to `--install ID`
    (their ledgers are inside them), and a host copy of a container change record whose
    container was recreated is reported lost (containers.CHANGE_LOST). Failed when anything is
    pending, drifted or lost."""

    def job(ctx: HostContext) -> HostResult:
        g = gather(ctx, scan=False, records=state_dir if ctx.container is None else None)
        installs = [find_install(g, install)] if install else \
            [i for i in g.get("installs", []) if (i.get("root") is None) == (ctx.container is None)]
        res: StatusData = change_probe(ctx, "status", state_dir, host=ctx.host.name)
        if install:
            res["changes"] = [c for c in res["changes"] if c.get("install") == install]
            ids = {c["change_id"] for c in res["changes"]}
            res["drift"] = [d for d in res["drift"] if d["change_id"] in ids]
        explained = {p for c in res["changes"] if c["state"] in (ChangeState.APPLIED, ChangeState.PENDING)
                     for p in c["files"]} - {d["path"] for d in res["drift"]}
        trees = [i["sglang"]["location"] for i in installs if i["sglang"]["install"] != "wheel"]
        git = ctx.probe("facts.gittree", {"locations": trees})["trees"] if trees else {}
        res["installs"], res["modified"] = [], []
        for i in installs:
            sg = i["sglang"]
            one = {"id": i["id"], "sglang": sg["version"], "install": sg["install"]}
            if sg["install"] == "wheel":
                r = change_probe(ctx, "status", state_dir, location=sg["location"], dist="sglang")
                one.update(modified=r["modified"] or [], record_error=r["record_error"])
                if r.get("metadata_warning"):
                    one["metadata_warning"] = r["metadata_warning"]
            else:
                t = git[sg["location"]]
                one.update(git=t["git"], git_error=t["error"],
                           modified=[{"path": p, "problem": "modified outside fleetctl (git)"}
                                     for p in t["modified"] if p not in explained])
            res["installs"].append(one)
            res["modified"] += one["modified"]
        res["lost"] = containers.lost_changes(g.get("container_records", []), g)
        res["sglang"] = ", ".join(f"{i['sglang']} ({i['install']})" for i in res["installs"]) or None
        problems = ([f"change {c} is pending (interrupted, or a run in progress): the next apply or "
                     "rollback undoes it" for c in pending_ids(res["changes"])] +
                    [f"{d['path']}: {d['problem']}" for d in res["drift"]] +
                    [f"{m['path']}: {m['problem']}" for m in res["modified"]] +
                    [f"{i['id']}: {i['git_error']}" for i in res["installs"] if i.get("git_error")] +
                    [f"{i['id']}: {i['metadata_warning']}" for i in res["installs"] if i.get("metadata_warning")] +
                    [f"{x['install']}: {x['problem']} ({', '.join(x['changes'])})" for x in res["lost"]])
        status, error = (HostStatus.FAILED, "; ".join(problems)) if problems else (HostStatus.OK, None)
        return ctx.result(status, error, data=res)

    return on_install(install, state_dir, job)
