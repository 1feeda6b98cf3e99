"""Validation under load: the settings and the load probe's run on a host.

The load probe (probes/traffic/load.py) runs SGLang's own benchmark client on the host, from each
server's own install, against the servers the target rule picks (the same ones the smoke decode
talks to). This module is the control side of one run, for `validate --load` (engine/validate.py,
which also says what failed in a run: load_problems) and the load gate (engine/gates/load.py):

    load_options(*layers)          the settings (a playbook's `load` step, then the command line) -> LoadOptions
    load_targets / run_load        the probe's selectors (the smoke decode's, validate.smoke_targets,
                                   each with its server's install) and its run

Every figure keeps SGLang's own result name (output_throughput in tokens/s, p99_itl_ms and
p99_ttft_ms in ms: sglang/benchmark/serving.py:1855-1907 in 0.5.23, the same keys in 0.4.6,
0.5.2 and 0.5.10).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..connection import RemoteTimeout
from .context import HostContext
from ..probes.traffic.load import CLIENT_KINDS, PROFILES

# Seconds one load probe needs beyond its clients' deadlines (connect, bundle, facts, health).
LOAD_SLACK_S = 60.0
# The least client deadline worth starting a run with.
MIN_RUN_S = 10.0


@dataclass(frozen=True)
class LoadOptions:
    """One load run's settings and the gate's tolerances.

    profile: probes/load.PROFILES (smoke, steady, pressure); concurrency, num_prompts,
    input_len, output_len: the workload's values (None: the profile's); client: "auto" (the
    install's Python client, else its Rust one), "python" or "rust"; timeout_s: seconds one
    client run may take (then its process group is killed); repeat: baseline runs (2: each
    tolerance is widened to twice the measured spread). Tolerances: max_throughput_drop
    (fraction: after output_throughput >= (1 - it) x baseline), max_itl_rise and itl_slack_ms
    (after p99_itl_ms <= (1 + rise) x baseline + slack ms), max_ttft_rise and ttft_slack_ms
    (the same for p99_ttft_ms)."""

    profile: str = "smoke"
    concurrency: int | None = None
    num_prompts: int | None = None
    input_len: int | None = None
    output_len: int | None = None
    client: str = "auto"
    timeout_s: float = 300.0
    repeat: int = 1
    max_throughput_drop: float = 0.10
    max_itl_rise: float = 0.20
    itl_slack_ms: float = 2.0
    max_ttft_rise: float = 0.25
    ttft_slack_ms: float = 20.0

    @property
    def given(self) -> dict:
        """The workload values set here ({concurrency, num_prompts, input_len, output_len})."""
        return {"concurrency": self.concurrency, "num_prompts": self.num_prompts, "input_len": self.input_len,
                "output_len": self.output_len}

    def budget_s(self, runs: int) -> float:
        """Seconds `runs` load runs of one server may take, at most."""
        return runs * (self.timeout_s + LOAD_SLACK_S)


SETTINGS = tuple(f.name for f in dataclasses.fields(LoadOptions))
_INTS = ("concurrency", "num_prompts", "input_len", "output_len", "repeat")
_FRACTIONS = ("max_throughput_drop",)
_NON_NEGATIVE = ("max_itl_rise", "itl_slack_ms", "max_ttft_rise", "ttft_slack_ms")


def load_options(*layers: dict) -> LoadOptions:
    """LoadOptions from settings dicts, later layers over earlier ones (a playbook's `load` step,
    then the command line); a None value is "not set". Raises ValueError naming the setting for
    an unknown one or a bad value (an unknown profile or client, a count below 1, repeat not 1
    or 2, a tolerance below 0, a throughput drop of 1 or more, a timeout that is not positive)."""
    merged: dict = {}
    for layer in layers:
        for k, v in (layer or {}).items():
            if k not in SETTINGS:
                raise ValueError(f"unknown load setting {k!r} (known: {', '.join(SETTINGS)})")
            if v is not None:
                merged[k] = v
    for k, v in merged.items():
        if k in _INTS and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ValueError(f"load {k} must be a whole number of at least 1, not {v!r}")
        if k not in _INTS + ("profile", "client") and (not isinstance(v, (int, float)) or isinstance(v, bool)):
            raise ValueError(f"load {k} must be a number, not {v!r}")
    if merged.get("profile", "smoke") not in PROFILES:
        raise ValueError(f"unknown load profile {merged['profile']!r} (known: {', '.join(PROFILES)})")
    if merged.get("client", "auto") not in CLIENT_KINDS:
        raise ValueError(f"unknown load client {merged['client']!r} (known: {', '.join(CLIENT_KINDS)})")
    if merged.get("repeat", 1) not in (1, 2):
        raise ValueError(f"load repeat must be 1 or 2, not {merged['repeat']}")
    for k in _FRACTIONS:
        if k in merged and not 0 <= merged[k] < 1:
            raise ValueError(f"load {k} must be at least 0 and below 1, not {merged[k]}")
    for k in _NON_NEGATIVE:
        if k in merged and merged[k] < 0:
            raise ValueError(f"load {k} must not be negative, not {merged[k]}")
    if merged.get("timeout_s", 1) <= 0:
        raise ValueError(f"load timeout_s must be positive, not {merged['timeout_s']}")
    return LoadOptions(**{k: float(v) if k in _FRACTIONS + _NON_NEGATIVE + ("timeout_s",) else v
                          for k, v in merged.items()})


def load_targets(targets: list[dict], facts: dict, installs: list[dict] | None = None,
                 inside: bool = False) -> list[dict]:
    """The load probe's selectors: the smoke decode's `targets` (validate.smoke_targets: [{pid,
    python, port, host}] of the servers in `facts`), each with its server's install's
    package_dir and version (from `installs`, gathered, by the server's install id; else
    facts["sglang"], the install `facts` are of). `inside`: the pids are a container's
    (pid_in_container)."""
    by_id = {i["id"]: i["sglang"] for i in installs or []}
    servers = {(s.get("pid_in_container") if inside else s.get("pid")): s for s in facts.get("servers") or []}
    out = []
    for t in targets:
        sg = by_id.get((servers.get(t["pid"]) or {}).get("install")) or facts.get("sglang") or {}
        out.append(dict(t, package_dir=sg.get("package_dir"), version=sg.get("version")))
    return out


def run_load(ctx: HostContext, targets: list[dict], facts: dict, opts: LoadOptions, health_timeout: float,
             installs: list[dict] | None = None, reserve: float = 0.0) -> dict:
    """Run the load probe on the host against the smoke decode's `targets` of the servers of
    `facts` (load_targets) and the inventory's fleetctl_sglang_port / _host: {"servers": [per
    server: probes/traffic/load.py main], "refused": [...], "profile": opts.profile}. Each client run's
    deadline is opts.timeout_s, cut to share what the host's deadline leaves after `reserve`
    seconds; a server gets up to `health_timeout` (60 s at most) seconds to answer /health.
    Raises RemoteTimeout (no time left for a run), ProbeFailed, Unreachable."""
    port = ctx.host.sglang_port
    selectors = load_targets(targets, facts, installs, inside=ctx.container is not None)
    if not selectors and port is None:
        return {"servers": [], "refused": [], "profile": opts.profile}
    budget = ctx.remaining() - reserve
    health = min(health_timeout, 60.0)
    per_run = min(opts.timeout_s, (budget - health - LOAD_SLACK_S) / max(1, len(selectors)))
    if per_run < MIN_RUN_S:
        raise RemoteTimeout(f"no time left for a load run ({budget:.0f} s before the host deadline)")
    params = {"servers": selectors, "port": port, "host": ctx.host.sglang_host if port is not None else None,
              "profile": opts.profile, "given": opts.given, "client": opts.client, "timeout": per_run,
              "health_timeout": health, "api_key": ctx.host.sglang_api_key, "server_user": ctx.host.server_user,
              "in_container": ctx.container is not None,
              "unprivileged_user": ctx.host.unprivileged_user}
    res = ctx.probe("traffic.load", params, timeout=budget)  # stdlib: the host's interpreter (validate.smoke)
    res["profile"] = opts.profile
    return res
