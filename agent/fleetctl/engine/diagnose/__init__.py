"""The `fleetctl diagnose` job: where each server's decode time goes, and what would address it.

Per host: the servers the facts probe identified (validate.smoke_targets, the smoke decode's
rule; the inventory's fleetctl_sglang_port / _host select among them), each with its install
(load.load_targets), measured one after another by the diagnose probe (probes/diagnose/run.py:
a bounded profile and expert record in a private directory of the server's uid, read back as
that uid, profiling and recording stopped after, even when the run is killed); with
--allocator-replay, each install's own allocator replayed first (gather.allocator_replay, as
inspect does); then each server's verdict (verdict.py). Read-only otherwise, like inspect.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict

from ...config import DEFAULT_SGLANG_PORT
from ...connection import RemoteTimeout
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


def diagnose_job(opts: DiagnoseOptions):
    """The `fleetctl diagnose` job (module docstring). data: {"servers": [the probe's entry
    (probes/diagnose/run.py) + "verdict": verdict.judge's], "refused": [...]}; the host is
    failed when a server could not be measured (UNMEASURED: its reason) or an install seen was
    not inspected, skipped when it has no server."""

    def job(ctx: HostContext) -> HostResult:
        g = gather(ctx, scan=opts.replay is not None)
        blocked = [e["reason"] for e in not_inspected(g) if e["servers"]]
        if blocked:
            return ctx.result(HostStatus.FAILED, "; ".join(blocked), data={"servers": [], "refused": []})
        facts = g["facts"]
        inside = ctx.container is not None
        targets = smoke_targets(ctx.host, facts, SmokeOptions(port=opts.port), inside=inside)
        selectors = load_targets(targets, facts, g.get("installs"), inside=inside)
        port = ctx.host.sglang_port
        if not selectors and port is None:
            return ctx.result(HostStatus.SKIPPED, "diagnose: skipped (no server)", data={"servers": [], "refused": []})
        if opts.replay is not None:
            allocator_replay(ctx, g, opts.replay)
        budget = ctx.remaining() - 5
        if budget < opts.seconds + 10:
            raise RemoteTimeout(f"no time left for a profile ({budget:.0f} s before the host deadline)")
        lo = opts.load
        params = {"servers": selectors, "port": port, "host": ctx.host.sglang_host if port is not None else None,
                  "server_user": ctx.host.server_user, "api_key": ctx.host.sglang_api_key,
                  "unprivileged_user": ctx.host.unprivileged_user, "seconds": opts.seconds,
                  "num_steps": opts.num_steps, "read_timeout": READ_S, "health_timeout": opts.health_timeout,
                  "load": {"profile": lo.profile, "given": lo.given, "client": lo.client, "timeout": lo.timeout_s}
                  if lo else None}
        res = ctx.probe("diagnose.run", params, timeout=budget)
        bad = []
        for s in res.get("servers") or []:
            inst = _install_of(g, s.get("pid")) or {}
            s["verdict"] = judge(s, inst.get("allocator_replay") if opts.replay is not None else None)
            if opts.replay is not None:
                s["allocator_replay_info"] = inst.get("allocator_replay_info")
            if s["verdict"]["verdict"] == UNMEASURED:
                bad.append(f"{s['host']}:{s['port']}: not measured: {s['verdict']['why']}")
        if not res.get("servers") and res.get("refused"):
            bad.append("no server to diagnose (nothing sent): "
                       + "; ".join(str(r.get("reason")) for r in res["refused"]))
        r = ctx.result(HostStatus.FAILED if bad else HostStatus.OK, "; ".join(bad) or None, data=res)
        return r

    return job


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
