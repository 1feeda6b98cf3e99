"""Smoke decode on the host itself: which servers to try, running the probe, the validate job.

The smoke probe (probes/smoke.py) runs on the host because the inference port is usually not
reachable from the operator's machine. Servers come from the inventory (`fleetctl_sglang_port`,
`fleetctl_sglang_host`), else from the servers inspect discovered; an offline smoke command may
come from the inventory (`fleetctl_smoke_cmd`) or a playbook.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict

from ..config import DEFAULT_SGLANG_PORT, HEALTH_TIMEOUT_S, REQUEST_TIMEOUT_S
from ..connection import RemoteTimeout
from .context import HostContext, HostResult
from .gate import compare
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


def smoke_targets(host: Host, facts: dict | None, opts: SmokeOptions) -> list[dict]:
    """[{host, port}] to smoke-test: the inventory's fleetctl_sglang_port (+ fleetctl_sglang_host,
    default 127.0.0.1), else each discovered server (its --host, 0.0.0.0 read as 127.0.0.1)."""
    if host.sglang_port is not None:
        return [{"host": host.sglang_host, "port": host.sglang_port}]
    targets = []
    for s in (facts or {}).get("servers", []):
        h = s.get("host") or "127.0.0.1"
        t = {"host": "127.0.0.1" if h in ("0.0.0.0", "::") else h, "port": int(s.get("port") or opts.port)}
        if t not in targets:
            targets.append(t)
    return targets


def smoke(ctx: HostContext, facts: dict | None, opts: SmokeOptions, offline_cmd: str | None = None,
          reserve: float = 0.0, servers: bool = True) -> dict:
    """Run the smoke probe on the host: {"servers": [...], "offline": ... | None} (see probes/smoke.py).
    `reserve`: seconds of the host's deadline to leave unused (for a rollback); the health wait
    is cut to fit. `servers`: False runs only the offline command.
    Raises ProbeFailed, RemoteTimeout, Unreachable."""
    params = {"servers": smoke_targets(ctx.host, facts, opts) if servers else [],
              "health_timeout": opts.health_timeout, "repeat": opts.repeat, "request_timeout": REQUEST_TIMEOUT_S,
              "offline_cmd": offline_cmd or ctx.host.smoke_cmd, "api_key": ctx.host.sglang_api_key}
    if not params["servers"] and not params["offline_cmd"]:
        return {"servers": [], "offline": None}
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
    decoded ({host, port, model_path, version, stand_in, health_wait_s, ok, error, output_ids,
    ids_consistent, latency_s, e2e_latency_s, tokens_per_s, runs}; seconds), and offline (the
    offline check's {cmd, ok, returncode, timed_out, tail} or None)."""

    servers: list
    offline: dict | None


def smoke_problems(res: dict) -> list[str]:
    """What failed in a smoke result ({"servers", "offline"}: probes/smoke.py):
    ["HOST:PORT: error", "offline check 'CMD' failed (exit N[, timed out]): last lines"]."""
    bad = [f"{s['host']}:{s['port']}: {s['error']}" for s in res["servers"] if not s["ok"]]
    off = res.get("offline")
    if off is not None and not off["ok"]:
        bad.append(f"offline check {off['cmd']!r} failed (exit {off['returncode']}"
                   f"{', timed out' if off.get('timed_out') else ''}): {' | '.join(off['tail'][-3:])}")
    return bad


def validate_job(opts: SmokeOptions, install: str | None = None):
    """The `fleetctl validate` job: ok when every server (of install `install` when given)
    decodes its 16 greedy tokens (and the offline check, if any, passes); failed otherwise;
    skipped when there is nothing to check."""

    def job(ctx: HostContext) -> HostResult:
        facts = None
        ctx, _ = install_context(ctx, install)  # a container install: its probes run inside it
        if ctx.host.sglang_port is None or install:
            g = gather(ctx, scan=False)
            facts = install_facts(g, find_install(g, install)) if install else g["facts"]
        res: ValidateData = smoke(ctx, facts, opts)
        r = ctx.result(HostStatus.OK, data=res)
        bad = smoke_problems(res)
        if bad:
            r.status, r.error = HostStatus.FAILED, "; ".join(bad)
        elif not res["servers"] and res.get("offline") is None:
            r.status, r.error = HostStatus.SKIPPED, "validation: skipped (no server)"
        return r

    return job
