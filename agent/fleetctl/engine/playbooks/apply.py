"""Running a playbook on hosts: check mode, the check-then-apply flow, rolling batches.

What to change comes from the playbook (plan.py: facts + findings + sources -> a HostPlan, pure
data); how a change is written, validated, committed or rolled back is the change engine's
(changes.py), the same for kernel deploys. Per host, under the host's lock: recover a change a
killed run left pending -> gather facts with sources -> plan each selected install (every
install a server runs from, or --install ID) -> (the plans must be the ones the operator
confirmed) -> per install, changes.execute with the plan's gates (change_gates): baselines, write
("pending"), handlers, checks (compile, reinspect), smoke gate, load gate (when the playbook or
--gate load asks), route gate (the playbook's route step: engine/gates/route.py) -> "applied",
or rollback to the byte-identical originals (and then the installs changed before it in this run
are rolled back too).

Multi-node servers: a non-zero-rank node serves only /health, so its change is gated on its rank
0's decode when rank 0 (the server of node rank 0 with the same dist-init-addr and nnodes:
probes/topology.deployment) is on another host of the run, as the check pass saw them (Rank0s);
such a node is applied after the hosts of its batch, so that its gate never sees its rank 0
restarting. Without its rank 0 in the run, its gate is its /health alone (validate.RANK0_ABSENT).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, TypedDict

from ...connection import Connection

from ..changes import (Change, ChangeOptions, FileWrite, Recovery, change_job, change_probe, compile_problems, execute,
                       new_change_id, on_install, pending_ids, restart_handlers, undo_changes)
from ...config import CHECK_TIMEOUT_S, RESTART_CMD
from ...errors import HostFailed
from ..context import HostContext, HostResult
from ..fleet import Fleet, parse_serial
from ..containers import LASTS
from ..gather import find_install, gather, install_errors, install_facts, not_inspected
from ..gates import Gate
from ..gates.load import LoadGate
from ..gates.route import RouteGate
from ..gates.smoke import SmokeGate
from ..load import LoadOptions, load_options
from .patches import exportable
from ...inventory import Host
from .plan import HostPlan, plan_host, reinspect_problems
from .model import Playbook
from ...probes import redact
from ...probes.facts import topology
from ...probes.facts.verifyroute import PACKAGE as ROUTED_PACKAGE
from ..validate import Rank0
from ...vocab import HostStatus, PlanStatus


@dataclass
class ApplyOptions(ChangeOptions):
    """check: plan only; export: keep each planned file's texts (--export-patch); install: the install id to change (None: every install a server
    runs from, see select_installs); serial: Ansible serial spec ("1,25%,100%"); max_fail_percentage: a batch
    failing more than this percentage of its hosts stops the rollout; confirmed: host -> {path:
    post_sha256} of the plan the operator was shown (what is written must be what was shown)."""

    check: bool = False
    export: bool = False
    install: str | None = None
    serial: str | None = None
    max_fail_percentage: float = 0.0
    confirmed: dict[str, dict[str, str]] = field(default_factory=dict)


def select_installs(g: dict, install: str | None = None) -> list[dict]:
    """The installs (gathered, see gather()) a change is for: the one whose id is `install`, else
    every install a server runs from, else the only install ([] when there is none: plan_installs
    then says why, see no_install_reason). Installs seen but not inspected (gather.not_inspected)
    count as installs here, and one chosen is the host's failure with its reason: a server
    whose install was not inspected, the only install seen, the id named. Raises HostFailed
    when the id is not on the host or was not inspected, when a server's install was not
    inspected, when there are several installs and no server (the operator names one with
    --install), or when a chosen install's scan failed (its reason, e.g. the package
    directory was not found)."""
    installs = g.get("installs", [])
    unseen = not_inspected(g)
    host_unseen = [e for e in unseen if not e.get("root")]
    if install:
        refused = [e["reason"] for e in unseen if e["id"] == install]
        if refused:
            raise HostFailed(refused[0])
        chosen = [find_install(g, install)]
    else:
        blocked = [e["reason"] for e in host_unseen if e["servers"]]
        if blocked:
            raise HostFailed("; ".join(blocked))
        chosen = [i for i in installs if i["servers"]]
        seen = len(installs) + len(host_unseen)
        if not chosen and seen == 1:
            if host_unseen:
                raise HostFailed(host_unseen[0]["reason"])
            chosen = installs
        elif not chosen and seen:
            ids = ", ".join([i["id"] for i in installs] + [f"{e['id'] or e['python']} (not inspected)" for e in host_unseen])
            raise HostFailed(f"{seen} installs and no server: name one with --install ({ids})")
        elif not chosen and unseen:
            raise HostFailed("; ".join(e["reason"] for e in unseen))
    errors = install_errors({"installs": chosen})
    if errors:
        raise HostFailed("; ".join(errors))
    return chosen


def no_install_reason(g: dict) -> str | None:
    """Why a change without --install finds no install on the host although SGLang is there:
    its SGLang is only in containers (their installs, which a change enters only with --install:
    host_side keeps them aside as "container_installs"; or, for facts gathered without entering
    any, the containers facts.containers lists), said with what `--install ID` would do and how
    long that lasts, and how `--export-patch` bakes it into the image instead; None when no
    container runs SGLang (the playbook's own `requires` then say why)."""
    kept = g.get("container_installs") or []
    if kept:
        what = "; ".join(f"{i['id']} (container {i['root'].get('name')}, image {i['root'].get('image')})" for i in kept)
        how = f"--install {kept[0]['id']}"
    else:
        found = [c for c in (g.get("facts") or {}).get("containers") or []
                 if c.get("kind") in ("container", "rootless") and "entered_with" not in c]
        if not found:
            return None
        what = "; ".join(f"container {c['root'].get('name') or (c['root'].get('container_id') or '?')[:12]} "
                         f"({c['root'].get('runtime')}, image {c['root'].get('image')}, server pid "
                         f"{', '.join(map(str, c.get('servers') or []))}), not entered here" for c in found)
        how = "`fleetctl apply PLAYBOOK HOST --install ID` (ID from `fleetctl inspect HOST`)"
    return (f"not applicable without --install: sglang here is only in containers: {what}; {how} changes it "
            f"inside its container, a change that {LASTS}: add --export-patch DIR to bake it into the image "
            f"instead")


def _findings(inst: dict) -> dict:
    """The findings a plan reads of install `inst`: its scan's, and verify_attention_route
    (probes/facts/verifyroute.py; None when it was not scanned), whose files join "files"."""
    route = inst.get("verify_attention_route")
    return {"allocator_call_sites": inst["allocator_call_sites"], "need_sort_origins": inst["need_sort_origins"],
            "verify_attention_route": route,
            "files": {**(inst.get("scan") or {}).get("files", {}), **((route or {}).get("files") or {})}}


def plan_installs(playbook: Playbook, host: Host, g: dict, install: str | None,
                  host_vars: dict | None = None) -> list[tuple[dict | None, HostPlan]]:
    """Plan each selected install (select_installs) of gathered facts `g` (gathered with
    sources), rendered with `host_vars` (default: the host's vars): [(install, plan)], pure (no
    host is touched). Raises HostFailed (select_installs)."""
    plans = []
    chosen = select_installs(g, install)
    why = None if chosen else no_install_reason(g)
    if why:
        plan = HostPlan(host.name, playbook.name, PlanStatus.SKIPPED, reason=why)
        return [(None, plan)]
    for inst in chosen or [None]:
        findings = _findings(inst) if inst else {"allocator_call_sites": [], "need_sort_origins": [],
                                                 "verify_attention_route": None, "files": {}}
        plan = plan_host(playbook, host.name, dict(host.vars) if host_vars is None else host_vars,
                         install_facts(g, inst), findings,
                         (inst or {}).get("sources") or {})
        plan.install = inst["id"] if inst else None
        plans.append((inst, plan))
    return plans


def _plans(ctx: HostContext, playbook: Playbook, install: str | None) -> tuple[dict, list[tuple[dict | None, HostPlan]]]:
    """Gather (with sources) and plan each selected install: (gathered, [(install, plan)])."""
    g = gather(ctx, with_sources=True)
    if ctx.container is None:
        g = host_side(g)
    return g, plan_installs(playbook, ctx.host, g, install, _vars(ctx))


def host_side(g: dict) -> dict:
    """Gathered facts without the container installs (those with a `root`), which it keeps aside
    as "container_installs" (for no_install_reason): a container's installs are changed inside
    it (--install ID), never from the host."""
    installs = g.get("installs", [])
    return {**g, "installs": [i for i in installs if not i.get("root")],
            "container_installs": [i for i in installs if i.get("root")]}


def _vars(ctx: HostContext) -> dict:
    """The host's vars a plan is rendered with; inside a container, the restart command is the
    container's restart (changes.restart_handlers), or unset when there is none."""
    v = dict(ctx.host.vars)
    if ctx.container is not None:
        v.pop(RESTART_CMD.name, None)
        for h in restart_handlers(ctx):
            v[RESTART_CMD.name] = h["command"]
    return v


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


class CheckData(TypedDict, total=False):
    """A check pass's data (`apply --check`, and the plan an apply shows first): plan (every
    install's plan as one: HostPlan.to_dict without new texts, secrets redacted; files, edits,
    already_applied and left_alone each name their install), plans (one per install),
    skipped_reason, install_sglang ({install id: its sglang facts}), pending (change ids a
    killed run left pending), texts ({path: {pre_text, post_text}}, for --export-patch only)."""

    plan: dict
    plans: list
    skipped_reason: str | None
    install_sglang: dict
    pending: list
    texts: dict


def _planned_result(ctx: HostContext, plans: list[HostPlan]) -> HostResult:
    """One host's check result over its installs' plans: failed when one is, else changed when
    one changes, ok when one is ok, else skipped. data["plans"]: each plan; data["plan"]: all of
    them as one (files, edits, left alone... together; each names its install)."""
    statuses = [p.status.host_status for p in plans]
    status = next((s for s in (HostStatus.FAILED, HostStatus.CHANGED, HostStatus.OK) if s in statuses),
                  HostStatus.SKIPPED)
    several = len(plans) > 1
    why = [f"{p.install}: {p.reason}" if several else p.reason for p in plans
           if p.status.host_status == status and p.reason]
    datas = [_plan_data(p) for p in plans]
    merged = dict(next((d for d, st in zip(datas, statuses) if st == status), datas[0]))
    for key in ("files", "edits", "already_applied", "left_alone"):
        merged[key] = [dict(x, install=d["install"]) for d in datas for x in d[key]]
    reason = "; ".join(why) or None
    data: CheckData = {"plan": merged, "plans": datas,
                       "skipped_reason": reason if status == HostStatus.SKIPPED else None}
    return ctx.result(status, reason if status == HostStatus.FAILED else None, data=data)


@dataclass(frozen=True)
class Rank0s:
    """The rank 0 servers of multi-node deployments among a run's hosts, as its check pass saw
    them: by_deployment {topology.deployment: (rank 0's Host, {"python", "servers": [that
    server]})}; connect: opens a new verified connection to a host (of_run)."""

    by_deployment: dict
    connect: Callable[[Host], Connection]

    @classmethod
    def of_run(cls, fleet: Fleet, seen: dict[str, tuple[Host, dict]]) -> "Rank0s":
        """From `seen` ({host name: (Host, its facts)}: check_job's) and `fleet`'s session."""
        found = {}
        for host, facts in seen.values():
            for s in facts.get("servers") or []:
                key = topology.deployment(s)
                if key and s.get("node_rank") == 0:
                    found.setdefault(key, (host, {"python": facts.get("python"), "servers": [s]}))

        def connect(host: Host) -> Connection:
            conn = fleet.connect(host)
            try:
                conn.open()
            except BaseException:
                conn.close()
                raise
            return conn

        return cls(found, connect)

    def for_host(self, host: Host, facts: dict) -> list[Rank0]:
        """validate.Rank0 for each deployment whose non-zero-rank nodes among `facts`' servers
        (of `host`) have their rank 0 on another host of the run."""
        ports: dict[str, list[int]] = {}
        for s in facts.get("servers") or []:
            key = topology.deployment(s)
            if (s.get("node_rank") or 0) >= 1 and key in self.by_deployment and self.by_deployment[key][0].name != host.name:
                ports.setdefault(key, []).append(int(s["port"]))
        return [Rank0(self.by_deployment[k][0], self.by_deployment[k][1], k, tuple(p), self.connect)
                for k, p in ports.items()]

    def later(self, batch: list[Host], seen: dict[str, tuple[Host, dict]]) -> set[str]:
        """The hosts of `batch` to apply after the others: those with a node whose rank 0 is on
        another host of the same batch (its gate then sees no restart of its rank 0)."""
        names = {h.name for h in batch}
        return {h.name for h in batch if h.name in seen
                and any(r.host.name in names for r in self.for_host(h, seen[h.name][1]))}


def check_job(playbook: Playbook, state_dir: str, install: str | None = None, texts: bool = False,
              planned: dict[str, list[HostPlan]] | None = None, seen: dict[str, tuple[Host, dict]] | None = None):
    """Check mode: plan each selected install (select_installs) on the host and report what
    would change; touches nothing. A change left pending by a killed run is reported
    ("pending": [ids]): apply undoes it first, so the host counts as changed. data["install_sglang"]:
    {install id: its sglang facts}; with `texts` (for --export-patch), data["texts"]: {path:
    {"pre_text", "post_text"}} of every planned file, and a host whose changing install has an id
    or SGLang version an export cannot use fails (patches.exportable: hostpaths.Refused).
    `planned`, when given, gets each host's plans ({host name: [HostPlan]}): what an apply pass
    is bound to; `seen`, each host's (Host, facts) as gathered on the host itself (Rank0s)."""

    def job(ctx: HostContext) -> HostResult:
        g, plans = _plans(ctx, playbook, install)
        if planned is not None:
            planned[ctx.host.name] = [p for _, p in plans]
        if seen is not None and ctx.container is None:
            seen[ctx.host.name] = (ctx.host, g.get("facts") or {})
        result = _planned_result(ctx, [p for _, p in plans])
        result.data["install_sglang"] = {inst["id"]: inst["sglang"] for inst, _ in plans if inst}
        if texts:  # what names files in the export must be confined (review N2): else the host fails
            for inst, p in plans:
                if inst and p.files:
                    exportable(inst["id"], [f.rel for f in p.files], inst["sglang"].get("version"))
                new = [f.rel for f in p.files if f.pre_sha256 is None]
                if new:
                    raise HostFailed(f"--export-patch carries edits of existing files only; this plan creates {new[0]}")
            result.data["texts"] = {f.path: {"pre_text": inst["sources"][f.rel], "post_text": f.new_text}
                                    for inst, p in plans if inst for f in p.files}
        # a read-only container holds no ledger (and apply refuses it): nothing can be pending there
        read_only = ctx.container is not None and ctx.container["found"].get("read_only_rootfs")
        pending = [] if read_only else pending_ids(change_probe(ctx, "status", state_dir)["changes"])
        if pending:
            result.data["pending"] = pending
            if result.status in (HostStatus.OK, HostStatus.SKIPPED):
                result.status = HostStatus.CHANGED
        return result

    return on_install(install, state_dir, job)


def apply_job(playbook: Playbook, change_id: str, opts: ApplyOptions, rank0s: Rank0s | None = None):
    """The apply job for one host (see the module docstring); `rank0s`: where its non-zero-rank
    nodes are decoded (None: nowhere but their own /health)."""
    return on_install(opts.install, opts.state_dir,
                      change_job(opts.state_dir, lambda ctx, rec: _apply(ctx, rec, playbook, change_id, opts, rank0s)),
                      changing=True)


def reinspect_install(playbook: Playbook, plan: HostPlan, host: Host, inst: dict | None, g2: dict,
                      host_vars: dict | None = None) -> list[str]:
    """The playbook's reinspect check of `plan` (made for install `inst`, rendered with
    `host_vars`, default the host's vars) against facts gathered again after the write (`g2`,
    with sources): [problem] ([] when every edited site satisfies it)."""
    again = next((i for i in g2.get("installs", []) if inst and i["id"] == inst["id"]), None)
    if inst and again is None:
        return [f"install {inst['id']} is gone after the change"]
    return reinspect_problems(playbook, plan, dict(host.vars) if host_vars is None else host_vars,
                              install_facts(g2, again),
                              _findings(again) if again else {}, (again or {}).get("sources") or {})


def change_load(playbook: Playbook, steps: set[str], opts: ChangeOptions) -> LoadOptions | None:
    """The load gate's settings for a change planned with validate `steps`, or None when no load
    gate is asked for: the playbook's load step asks when it applies to the host (its `when`),
    the command line when it says --gate load; the settings are the step's under the command
    line's (--gate load:PROFILE and the load options). Raises ValueError for settings that do
    not go together (engine/load.load_options)."""
    if "load" not in steps and not opts.load_gate:
        return None
    declared = next((v.load for v in playbook.validate if v.step == "load"), None)
    return load_options(declared or {}, opts.load_settings)


def change_gates(playbook: Playbook, plan: HostPlan, inst: dict | None, opts: ChangeOptions,
                 rank0: list[Rank0] | None = None) -> list[Gate]:
    """The gates of a change planned as `plan` for install `inst`, in the order they run: the
    smoke gate (the plan's smoke step: its offline command; `rank0`, where the host's non-zero-rank
    nodes are decoded), the load gate (change_load), the route gate (the route step: the build
    the route-verify-attention hook routes, the verify_attention_route finding's package and the
    key its `current` names). Raises ValueError (change_load)."""
    steps = {v["step"] for v in plan.validate}
    gates: list[Gate] = []
    if "smoke" in steps:
        gates.append(SmokeGate(next((v.get("offline") for v in plan.validate if v["step"] == "smoke"), None),
                               list(rank0 or [])))
    load = change_load(playbook, steps, opts)
    if load is not None:
        gates.append(LoadGate(load))
    if "route" in steps:
        kernel = ((inst or {}).get("verify_attention_route") or {}).get("kernel") or {}
        gates.append(RouteGate(ROUTED_PACKAGE, kernel.get("current")))
    return gates


def _change(ctx: HostContext, playbook: Playbook, cid: str, g: dict, inst: dict | None, plan: HostPlan,
            opts: ChangeOptions, rank0s: Rank0s | None = None) -> Change:
    facts = install_facts(g, inst)
    steps = {v["step"] for v in plan.validate}

    def checks() -> list[str]:
        problems = []
        if "compile" in steps:
            problems += compile_problems(ctx, facts["python"]["path"], [f.path for f in plan.files])
        if "reinspect" in steps and not problems:
            problems += reinspect_install(playbook, plan, ctx.host, inst, gather(ctx, with_sources=True),
                                          _vars(ctx))
        return problems

    rank0 = rank0s.for_host(ctx.host, facts) if rank0s is not None and ctx.container is None else []
    return Change(
        cid, playbook.name,
        [FileWrite(path=f.path, pre_sha256=f.pre_sha256, post_sha256=f.post_sha256, new_text=f.new_text)
         for f in plan.files],
        facts, facts["sglang"].get("package_dir") or facts["sglang"]["location"], plan.handlers, checks,
        change_gates(playbook, plan, inst, opts, rank0), rollback=playbook.on_failure == "rollback",
        install=plan.install)


def _apply(ctx: HostContext, rec: Recovery, playbook: Playbook, change_id: str, opts: ApplyOptions,
           rank0s: Rank0s | None = None) -> HostResult:
    g, plans = _plans(ctx, playbook, opts.install)
    result = _planned_result(ctx, [p for _, p in plans])
    result.data.update(recovered=rec.changes, recovery_handlers=rec.handlers)
    if result.status != HostStatus.CHANGED:
        return result
    confirmed = opts.confirmed.get(ctx.host.name)
    if confirmed is not None and confirmed != {f.path: f.post_sha256 for _, p in plans for f in p.files}:
        raise HostFailed("the plan for this host changed after it was shown and confirmed "
                         "(SGLang changed meanwhile?); nothing was written: run apply again")
    changing = [(inst, p) for inst, p in plans if p.status == PlanStatus.CHANGE]
    done: list[Change] = []
    for n, (inst, plan) in enumerate(changing, start=1):
        change = _change(ctx, playbook, install_change_id(change_id, n, len(changing)), g, inst, plan, opts, rank0s)
        one = execute(ctx, ctx.result(HostStatus.CHANGED, data={}), change, opts)
        result.data.setdefault("changes", []).append({"install": plan.install, **one.data})
        for key in ("change_id", "handlers", "validation", "load_gate", "route_gate", "rolled_back"):
            if key in one.data:
                result.data[key] = one.data[key]
        if one.status == HostStatus.FAILED:
            undone = undo_changes(ctx, done, opts.state_dir, f"install {plan.install} failed")
            result.status = HostStatus.FAILED
            result.error = (f"{plan.install}: {one.error}" if len(changing) > 1 else one.error) + \
                (f"; rolled back with it: {', '.join(undone)}" if undone else "")
            return result
        done.append(change)
    result.data["change_id"] = change_id if len(changing) > 1 else done[0].change_id
    return result


def install_change_id(change_id: str, n: int, count: int) -> str:
    """The ledger id of the n-th (1-based) of `count` installs changed by run `change_id`:
    the run's id itself for one install, else "<change_id>.<n>" (rollback CHANGE-ID takes all)."""
    return change_id if count == 1 else f"{change_id}.{n}"


def run_playbook(fleet: Fleet, hosts: list[Host], playbook: Playbook, opts: ApplyOptions,
                 change_id: str | None = None, timeout: float | None = None,
                 planned: dict[str, list[HostPlan]] | None = None,
                 seen: dict[str, tuple[Host, dict]] | None = None) -> tuple[str, list[HostResult]]:
    """Check or apply `playbook` in rolling batches (opts.serial). A batch whose failed +
    unreachable share exceeds max_fail_percentage stops the rollout; later hosts are reported
    "not attempted". `timeout`: per-host seconds for this pass (default: the fleet's);
    `planned`, `seen`: filled by a check pass (check_job); an apply pass given `seen` gates
    non-zero-rank nodes on their rank 0 among those hosts (Rank0s), each batch's such nodes
    applied after the rest of the batch.
    Returns (change id, results in inventory order). Raises ValueError for a bad serial spec (parse_serial)."""
    cid = change_id or new_change_id(playbook.name)
    if opts.check:
        return cid, fleet.run(hosts, check_job(playbook, opts.state_dir, opts.install, opts.export, planned, seen),
                              "check", timeout=timeout)
    rank0s = Rank0s.of_run(fleet, seen) if seen else None
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
        later = rank0s.later(batch, seen) if rank0s else set()
        got = fleet.run([h for h in batch if h.name not in later], apply_job(playbook, cid, opts, rank0s),
                        f"apply {playbook.name}", timeout=timeout)
        if later:
            second = [h for h in batch if h.name in later]
            got += ([HostResult(h.name, h.address, HostStatus.NOT_ATTEMPTED, "not attempted: interrupted (Ctrl-C)",
                                interrupted=True) for h in second] if fleet.interrupted else
                    fleet.run(second, apply_job(playbook, cid, opts, rank0s), f"apply {playbook.name}", timeout=timeout))
            got.sort(key=lambda r: [h.name for h in batch].index(r.host))
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
    that really change), each bound to the plan it was shown. Raises ValueError (bad serial:
    parse_serial), whatever `confirm` raises."""
    parse_serial(opts.serial, len(hosts))
    planned: dict[str, list[HostPlan]] = {}
    seen: dict[str, tuple[Host, dict]] = {}
    _, results = run_playbook(fleet, hosts, playbook, replace(opts, check=True),
                              timeout=check_timeout or CHECK_TIMEOUT_S, planned=planned, seen=seen)
    if opts.check:
        return ApplyOutcome(None, results)
    to_change = [h for h, r in zip(hosts, results) if r.status == HostStatus.CHANGED]
    if not to_change:
        return ApplyOutcome(None, results, nothing_to_change=True)
    confirm(results, to_change)
    # what is written must be what was shown: each host's planned post-images, from its plans
    confirmed = {r.host: {f.path: f.post_sha256 for p in planned[r.host] for f in p.files}
                 for r in results if r.status == HostStatus.CHANGED and not r.data.get("pending")}
    cid, applied = run_playbook(fleet, to_change, playbook, replace(opts, check=False, confirmed=confirmed), seen=seen)
    by_name = {r.host: r for r in results} | {r.host: r for r in applied}
    return ApplyOutcome(cid, [by_name[h.name] for h in hosts])
