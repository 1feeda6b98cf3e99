"""The smoke gate: a host's smoke decode after a change against its baseline.

The smoke probe's results (probes/traffic/smoke.py, run by validate.smoke) are {"servers":
[per-server result], "refused": [servers nothing was sent to], "offline": result or None}, and
"rank0" (validate.rank0_smoke) where the host's non-zero-rank nodes are decoded on rank 0's host.
The gate passes when, for every server, the greedy `output_ids` are identical and the median
latency is within `latency_tolerance` x baseline (+ slack), the offline check (if any) exits 0,
and each non-zero-rank node answers /health (its decode is rank 0's, compared likewise).
`compare` is the pure comparison of two results; `gate` adds the non-zero-rank nodes and the
options; `SmokeGate` is the change engine's gate (engine/gates/__init__.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...inventory import Host
from ...errors import HostFailed
from ..context import HostContext
from ..validate import (RANK0_ABSENT, Rank0, SmokeOptions, rank0_label, rank0_smoke, refusal, smoke,
                        smoke_problems)
from . import NO_SERVER, SMOKE, Check, Gate, GateResult, GateRun, verdict
from ...vocab import GateStatus


def _latency(b: dict, a: dict) -> tuple[str, float, float]:
    """The latency pair to compare: server-side median e2e_latency when both sides have it
    (SGLang meta_info.e2e_latency, seconds), else the client-side median."""
    if b.get("e2e_latency_s") is not None and a.get("e2e_latency_s") is not None:
        return "e2e_latency", b["e2e_latency_s"], a["e2e_latency_s"]
    return "client latency", b["latency_s"], a["latency_s"]


def _server_checks(target: str, b: dict | None, a: dict | None, tolerance: float,
                   slack_s: float, allow_drift: bool, refused: list[dict]) -> list[Check]:
    if b is None or a is None:
        why = "; ".join(refusal(r) for r in refused if r["port"] == (b or a)["port"])
        return [Check("server", target, False, ("not in the baseline" if b is None else "missing after the change")
                      + (" (refused: %s)" % why if why else ""))]
    if not b.get("ok"):
        return [Check("baseline", target, False, "baseline decode failed: %s" % b.get("error"))]
    if not a.get("ok"):
        return [Check("decode", target, False, a.get("error") or "decode failed")]
    checks = []
    bi, ai = b["output_ids"], a["output_ids"]
    if bi == ai:
        checks.append(Check("tokens", target, True, "%d greedy tokens identical" % len(ai)))
    else:
        said = "token drift allowed" if allow_drift else "output_ids differ"
        checks.append(Check("tokens", target, allow_drift, "%s: baseline %s vs after %s" % (said, bi, ai)))
    what, bl, al = _latency(b, a)
    ok = al <= bl * tolerance + slack_s
    checks.append(Check("latency", target, ok, "median %s %.4f s vs baseline %.4f s (%.2fx, %s %.2fx%s)" % (
        what, al, bl, al / bl if bl else float("inf"), "within" if ok else "over",
        tolerance, " + %.3f s" % slack_s if slack_s else "")))
    return checks


def compare(baseline: dict, after: dict, latency_tolerance: float = 1.25,
            allow_token_drift: bool = False, latency_slack_s: float = 0.0) -> GateResult:
    """Gate one host: baseline and after are smoke probe results for the same host.

    latency_tolerance: allowed ratio after/baseline of the median latency (seconds);
    latency_slack_s: extra absolute seconds allowed on top (0 by default; useful where a
    decode takes milliseconds and scheduling noise is of the same size, as in the lab);
    allow_token_drift: differing output_ids pass, noted as "token drift allowed".
    Servers are paired by (host, port); a server missing on one side is named with the other
    side's refusals of its port. Returns a GateResult whose message names each failed check with
    both token lists or both latencies; skipped (NO_SERVER) when neither side has a server or
    an offline check. Raises KeyError on malformed results.
    """
    bs = {(s["host"], s["port"]): s for s in baseline.get("servers") or []}
    as_ = {(s["host"], s["port"]): s for s in after.get("servers") or []}
    offline = after.get("offline")
    if not bs and not as_ and offline is None and baseline.get("offline") is None:
        return GateResult(GateStatus.SKIPPED, message="validation: skipped (no server and no offline check)",
                          reason=NO_SERVER)
    checks = []
    for key in list(bs) + [k for k in as_ if k not in bs]:
        checks += _server_checks("%s:%s" % key, bs.get(key), as_.get(key), latency_tolerance, latency_slack_s,
                                 allow_token_drift, (after if key in bs else baseline).get("refused") or [])
    if offline is not None:
        checks.append(Check("offline", "offline", bool(offline.get("ok")), "%s: %s; last lines: %s" % (
            offline.get("cmd"), "timed out after %.0f s" % offline["duration_s"] if offline.get("timed_out")
            else "exit %s" % offline.get("returncode"), " | ".join(offline.get("tail") or []))))
    elif baseline.get("offline") is not None:
        checks.append(Check("offline", "offline", False, "offline check missing after the change"))
    drift = allow_token_drift and any(c.name == "tokens" and c.detail.startswith("token drift")
                                      for c in checks)
    return verdict(checks, drift)


# ---- multi-node servers: a non-zero-rank node's gate -----------------------------------------

def _where(baseline: dict, port: int) -> str:
    """How a non-zero-rank node on `port` is gated: the rank 0 entry standing for it, or RANK0_ABSENT."""
    e = next((e for e in baseline.get("rank0") or [] if port in e.get("ports", [])), None)
    return f"decoded through {rank0_label(e)}" if e else RANK0_ABSENT


def gate_note(baseline: dict | None) -> str | None:
    """How the non-zero-rank nodes and PD servers of a smoke baseline are gated, for the report:
    "decoded through rank 0 on HOST (ADDR)" or RANK0_ABSENT, a PD server's via (probes/traffic/
    smoke.py pd_plan: "decoded through the PD router on :PORT", "decode worker: health_generate
    only"), each once ("; "); None when it has none."""
    notes = [(s.get("pd") or {}).get("via") or _where(baseline, s["port"])
             for s in (baseline or {}).get("servers") or [] if s.get("health_only") or s.get("pd")]
    return "; ".join(dict.fromkeys(notes)) or None


