"""Smoke decode on the host itself: which servers to try, running the probe, what failed in its
answers (and in a load run's), the validate job. The smoke gate that compares two decodes is
engine/gates/smoke.py.

The smoke probe (probes/traffic/smoke.py) runs on the host because the inference port is usually not
reachable from the operator's machine. The servers are those the facts probe identified (of the
install being validated); the probe decodes only their own listening sockets, on loopback or an
address of the host, and refuses, by name, any other (probes/facts/targets.py, review N6). The
inventory's `fleetctl_sglang_port` / `fleetctl_sglang_host` select among those sockets. An
offline smoke command may come from the inventory (`fleetctl_smoke_cmd`) or a playbook.

A non-zero-rank node of a multi-node server (`--node-rank 1` and above) serves only /health
(probes/traffic/smoke.py): the probe checks its health only. Its decode is rank 0's, on another host: a
change gated on rank 0 (Rank0, given by the apply run when rank 0 is one of its hosts) decodes
there before and after, and the smoke gate compares those decodes; without one, the gate is the
node's /health alone and says so (RANK0_ABSENT).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, TypedDict

from ..config import DEFAULT_SGLANG_PORT, HEALTH_TIMEOUT_S, REQUEST_TIMEOUT_S
from ..connection import Connection, RemoteTimeout, Unreachable
from ..errors import HostFailed, ProbeFailed
from .context import HostContext, HostResult
from .gather import SUCCESSION, find_install, gather, install_context, install_facts, not_inspected
from .load import LoadOptions, run_load
from ..inventory import Host
from ..probes import redact
from ..probes.facts import topology
from ..vocab import HostStatus


@dataclass(frozen=True)
class SmokeOptions:
    """port: used for discovered servers that give no --port; health_timeout, latency_slack_s in
    seconds (slack None: the host's fleetctl_latency_slack var, else 0); latency_tolerance:
    allowed after/baseline latency ratio for the gate."""

    port: int = DEFAULT_SGLANG_PORT
    health_timeout: float = HEALTH_TIMEOUT_S
    repeat: int = 3
    latency_tolerance: float = 1.25
    latency_slack_s: float | None = None
    allow_token_drift: bool = False


def smoke_targets(host: Host, facts: dict | None, opts: SmokeOptions, inside: bool = False) -> list[dict]:
    """The smoke probe's `servers` (probes/targets.live): each server in `facts` as the facts
    probe identified it, [{pid, python, port, host, uid, unit, ppid}] (python: its interpreter; port
    and host: what its argv claims, the port opts.port when it gives none; uid, unit, ppid when the
    facts have them: SUCCESSION), pid as the probe sees it (`inside` a
    container: pid_in_container; a server with no pid there is left out). facts None (the
    caller gathered none: the collection's smoke action, when the inventory names the port):
    [{"pid": None, "port", "host"}], every server the probe identifies on the host, on the
    inventory's fleetctl_sglang_port and _host."""
    if facts is None:
        port = host.sglang_port
        return [{"pid": None, "port": port, "host": host.sglang_host if port is not None else None}]
    named = []
    for s in facts.get("servers", []):
        pid = s.get("pid_in_container") if inside else s.get("pid")
        t = {"pid": pid, "python": s.get("python"), "port": int(s.get("port") or opts.port),
             "host": s.get("host") or "127.0.0.1", **{k: s[k] for k in SUCCESSION if s.get(k) is not None}}
        if pid is not None and t not in named:
            named.append(t)
    return named


def decode_need_s(opts: SmokeOptions) -> float:
    """Seconds of a host's deadline a smoke decode keeps beyond its health wait: (repeat + 2)
    quarters of REQUEST_TIMEOUT_S, for the decodes after the wait. smoke() cuts the health wait
    to fit what the deadline leaves after them."""
    return (opts.repeat + 2) * REQUEST_TIMEOUT_S / 4


def smoke_deadline_s(opts: SmokeOptions, reserve: float) -> float:
    """The shortest per-host deadline (s) in which a smoke decode waits the whole
    opts.health_timeout: the wait, decode_need_s, and `reserve` seconds kept for a rollback.
    The commands refuse a --timeout under it (cli/fleet.py) rather than let smoke() cut the wait."""
    return opts.health_timeout + decode_need_s(opts) + reserve


def smoke(ctx: HostContext, facts: dict | None, opts: SmokeOptions, offline_cmd: str | None = None,
          reserve: float = 0.0, servers: bool = True, offline: bool = True) -> dict:
    """Run the smoke probe on the host: {"servers": [...], "refused": [...], "offline": ... | None}
    (see probes/traffic/smoke.py) on the servers of `facts` (smoke_targets) and the inventory's
    fleetctl_sglang_port / _host. `reserve`: seconds of the host's deadline to leave unused (for
    a rollback); the health wait is cut to fit, and a health failure after a cut wait says so in
    its error (the commands refuse a --timeout that would cut it: smoke_deadline_s). `servers`: False runs only the offline command;
    `offline`: False runs none (a decode on rank 0's host for another host's gate).
    Each server's model_path (what it answered) is redacted (probes/redact.py).
    Raises ProbeFailed, RemoteTimeout, Unreachable."""
    port = ctx.host.sglang_port if servers else None
    params = {"servers": smoke_targets(ctx.host, facts, opts, inside=ctx.container is not None) if servers else [],
              "port": port, "host": ctx.host.sglang_host if port is not None else None,
              "health_timeout": opts.health_timeout, "repeat": opts.repeat, "request_timeout": REQUEST_TIMEOUT_S,
              "offline_cmd": (offline_cmd or ctx.host.smoke_cmd) if offline else None,
              "api_key": ctx.host.sglang_api_key, "server_user": ctx.host.server_user,
              "pd_router": ctx.host.pd_router if servers else None}
    if not params["servers"] and port is None and not params["offline_cmd"]:
        return {"servers": [], "refused": [], "offline": None}
    budget = ctx.remaining() - reserve
    if budget < 5:
        raise RemoteTimeout(f"no time left for a smoke decode ({budget:.0f} s before the host deadline)")
    params["health_timeout"] = max(1.0, min(opts.health_timeout, budget - decode_need_s(opts)))
    params["offline_timeout"] = budget - 5
    # a stdlib probe: the host's interpreter runs it (the install's may be its owner's, which root
    # never starts: probes/trust.py), a container's its own
    res = ctx.probe("traffic.smoke", params, timeout=budget)
    # what each server says it serves (its /model_info) may carry a URL's secrets (review N11)
    for s in res.get("servers") if isinstance(res.get("servers"), list) else []:
        if isinstance(s, dict) and isinstance(s.get("model_path"), str):
            s["model_path"] = redact.text(s["model_path"])
    if params["health_timeout"] < opts.health_timeout:  # what the deadline cut is named, never silent
        cut = (f" (the health wait was cut from {opts.health_timeout:g} s to {params['health_timeout']:.0f} s: "
               f"the host's deadline, --timeout, left {budget:.0f} s)")
        for s in res.get("servers") if isinstance(res.get("servers"), list) else []:
            if isinstance(s, dict) and isinstance(s.get("error"), str) and s["error"].startswith("health deadline"):
                s["error"] += cut
    return res


# ---- multi-node servers: a non-zero-rank node's gate -----------------------------------------

RANK0_ABSENT = "rank 0 not in this run: /health only"


@dataclass(frozen=True)
class Rank0:
    """Rank 0 of a multi-node server, on another host of the run: where a change to one of its
    non-zero-rank nodes is decoded. host: rank 0's inventory host; facts: {"python", "servers":
    [rank 0's server as its facts probe identified it]}; deployment: topology.deployment of
    both; ports: the ports of the changed host's nodes it stands for; connect: opens a new
    verified connection to `host` (the run's session: Fleet.connect, then open)."""

    host: Host
    facts: dict
    deployment: str
    ports: tuple[int, ...]
    connect: Callable[[Host], Connection]


def rank0_smoke(ctx: HostContext, r0: Rank0, opts: SmokeOptions, reserve: float = 0.0) -> dict:
    """The smoke decode of rank 0's server on its own host, over a connection of its own (closed
    after), within `ctx`'s deadline less `reserve` seconds; no offline check. Returns {"host"
    (rank 0's inventory name), "deployment", "ports", "error" (None, or why rank 0 could not be
    smoke-tested: unreachable, a probe that failed), and smoke()'s "servers", "refused",
    "offline"}. Raises RemoteTimeout when the deadline leaves no time for it."""
    out = {"host": r0.host.name, "deployment": r0.deployment, "ports": list(r0.ports), "error": None,
           "servers": [], "refused": [], "offline": None}
    try:
        conn = r0.connect(r0.host)
        try:
            out.update(smoke(HostContext(r0.host, conn, ctx.deadline), r0.facts, opts, reserve=reserve, offline=False))
        finally:
            conn.close()
    except (Unreachable, ProbeFailed, HostFailed) as e:
        out["error"] = str(e)
    return out


def rank0_label(e: dict) -> str:
    """"rank 0 on HOST (ADDR)": how a rank 0 entry (rank0_smoke's) is named in problems and checks."""
    return f"rank 0 on {e['host']} ({e['deployment'].rpartition('/')[0]})"


def rank0_problems(entries: list[dict]) -> list[str]:
    """What fails in rank 0's smoke results (rank0_smoke's): its error, a server that failed
    (server_problems), and a server whose /server_info says it is not rank 0 of that
    deployment: ["rank 0 on HOST (ADDR): why"]."""
    bad = []
    for e in entries:
        why = [e["error"]] if e.get("error") else server_problems(e)
        for s in e.get("servers") or []:
            said = s.get("server_args") or {}
            if said.get("node_rank", 0) != 0 or ("dist_init_addr" in said and "nnodes" in said
                                                 and topology.deployment(said) != e["deployment"]):
                why.append(f"{s['host']}:{s['port']} says on /server_info it is node_rank {said.get('node_rank')} "
                           f"of {said.get('dist_init_addr')} (nnodes {said.get('nnodes')})")
        if not e.get("servers") and not why:
            why.append("no server decoded")
        bad += [f"{rank0_label(e)}: {w}" for w in why]
    return bad


class ValidateData(TypedDict):
    """`validate` data: the smoke probe's answer (probes/traffic/smoke.py): servers, one entry per server
    decoded ({pid, host, port, model_path, version, stand_in, health_wait_s, ok, error,
    output_ids, ids_consistent, latency_s, e2e_latency_s, tokens_per_s, runs}; seconds), refused
    (the servers nothing was sent to: {pid, host, port (what each claimed), reason}), and
    offline (the offline check's {cmd, ok, returncode, timed_out, tail} or None); with --load,
    load (engine/load.run_load: {"servers": [per server: probes/traffic/load.py], "refused", "profile"})."""

    servers: list
    refused: list
    offline: dict | None
    load: dict  # with --load only


def refusal(r: dict) -> str:
    """One refused server of a probe's answer ({pid, host, port, reason}: probes/facts/targets.py) as
    text: "pid N (claims HOST:PORT): reason", or the reason alone for the inventory's choice."""
    if r.get("pid") is None:
        return r["reason"]
    return "pid %s (claims %s:%s): %s" % (r["pid"], r["host"], r["port"], r["reason"])


def server_problems(res: dict) -> list[str]:
    """What failed in a smoke result's servers (probes/traffic/smoke.py): ["HOST:PORT: error"], or, when
    no server was decoded and some were refused, ["no server to smoke-test (nothing sent):
    <each refusal>"]: a refused server fails the host only when none is left to decode."""
    bad = [f"{s['host']}:{s['port']}: {s['error']}" for s in res["servers"] if not s["ok"]]
    if not res["servers"] and res.get("refused"):
        bad.append("no server to smoke-test (nothing sent): " + "; ".join(map(refusal, res["refused"])))
    return bad


def smoke_problems(res: dict) -> list[str]:
    """What failed in a smoke result ({"servers", "refused", "offline"}: probes/traffic/smoke.py; and
    "rank0", rank 0's decodes for a non-zero-rank node: rank0_problems): server_problems, then
    "offline check 'CMD' failed (exit N[, timed out]): last lines", then rank 0's."""
    bad = server_problems(res)
    off = res.get("offline")
    if off is not None and not off["ok"]:
        bad.append(f"offline check {off['cmd']!r} failed (exit {off['returncode']}"
                   f"{', timed out' if off.get('timed_out') else ''}): {' | '.join(off['tail'][-3:])}")
    return bad + rank0_problems(res.get("rank0") or [])


def load_problems(res: dict) -> list[str]:
    """What failed in a load result (load.run_load): ["load HOST:PORT: not run: WHY"], ["load
    HOST:PORT: ERROR"] (a request failed, the deadline, no result), or, when no server was
    loaded and some were refused, ["no server to load (nothing sent): <each refusal>"]."""
    bad = []
    for s in res.get("servers") or []:
        if s.get("not_run"):
            bad.append(f"load {s['host']}:{s['port']}: not run: {s['not_run']}")
        elif not s.get("ok"):
            bad.append(f"load {s['host']}:{s['port']}: {s.get('error') or 'failed'}")
    if not res.get("servers") and res.get("refused"):
        bad.append("no server to load (nothing sent): " + "; ".join(map(refusal, res["refused"])))
    return bad


def validate_job(opts: SmokeOptions, install: str | None = None, load: LoadOptions | None = None):
    """The `fleetctl validate` job: ok when every server identified on the host (of install
    `install` when given) that the smoke probe decodes gives its 16 greedy tokens (and the
    offline check, if any, passes), the refused ones named in data["refused"]; failed otherwise,
    when every server was refused, and when a server's install (or the install named) was seen
    but not inspected (gather.not_inspected: its reason, nothing decoded); skipped when there
    is nothing to check. With `load` (engine/load.LoadOptions, `validate --load`), after a
    smoke decode that passed, SGLang's own benchmark client runs against the same servers
    (load.run_load: data["load"]), and the host fails when any server's run failed a request,
    gave no result or could not run ("load ... not run: why": a gate that asked for load fails
    closed)."""

    def job(ctx: HostContext) -> HostResult:
        ctx, _ = install_context(ctx, install)  # a container install: its probes run inside it
        g = gather(ctx, scan=False)  # the servers to decode are the ones identified here
        blocked = [e["reason"] for e in not_inspected(g) if (e["id"] == install if install else e["servers"])]
        if blocked:  # a server seen whose install was not inspected is not vouched for (README)
            return ctx.result(HostStatus.FAILED, "; ".join(blocked), data={"servers": [], "refused": [], "offline": None})
        facts = install_facts(g, find_install(g, install)) if install else g["facts"]
        res: ValidateData = smoke(ctx, facts, opts)
        r = ctx.result(HostStatus.OK, data=res)
        bad = smoke_problems(res)
        if load is not None and res["servers"]:
            if bad:
                res["load"] = {"servers": [], "refused": [], "profile": load.profile,
                               "not_run": "the smoke decode failed first"}
            else:
                targets = smoke_targets(ctx.host, facts, opts, inside=ctx.container is not None)
                res["load"] = run_load(ctx, targets, facts, load, opts.health_timeout, installs=g.get("installs"))
                bad = load_problems(res["load"])
        if bad:
            r.status, r.error = HostStatus.FAILED, "; ".join(bad)
        elif not res["servers"] and not res["refused"] and res.get("offline") is None:
            r.status, r.error = HostStatus.SKIPPED, "validation: skipped (no server)"
        return r

    return job
