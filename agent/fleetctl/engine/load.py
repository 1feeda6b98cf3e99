"""Validation under load: the settings, the load probe's run on a host, and the load gate.

The load probe (probes/traffic/load.py) runs SGLang's own benchmark client on the host, from each
server's own install, against the servers the target rule picks (the same ones the smoke decode
talks to). This module is the control side:

    load_options(*layers)          the settings (a playbook's `load` step, then the command line) -> LoadOptions
    load_targets / run_load        the probe's selectors (the smoke decode's, validate.smoke_targets,
                                   each with its server's install) and its run
    load_problems                  what failed or did not run, per server (a gate that asked fails closed)
    compare_load(baselines, after) the gate: breach when a request failed, output throughput fell
                                   below (1 - drop) x baseline, p99 ITL rose over (1 + rise) x baseline
                                   + slack, or p99 TTFT likewise; with two baselines (repeat 2) each
                                   tolerance is widened to twice the baselines' measured spread

Every figure keeps SGLang's own result name (output_throughput in tokens/s, p99_itl_ms and
p99_ttft_ms in ms: sglang/benchmark/serving.py:1855-1907 in 0.5.23, the same keys in 0.4.6,
0.5.2 and 0.5.10).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..connection import RemoteTimeout
from .context import HostContext
from ..errors import HostFailed
from .gate import Check, GateResult, refusal
from ..probes.traffic.load import CLIENT_KINDS, PROFILES
from ..vocab import GateStatus

# Seconds one load probe needs beyond its clients' deadlines (connect, bundle, facts, health).
LOAD_SLACK_S = 60.0
# The least client deadline worth starting a run with.
MIN_RUN_S = 10.0
# The gated metrics: (SGLang's result key, the tolerance field, its slack field or None, higher is better).
GATED = (("output_throughput", "max_throughput_drop", None, True),
         ("p99_itl_ms", "max_itl_rise", "itl_slack_ms", False),
         ("p99_ttft_ms", "max_ttft_rise", "ttft_slack_ms", False))
# What the report shows side by side (SGLang's names), the gated ones first.
SHOWN = ("completed", "failed", "output_throughput", "request_throughput", "p99_itl_ms", "p99_ttft_ms",
         "median_ttft_ms", "median_itl_ms", "p99_e2e_latency_ms", "accept_length")


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
              "health_timeout": health, "api_key": ctx.host.sglang_api_key, "in_container": ctx.container is not None}
    python = ((facts or {}).get("python") or {}).get("path")
    res = ctx.probe("traffic.load", params, python=python, timeout=budget)
    res["profile"] = opts.profile
    return res


def load_problems(res: dict) -> list[str]:
    """What failed in a load result (run_load): ["load HOST:PORT: not run: WHY"], ["load
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


def _spread(a: float | None, b: float | None) -> float:
    """|a - b| over their mean (0 when either is missing or the mean is 0)."""
    if a is None or b is None or a + b == 0:
        return 0.0
    return abs(a - b) / ((a + b) / 2)


def baseline_of(runs: list[dict]) -> tuple[dict, dict]:
    """(the baseline `load` object: the mean of each gated metric over `runs` (each a server's
    `load` object), the other keys from the first run; {metric: spread between the runs}, empty
    for one run)."""
    first = dict(runs[0])
    spread: dict = {}
    if len(runs) > 1:
        for key, *_ in GATED:
            values = [r.get(key) for r in runs]
            if all(isinstance(v, (int, float)) for v in values):
                first[key] = sum(values) / len(values)
            spread[key] = _spread(values[0], values[1])
    return first, spread


def _fmt(key: str, v: float | None) -> str:
    if v is None:
        return "none"
    return f"{v:.1f} tok/s" if key == "output_throughput" else f"{v:.2f} ms"


def _metric_check(target: str, key: str, base: float | None, after: float | None, tol: float, widened_from: float,
                  spread: float | None, slack: float | None, higher: bool) -> tuple[Check, float | None]:
    """One gated metric's check and its limit (None when a side gave no value)."""
    name = {"output_throughput": "load-throughput", "p99_itl_ms": "load-itl", "p99_ttft_ms": "load-ttft"}[key]
    if base is None or after is None:
        return Check(name, target, False, f"{key}: {'baseline' if base is None else 'after'} run gave none"), None
    if higher:
        limit = (1 - tol) * base
        ok = after >= limit
        rule = f"at least {1 - tol:.2f}x = {_fmt(key, limit)}"
    else:
        limit = (1 + tol) * base + (slack or 0.0)
        ok = after <= limit
        rule = f"at most {1 + tol:.2f}x + {slack:g} ms = {_fmt(key, limit)}"
    ratio = f"{after / base:.2f}x" if base else "n/a"
    noise = (f"; tolerance {widened_from:.0%} widened to {tol:.0%} by the baselines' spread of {spread:.1%}"
             if spread is not None and tol > widened_from else "")
    return Check(name, target, ok, f"{key} {_fmt(key, after)} vs baseline {_fmt(key, base)} ({ratio}; {rule}{noise})"), limit


def _server_gate(target: str, bases: list[dict | None], a: dict | None, opts: LoadOptions) -> tuple[list[Check], dict]:
    """The checks of one server (`bases`: its baseline runs' entries, `a`: its after entry) and
    its row for the report: {target, baseline (baseline_of), baselines (each run's `load`),
    after (its `load`), spread, limits ({gated metric: its limit}, once the after run gave a
    result)}."""
    row = {"target": target, "baseline": None, "baselines": [], "after": (a or {}).get("load"), "spread": {},
           "limits": {}}
    if any(b is None or not b.get("ok") for b in bases):
        bad = next((b for b in bases if b is None or not b.get("ok")), None)
        why = "not in the baseline" if bad is None else (f"not run: {bad['not_run']}" if bad.get("not_run")
                                                          else bad.get("error"))
        return [Check("load-baseline", target, False, f"baseline under load failed: {why}")], row
    row["baselines"] = [b["load"] for b in bases]
    base, spread = baseline_of(row["baselines"])
    row["baseline"], row["spread"] = base, spread
    if a is None:
        return [Check("load-run", target, False, "missing after the change")], row
    if a.get("not_run"):
        return [Check("load-run", target, False, f"load: not run: {a['not_run']}")], row
    after = a.get("load")
    if after is None:
        return [Check("load-run", target, False, a.get("error") or "the load run gave no result")], row
    failed = after.get("failed", 0)
    checks = [Check("load-errors", target, failed == 0 and after.get("completed") == after.get("requested"),
                    f"{after.get('completed')} of {after.get('requested')} requests completed"
                    + (f", {failed} failed: {a['errors'][0]}" if failed and a.get("errors") else
                       f", {failed} failed" if failed else ""))]
    row["limits"] = {}
    for key, tol_name, slack_name, higher in GATED:
        tol = getattr(opts, tol_name)
        wide = max(tol, 2 * spread[key]) if key in spread else tol
        if higher:
            wide = min(wide, 0.99)
        check, row["limits"][key] = _metric_check(target, key, base.get(key), after.get(key), wide, tol,
                                                  spread.get(key), getattr(opts, slack_name) if slack_name else None,
                                                  higher)
        checks.append(check)
    return checks, row


def compare_load(baselines: list[dict], after: dict, opts: LoadOptions) -> tuple[GateResult, list[dict]]:
    """The load gate for one host: `baselines` (one or two run_load results taken right before the
    change) against `after` (the same run after the restart handler). Servers are paired by (host,
    port). A server is breached when its baseline did not complete (load-baseline), its after
    run did not run or gave no result (load-run), any request failed (load-errors: completed
    against the count asked, since the clients exit 0 when requests fail), or a metric passed
    its limit (GATED: load-throughput, load-itl, load-ttft; the limits are inclusive; with two
    baselines each tolerance is widened to twice their spread). Returns (the GateResult, one row
    per server for the report: {target, baseline, baselines, after, spread})."""
    keyed = [{(s["host"], s["port"]): s for s in b.get("servers") or []} for b in baselines]
    as_ = {(s["host"], s["port"]): s for s in after.get("servers") or []}
    keys = list(keyed[0]) + [k for k in as_ if k not in keyed[0]]
    if not keys:
        return GateResult(GateStatus.SKIPPED, message="load: skipped (no server)"), []
    checks, rows = [], []
    for key in keys:
        c, row = _server_gate("%s:%s" % key, [k.get(key) for k in keyed], as_.get(key), opts)
        checks += c
        rows.append(row)
    failed = [c for c in checks if not c.passed]
    message = "; ".join(f"{c.target} {c.name} {'passed' if c.passed else 'FAILED'}: {c.detail}"
                        for c in failed or checks)
    return GateResult(GateStatus.FAILED if failed else GateStatus.PASSED, checks, message), rows


def tolerances(opts: LoadOptions) -> dict:
    """The gate's tolerances as set (before any widening by noise), by their setting names."""
    return {k: getattr(opts, k) for k in ("max_throughput_drop", "max_itl_rise", "itl_slack_ms", "max_ttft_rise",
                                          "ttft_slack_ms")}


def load_baselines(ctx: HostContext, targets: list[dict], facts: dict, opts: LoadOptions, health_timeout: float,
                   reserve: float) -> list[dict]:
    """The load gate's baseline, right before a change: opts.repeat run_load results (`targets`,
    `facts`, `health_timeout`: see there). Refuses the
    host first when its deadline cannot hold repeat + 1 runs and `reserve` seconds (for the
    rollback), then when a baseline run fails or cannot run: a change could only fail its gate
    (the gate asked for load: it fails closed). Raises HostFailed, RemoteTimeout, ProbeFailed,
    Unreachable."""
    need, left = opts.budget_s(opts.repeat + 1) + reserve, ctx.remaining()
    if left < need:
        raise HostFailed(f"the load gate needs about {need:.0f} s ({opts.repeat + 1} runs of up to {opts.timeout_s:.0f} s "
                         f"and {reserve:.0f} s kept for a rollback); the host deadline leaves {left:.0f} s: raise "
                         "--timeout or lower --load-timeout; nothing changed")
    runs = []
    for _ in range(opts.repeat):
        res = run_load(ctx, targets, facts, opts, health_timeout, reserve=reserve + opts.budget_s(1))
        bad = load_problems(res)
        if bad:
            raise HostFailed("baseline under load failed: not changing this host: " + "; ".join(bad))
        runs.append(res)
    return runs


def load_gate(ctx: HostContext, targets: list[dict], facts: dict, opts: LoadOptions, health_timeout: float,
              baselines: list[dict], reserve: float) -> tuple[dict, list[str]]:
    """The same run as the baselines' after the change's restart handler, and the gate
    (compare_load): (result data["load_gate"]: {status, checks, message, profile, repeat,
    tolerances, servers: the report's rows (baseline and after side by side)}, [the problem
    "load gate failed: ..."] or []). Raises RemoteTimeout, ProbeFailed, Unreachable."""
    after = run_load(ctx, targets, facts, opts, health_timeout, reserve=reserve)
    verdict, rows = compare_load(baselines, after, opts)
    data = {**verdict.to_dict(), "profile": opts.profile, "repeat": opts.repeat, "tolerances": tolerances(opts),
            "servers": rows, "runs": {"baselines": baselines, "after": after}}
    return data, ([f"load gate failed: {verdict.message}"] if verdict.failed else [])