def _health_checks(baseline: dict, after: dict) -> list[Check]:
    """The gate's checks of the non-zero-rank nodes and PD workers (health-only results), paired by host:port."""
    def only(res):
        return {(s["host"], s["port"]): s for s in res.get("servers") or [] if s.get("health_only")}
    bs, as_ = only(baseline), only(after)
    checks = []
    for key in list(bs) + [k for k in as_ if k not in bs]:
        target, b, a = "%s:%s" % key, bs.get(key), as_.get(key)
        rank = (a or b).get("node_rank")
        part = (a or b).get("pd")
        what = part["via"] if part else f"node rank {rank}"
        if b is None or a is None:
            checks.append(Check("server", target, False, "not in the baseline" if b is None else "missing after the change"))
        elif not b.get("ok"):
            checks.append(Check("baseline", target, False, f"{what}: baseline health failed: {b.get('error')}"))
        elif not a.get("ok"):
            checks.append(Check("health", target, False, f"{what}: {a.get('error')}"))
        else:
            checks.append(Check("health", target, True, f"{what}: {'/health_generate' if part else '/health'} answered 200"
                                + ("" if part else f" ({_where(baseline, key[1])})")))
    return checks


def _decoded(res: dict) -> dict:
    """A smoke result without its non-zero-rank nodes: what compare pairs and compares."""
    return {**res, "servers": [s for s in res.get("servers") or [] if not s.get("health_only")]}


