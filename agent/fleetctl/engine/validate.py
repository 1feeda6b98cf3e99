"""Smoke decode on the host itself: which servers to try, running the probe, the validate job.

The smoke probe (probes/smoke.py) runs on the host because the inference port is usually not
reachable from the operator's machine. The servers are those the facts probe identified (of the
install being validated); the probe decodes only their own listening sockets, on loopback or an
address of the host, and refuses, by name, any other (probes/targets.py, review N6). The
inventory's `fleetctl_sglang_port` / `fleetctl_sglang_host` select among those sockets. An
offline smoke command may come from the inventory (`fleetctl_smoke_cmd`) or a playbook.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict

from ..config import DEFAULT_SGLANG_PORT, HEALTH_TIMEOUT_S, REQUEST_TIMEOUT_S
from ..connection import RemoteTimeout
from .context import HostContext, HostResult
from .gate import compare, refusal
from .gather import find_install, gather, install_context, install_facts
from ..inventory import Host
from ..vocab import HostStatus

# The smoke probe and the redaction it applies to what it returns.


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
    probe identified it, [{pid, python, port, host}] (python: its interpreter; port and host:
    what its argv claims, the port opts.port when it gives none), pid as the probe sees it (`inside` a
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
             "host": s.get("host") or "127.0.0.1"}
        if pid is not None and t not in named:
            named.append(t)
    return named


def smoke(ctx: HostContext, facts: dict | None, opts: SmokeOptions, offline_cmd: str | None = None,
          reserve: float = 0.0, servers: bool = True) -> dict:
    """Run the smoke probe on the host: {"servers": [...], "refused": [...], "offline": ... | None}
    (see probes/smoke.py) on the servers of `facts` (smoke_targets) and the inventory's
    fleetctl_sglang_port / _host. `reserve`: seconds of the host's deadline to leave unused (for
    a rollback); the health wait is cut to fit. `servers`: False runs only the offline command.
    Raises ProbeFailed, RemoteTimeout, Unreachable."""
    port = ctx.host.sglang_port if servers else None
    params = {"servers": smoke_targets(ctx.host, facts, opts, inside=ctx.container is not None) if servers else [],
              "port": port, "host": ctx.host.sglang_host if port is not None else None,
              "health_timeout": opts.health_timeout, "repeat": opts.repeat, "request_timeout": REQUEST_TIMEOUT_S,
              "offline_cmd": offline_cmd or ctx.host.smoke_cmd, "api_key": ctx.host.sglang_api_key}
    if not params["servers"] and port is None and not params["offline_cmd"]:
        return {"servers": [], "refused": [], "offline": None}
    budget = ctx.remaining() - reserve
    if budget < 5:
        raise RemoteTimeout(f"no time left for a smoke decode ({budget:.0f} s before the host deadline)")
    params["health_timeout"] = max(1.0, min(opts.health_timeout, budget - (opts.repeat + 2) * REQUEST_TIMEOUT_S / 4))
    params["offline_timeout"] = budget - 5
    python = ((facts or {}).get("python") or {}).get("path")
    return ctx.probe("smoke", params, python=python, timeout=budget)


def gate(host: Host, baseline: dict, after: dict, opts: SmokeOptions):
    """The validation gate (gate.compare) with these options; the latency slack (seconds) is
    --latency-slack, else the host's `fleetctl_latency_slack` var, else 0."""
    slack = opts.latency_slack_s
    if slack is None:
        slack = host.latency_slack
    return compare(baseline, after, latency_tolerance=opts.latency_tolerance,
                   allow_token_drift=opts.allow_token_drift, latency_slack_s=slack)


class ValidateData(TypedDict):
    """`validate` data: the smoke probe's answer (probes/smoke.py): servers, one entry per server
    decoded ({pid, host, port, model_path, version, stand_in, health_wait_s, ok, error,
    output_ids, ids_consistent, latency_s, e2e_latency_s, tokens_per_s, runs}; seconds), refused
    (the servers nothing was sent to: {pid, host, port (what each claimed), reason}), and
    offline (the offline check's {cmd, ok, returncode, timed_out, tail} or None)."""

    servers: list
    refused: list
    offline: dict | None


def server_problems(res: dict) -> list[str]:
    """What failed in a smoke result's servers (probes/smoke.py): ["HOST:PORT: error"], or, when
    no server was decoded and some were refused, ["no server to smoke-test (nothing sent):
    <each refusal>"]: a refused server fails the host only when none is left to decode."""
    bad = [f"{s['host']}:{s['port']}: {s['error']}" for s in res["servers"] if not s["ok"]]
    if not res["servers"] and res.get("refused"):
        bad.append("no server to smoke-test (nothing sent): " + "; ".join(map(refusal, res["refused"])))
    return bad


def smoke_problems(res: dict) -> list[str]:
    """What failed in a smoke result ({"servers", "refused", "offline"}: probes/smoke.py):
    server_problems, then "offline check 'CMD' failed (exit N[, timed out]): last lines"."""
    bad = server_problems(res)
    off = res.get("offline")
    if off is not None and not off["ok"]:
        bad.append(f"offline check {off['cmd']!r} failed (exit {off['returncode']}"
                   f"{', timed out' if off.get('timed_out') else ''}): {' | '.join(off['tail'][-3:])}")
    return bad


def validate_job(opts: SmokeOptions, install: str | None = None):
    """The `fleetctl validate` job: ok when every server identified on the host (of install
    `install` when given) that the smoke probe decodes gives its 16 greedy tokens (and the
    offline check, if any, passes), the refused ones named in data["refused"]; failed otherwise,
    and when every server was refused; skipped when there is nothing to check."""

    def job(ctx: HostContext) -> HostResult:
        ctx, _ = install_context(ctx, install)  # a container install: its probes run inside it
        g = gather(ctx, scan=False)  # the servers to decode are the ones identified here
        facts = install_facts(g, find_install(g, install)) if install else g["facts"]
        res: ValidateData = smoke(ctx, facts, opts)
        r = ctx.result(HostStatus.OK, data=res)
        bad = smoke_problems(res)
        if bad:
            r.status, r.error = HostStatus.FAILED, "; ".join(bad)
        elif not res["servers"] and not res["refused"] and res.get("offline") is None:
            r.status, r.error = HostStatus.SKIPPED, "validation: skipped (no server)"
        return r

    return job
