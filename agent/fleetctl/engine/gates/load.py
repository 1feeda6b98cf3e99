"""The load gate: SGLang's own benchmark client before and after a change, the change's figures
against the baseline's.

The run is engine/load.run_load's (the load probe, probes/traffic/load.py), against the smoke
decode's targets; this module is the gate over its results:

    LoadGate                       the change engine's gate (engine/gates): load_baselines right
                                   before the change, load_gate after its restart
    compare_load(baselines, after) breach when a request failed, output throughput fell below
                                   (1 - drop) x baseline, p99 ITL rose over (1 + rise) x baseline
                                   + slack, or p99 TTFT likewise; with two baselines (repeat 2) each
                                   tolerance is widened to twice the baselines' measured spread

Every figure keeps SGLang's own result name (output_throughput in tokens/s, p99_itl_ms and
p99_ttft_ms in ms: sglang/benchmark/serving.py:1855-1907 in 0.5.23, the same keys in 0.4.6,
0.5.2 and 0.5.10).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import HostFailed
from ...vocab import GateStatus
from ..context import HostContext
from ..load import LoadOptions, run_load
from ..validate import load_problems
from . import Check, Gate, GateResult, GateRun, NO_SERVER, decoded, verdict

# The gated metrics: (SGLang's result key, the tolerance field, its slack field or None, higher is better).
GATED = (("output_throughput", "max_throughput_drop", None, True),
         ("p99_itl_ms", "max_itl_rise", "itl_slack_ms", False),
         ("p99_ttft_ms", "max_ttft_rise", "ttft_slack_ms", False))
# What the report shows side by side (SGLang's names), the gated ones first.
SHOWN = ("completed", "failed", "output_throughput", "request_throughput", "p99_itl_ms", "p99_ttft_ms",
         "median_ttft_ms", "median_itl_ms", "p99_e2e_latency_ms", "accept_length")


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
        return GateResult(GateStatus.SKIPPED, message="load: skipped (no server)", reason=NO_SERVER), []
    checks, rows = [], []
    for key in keys:
        c, row = _server_gate("%s:%s" % key, [k.get(key) for k in keyed], as_.get(key), opts)
        checks += c
        rows.append(row)
    return verdict(checks), rows


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
    result, rows = compare_load(baselines, after, opts)
    data = {**result.to_dict(), "profile": opts.profile, "repeat": opts.repeat, "tolerances": tolerances(opts),
            "servers": rows, "runs": {"baselines": baselines, "after": after}}
    return data, ([f"load gate failed: {result.message}"] if result.failed else [])


@dataclass(frozen=True)
class LoadGate(Gate):
    """The load gate of a change (engine/gates Gate) with these settings and tolerances; armed
    where the smoke gate's baseline decoded a server. Its result data: load_gate's."""

    options: LoadOptions
    name = "load_gate"

    def baseline(self, ctx: HostContext, run: GateRun, taken: dict) -> list[dict] | None:
        if not decoded(taken):
            return None
        return load_baselines(ctx, run.targets, run.facts, self.options, run.smoke.health_timeout, reserve=run.reserve)

    def judge(self, ctx: HostContext, run: GateRun, baseline: list[dict]) -> tuple[dict, list[str]]:
        return load_gate(ctx, run.targets, run.facts, self.options, run.smoke.health_timeout, baseline,
                         reserve=run.reserve)