def gate(host: Host, baseline: dict, after: dict, opts: SmokeOptions) -> GateResult:
    """The smoke gate (compare) with these options; the latency slack (seconds) is
    --latency-slack, else the host's `fleetctl_latency_slack` var, else 0. A non-zero-rank node
    (a health-only result) passes when its /health answered 200 after the change; each rank 0
    decoded for one (the smoke results' "rank0": validate.rank0_smoke) is gated as compare
    gates a server, its checks named "HOST TARGET (rank 0)", and one that could not be
    smoke-tested after the change fails."""
    slack = opts.latency_slack_s
    if slack is None:
        slack = host.latency_slack

    def judge(b, a):
        return compare(_decoded(b), _decoded(a), latency_tolerance=opts.latency_tolerance,
                       allow_token_drift=opts.allow_token_drift, latency_slack_s=slack)

    result = judge(baseline, after)
    extra, drift = _health_checks(baseline, after), result.token_drift
    later = {(e["host"], e["deployment"]): e for e in after.get("rank0") or []}
    for b in baseline.get("rank0") or []:
        a, label = later.get((b["host"], b["deployment"])), rank0_label(b)
        if a is None or a.get("error"):
            extra.append(Check("rank0", label, False, "could not be smoke-tested after the change: "
                                                      + (a["error"] if a else "not run")))
            continue
        v = judge(b, a)
        drift = drift or v.token_drift
        extra += [Check(c.name, f"{b['host']} {c.target} (rank 0)", c.passed, c.detail) for c in v.checks]
    if not extra:
        return result
    return verdict(result.checks + extra, drift)


# ---- the change engine's gate -----------------------------------------------------------------

@dataclass(frozen=True)
class SmokeGate(Gate):
    """The smoke gate of a change (engine/gates Gate). offline: an offline smoke command (None:
    the host's fleetctl_smoke_cmd); rank0: where the host's non-zero-rank nodes are decoded
    (validate.Rank0: rank 0 on another host of the run; none: their gate is their /health
    alone, validate.RANK0_ABSENT). Its result data: GateResult.to_dict(), with "gate"
    (gate_note) when the host has non-zero-rank nodes."""

    offline: str | None = None
    rank0: list[Rank0] = field(default_factory=list)
    name = SMOKE

    def _with_rank0(self, ctx: HostContext, res: dict, run: GateRun) -> dict:
        """Smoke result `res` with rank0's decodes added as "rank0" (validate.rank0_smoke, each
        leaving run.reserve seconds of the host's deadline)."""
        if self.rank0:
            res["rank0"] = [rank0_smoke(ctx, r0, run.smoke, reserve=run.reserve) for r0 in self.rank0]
        return res

    def baseline(self, ctx: HostContext, run: GateRun, taken: dict) -> dict | None:
        """The smoke decode before the change (with rank 0's where rank0 names it); None when
        there is no server and no offline check. Raises HostFailed ("baseline smoke failed: not
        changing this host: <why>") when a server, the offline check or rank 0 already fails
        (a 401 from an --api-key server, a server that is down): a change could only fail its
        gate and cost two restarts."""
        res = self._with_rank0(ctx, smoke(ctx, run.facts, run.smoke, self.offline, reserve=run.reserve), run)
        bad = smoke_problems(res)
        if bad:
            raise HostFailed("baseline smoke failed: not changing this host: " + "; ".join(bad))
        return res if res["servers"] or res["offline"] is not None else None

    def judge(self, ctx: HostContext, run: GateRun, baseline: dict) -> tuple[dict, list[str]]:
        """The same decode after the change (its servers only when the baseline has some), and gate."""
        after = smoke(ctx, run.facts, run.smoke, self.offline, reserve=run.reserve, servers=bool(baseline["servers"]))
        if baseline.get("rank0") is not None:
            after = self._with_rank0(ctx, after, run)
        result = gate(ctx.host, baseline, after, run.smoke)
        data = result.to_dict()
        note = gate_note(baseline)
        if note:  # how the non-zero-rank nodes were gated (through rank 0, or /health alone)
            data["gate"] = note
        return data, ([f"validation failed: {result.message}"] if result.failed else [])

    def unrestarted(self, baseline: dict) -> dict | None:
        """The offline check alone when the baseline decoded servers (None without one); the
        whole baseline when it did not (an offline check needs no restart)."""
        if not baseline["servers"]:
            return baseline
        return {"servers": [], "offline": baseline["offline"]} if baseline["offline"] is not None else None
