"""The `fleetctl diagnose` job: where each server's decode time goes, and what would address it.

First, per host (_plan_job): the servers the facts probe identified (validate.smoke_targets, the
smoke decode's rule; the inventory's fleetctl_sglang_port / _host select among them), each with
its install (load.load_targets); with --allocator-replay, each install's own allocator replayed
(gather.allocator_replay, as inspect does). Then the servers are measured in waves (waves():
one server of each group of identical ones at a time, group_key, so the rest of a group keeps
serving; different servers side by side, a host's servers of one wave one after another) by the
diagnose probe (probes/diagnose/run.py: a bounded profile and expert record in a private
directory of the server's uid, read back as that uid, profiling and recording stopped after,
even when the run is killed); then each server's verdict (verdict.py). Read-only otherwise,
like inspect.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict

from ...config import DEFAULT_SGLANG_PORT, INSPECT_TIMEOUT_S
from ...connection import RemoteTimeout
from ...probes.traffic.allocreplay import DEADLINE_S as REPLAY_DEADLINE_S
from ...vocab import HostStatus
from ..context import HostContext, HostResult
from ..gather import allocator_replay, gather, not_inspected
from ..load import LoadOptions, load_targets
from ..validate import SmokeOptions, smoke_targets
from .verdict import UNMEASURED, judge

READ_S = 120.0  # the reading child's deadline (seconds)
SLACK_S = 30.0  # per server: the endpoints, /server_info, the guard


@dataclass(frozen=True)
class DiagnoseOptions:
    """port: used for discovered servers that give no --port; seconds: the profile's wall-clock
    bound per server; num_steps: its decode-step bound (the profiler stops after them: ProfileReq
    num_steps); load: run the load gate's client during the profile (engine/load.LoadOptions) or
    None (the traffic the server has); replay: the allocator replay's trace parameters
    (cli/options.replay_trace) or None; health_timeout: seconds a server gets to answer /health."""

    port: int = DEFAULT_SGLANG_PORT
    seconds: float = 20.0
    num_steps: int = 20
    load: LoadOptions | None = None
    replay: dict | None = None
    health_timeout: float = 60.0

    def budget_s(self, servers: int = 1) -> float:
        """Seconds one host needs for `servers` servers: profile, load, read and slack each."""
        per = self.health_timeout + self.seconds + READ_S + SLACK_S + (self.load.timeout_s if self.load else 0)
        return per * max(1, servers)


class DiagnoseData(TypedDict):
    """`diagnose` data: servers, one entry per server measured (probes/diagnose/run.py
    diagnose_server: {pid, host, port, version, ran_as, leftovers (directories of killed earlier
    runs cleared first), server_info (max_total_num_tokens, ep_size, token_usage, kv_load,
    avg_spec_accept_length, ...), trace (probes/diagnose/trace.py breakdown: source, events,
    table, device_us, busy_us, window_us, host_wait_us, idle_us, host_wait_share, classes,
    shares, top, unknown; microseconds), trace_file, trace_error, experts (probes/diagnose/
    experts.py balance: layers [{layer, gpu_counts, balancedness, hot_gpu, hot_expert,
    hot_gpu_share, tokens, expert_balancedness}], experts, ep_size, worst, mean_balancedness),
    dump_file, experts_error, load (the load client's entry with --load), stopped ({path: HTTP
    status} of the final stops), error} + verdict (engine/diagnose/verdict.judge: verdict, why,
    action, figures) + allocator_replay_info with --allocator-replay), and refused (the servers
    nothing was sent to: {pid, host, port, reason})."""

    servers: list
    refused: list


def _install_of(g: dict, pid) -> dict | None:
    sid = next((s.get("install") for s in g["facts"].get("servers") or [] if s.get("pid") == pid), None)
    return next((i for i in g.get("installs") or [] if i.get("id") == sid), None)


def group_key(server: dict, install: dict | None) -> tuple:
    """Which servers are identical, so that diagnose measures one of them at a time (the rest keep
    serving): the same SGLang release (the install's version), model (--model-path), parallelism
    (tp, pp, dp, dp attention, nnodes: facts.servers, parsed from the launch flags as
    server_args.py defines them), kind and PD role. A tuple of JSON-able values."""
    pd = server.get("pd") or {}
    return (((install or {}).get("sglang") or {}).get("version"), server.get("model_path"),
            server.get("tp_size"), server.get("pp_size"), server.get("dp_size"), server.get("enable_dp_attention"),
            server.get("nnodes"), server.get("kind"), pd.get("role") if isinstance(pd, dict) else None)


def waves(plans: list[tuple[str, list[tuple[tuple, dict | None]]]]) -> list[dict[str, list]]:
    """The order servers are measured in: `plans` [(host, [(group_key, selector)])] in inventory
    order; wave i holds, for each group, its i-th member, so no two identical servers are
    profiled at once while different ones are measured side by side. Returns [{host: [selector,
    ...] in that host's order}] (a host's servers of one wave are measured one after another)."""
    seen: dict[tuple, int] = {}
    out: list[dict[str, list]] = []
    for host, members in plans:
        for key, sel in members:
            i = seen[key] = seen.get(key, -1) + 1
            while len(out) <= i:
                out.append({})
            out[i].setdefault(host, []).append(sel)
    return out


@dataclass
class _Plan:
    """One host's part of a diagnose run, from its first phase: the gather (`g`) and its servers
    as (group_key, load-probe selector); one (key, None) for the inventory's fleetctl_sglang_port
    when the facts name no server."""
    g: dict
    members: list


def _plan_job(opts: DiagnoseOptions, plans: dict[str, _Plan]):
    """Phase one on each host: gather, refuse a host whose installs were seen but not inspected,
    skip one with no server, replay each install's allocator (--allocator-replay), and note the
    host's servers in `plans` (by host name) for the waves."""

    def job(ctx: HostContext) -> HostResult:
        g = gather(ctx, scan=opts.replay is not None)
        blocked = [e["reason"] for e in not_inspected(g) if e["servers"]]
        if blocked:
            return ctx.result(HostStatus.FAILED, "; ".join(blocked), data={"servers": [], "refused": []})
        facts = g["facts"]
        inside = ctx.container is not None
        targets = smoke_targets(ctx.host, facts, SmokeOptions(port=opts.port), inside=inside)
        selectors = load_targets(targets, facts, g.get("installs"), inside=inside)
        if not selectors and ctx.host.sglang_port is None:
            return ctx.result(HostStatus.SKIPPED, "diagnose: skipped (no server)", data={"servers": [], "refused": []})
        if opts.replay is not None:
            allocator_replay(ctx, g, opts.replay)
        by_pid = {(s.get("pid_in_container") if inside else s.get("pid")): s for s in facts.get("servers") or []}
        members = [(group_key(by_pid.get(sel["pid"]) or {}, _install_of(g, (by_pid.get(sel["pid"]) or {}).get("pid"))),
                    sel) for sel in selectors] or [(("inventory port", ctx.host.name), None)]
        plans[ctx.host.name] = _Plan(g, members)
        return ctx.result(HostStatus.OK, data={})

    return job


def _measure_job(opts: DiagnoseOptions, plans: dict[str, _Plan], wave: dict[str, list]):
    """A wave's job on each of its hosts: the diagnose probe over the host's servers of the wave
    (`wave`: {host: [selector, or None for the inventory's port]}), then each server's verdict."""

    def job(ctx: HostContext) -> HostResult:
        plan = plans[ctx.host.name]
        selectors = [s for s in wave[ctx.host.name] if s is not None]
        budget = ctx.remaining() - 5
        if budget < opts.seconds + 10:
            raise RemoteTimeout(f"no time left for a profile ({budget:.0f} s before the host deadline)")
        lo = opts.load
        port = ctx.host.sglang_port
        params = {"servers": selectors, "port": port, "host": ctx.host.sglang_host if port is not None else None,
                  "server_user": ctx.host.server_user, "api_key": ctx.host.sglang_api_key,
                  "unprivileged_user": ctx.host.unprivileged_user, "seconds": opts.seconds,
                  "num_steps": opts.num_steps, "read_timeout": READ_S, "health_timeout": opts.health_timeout,
                  "load": {"profile": lo.profile, "given": lo.given, "client": lo.client, "timeout": lo.timeout_s}
                  if lo else None}
        res = ctx.probe("diagnose.run", params, timeout=budget)
        bad = []
        for s in res.get("servers") or []:
            inst = _install_of(plan.g, s.get("pid")) or {}
            s["verdict"] = judge(s, inst.get("allocator_replay") if opts.replay is not None else None)
            if opts.replay is not None:
                s["allocator_replay_info"] = inst.get("allocator_replay_info")
            if s["verdict"]["verdict"] == UNMEASURED:
                bad.append(f"{s['host']}:{s['port']}: not measured: {s['verdict']['why']}")
        if not res.get("servers") and res.get("refused"):
            bad.append("no server to diagnose (nothing sent): "
                       + "; ".join(str(r.get("reason")) for r in res["refused"]))
        return ctx.result(HostStatus.FAILED if bad else HostStatus.OK, "; ".join(bad) or None, data=res)

    return job


def diagnose_fleet(fleet, hosts: list, opts: DiagnoseOptions, timeout: float | None = None) -> list[HostResult]:
    """`fleetctl diagnose` over `hosts` (inventory Hosts) on `fleet` (engine/fleet.Fleet): a first
    phase gathers each host and its servers (_plan_job), then the servers are measured in waves
    (waves(): one server of each group of identical ones at a time, group_key), each host's
    servers of a wave one after another. Returns one HostResult per host in inventory order:
    data {"servers": [the probe's entry (probes/diagnose/run.py) + "verdict": verdict.judge's],
    "refused": [...]}; failed when a server could not be measured (UNMEASURED: its reason) or an
    install seen was not inspected, skipped when it has no server. `timeout`: each phase's
    seconds per host (None: the inspect deadline for the first, then what the wave's servers
    need, DiagnoseOptions.budget_s). A Ctrl-C or the run's deadline stops the waves: hosts not
    yet measured are `not attempted`."""
    plans: dict[str, _Plan] = {}
    first = fleet.run(hosts, _plan_job(opts, plans), "diagnose: servers",
                      timeout=timeout or INSPECT_TIMEOUT_S + (REPLAY_DEADLINE_S if opts.replay is not None else 0))
    done = {r.host: r for r in first if r.host not in plans}
    got: dict[str, list[HostResult]] = {}
    schedule = waves([(h.name, plans[h.name].members) for h in hosts if h.name in plans])
    for i, wave in enumerate(schedule):
        todo = [h for h in hosts if h.name in wave and h.name not in done]
        if fleet.interrupted or fleet.expired:
            for h in todo:
                done[h.name] = HostResult(h.name, h.address, HostStatus.NOT_ATTEMPTED,
                                          "not attempted: the run was stopped before this host's servers were measured",
                                          interrupted=False if fleet.interrupted else None)
            continue
        need = max(len(wave[h.name]) for h in todo) if todo else 1
        for r in fleet.run(todo, _measure_job(opts, plans, wave), f"diagnose: wave {i + 1} of {len(schedule)}",
                           timeout=timeout or opts.budget_s(need)):
            got.setdefault(r.host, []).append(r)
            if r.status not in (HostStatus.OK, HostStatus.FAILED):
                done[r.host] = r  # unreachable, timed out, interrupted: its later waves are not run
    out = []
    for h, r0 in zip(hosts, first):
        if h.name in done and not got.get(h.name):
            out.append(done[h.name])
            continue
        rs = got.get(h.name, [])
        last = done.get(h.name)
        servers = [s for r in rs for s in r.data.get("servers") or []]
        refused = [s for r in rs for s in r.data.get("refused") or []]
        errors = [r.error for r in rs if r.error] + ([last.error] if last is not None and last not in rs else [])
        status = (last.status if last is not None
                  else HostStatus.FAILED if any(r.status == HostStatus.FAILED for r in rs) else HostStatus.OK)
        out.append(HostResult(h.name, h.address, status, "; ".join(e for e in errors if e) or None,
                              r0.elapsed_s + sum(r.elapsed_s for r in rs), {"servers": servers, "refused": refused},
                              interrupted=next((r.interrupted for r in rs if r.interrupted is not None),
                                               last.interrupted if last is not None else None)))
    return out


def groups(hosts: list[dict]) -> list[dict]:
    """The fleet roll-up of a diagnose document's hosts (each {"host", "servers": [{..., "verdict"}]}):
    [{"verdict", "action", "servers": ["HOST HOST:PORT"], "shares": {class: mean share of device
    time over the group's servers}, "host_wait_share": mean}], the largest group first."""
    out: dict[str, dict] = {}
    for h in hosts:
        for s in h.get("servers") or []:
            v = s.get("verdict") or {}
            key = v.get("verdict") or UNMEASURED
            e = out.setdefault(key, {"verdict": key, "action": v.get("action"), "servers": [], "_shares": []})
            e["servers"].append(f"{h.get('host')} {s.get('host')}:{s.get('port')}")
            if s.get("trace"):
                e["_shares"].append((s["trace"].get("shares") or {}, s["trace"].get("host_wait_share") or 0.0))
    for e in out.values():
        got = e.pop("_shares")
        keys = sorted({k for sh, _ in got for k in sh})
        e["shares"] = {k: sum(sh.get(k, 0.0) for sh, _ in got) / len(got) for k in keys} if got else {}
        e["host_wait_share"] = sum(w for _, w in got) / len(got) if got else None
    return sorted(out.values(), key=lambda e: (-len(e["servers"]), e["verdict"]))
