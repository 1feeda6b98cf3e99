"""The validation gate: compare a host's smoke decode after a change with its baseline.

Pure logic on the control side. Inputs are results of the smoke probe
(`fleetctl.probes.traffic.smoke.main`): {"servers": [per-server result], "refused": [servers nothing was
sent to], "offline": result or None}.
The gate passes when, for every server, the greedy `output_ids` are identical and the median
latency is within `latency_tolerance` x baseline, and the offline check (if any) exits 0.
A host with no server and no offline check is "skipped (no server)": not passed, not failed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ..vocab import GateStatus


@dataclass
class Check:
    """One gate check. name: baseline | server | decode | tokens | latency | offline;
    target: "host:port" or "offline"; detail: what was compared, with both values."""
    name: str
    target: str
    passed: bool
    detail: str


@dataclass
class GateResult:
    """status: "passed" | "failed" | "skipped (no server)". Roll back only when `failed`."""
    status: GateStatus
    checks: list[Check] = field(default_factory=list)
    message: str = ""
    token_drift: bool = False  # tokens differed and --allow-token-drift let them

    @property
    def passed(self) -> bool:
        return self.status == GateStatus.PASSED

    @property
    def failed(self) -> bool:
        return self.status == GateStatus.FAILED

    @property
    def skipped(self) -> bool:
        return self.status == GateStatus.SKIPPED

    def to_dict(self) -> dict:
        return asdict(self)


def _latency(b: dict, a: dict) -> tuple[str, float, float]:
    """The latency pair to compare: server-side median e2e_latency when both sides have it
    (SGLang meta_info.e2e_latency, seconds), else the client-side median."""
    if b.get("e2e_latency_s") is not None and a.get("e2e_latency_s") is not None:
        return "e2e_latency", b["e2e_latency_s"], a["e2e_latency_s"]
    return "client latency", b["latency_s"], a["latency_s"]


def refusal(r: dict) -> str:
    """One refused server of a smoke result ({pid, host, port, reason}: probes/facts/targets.py) as
    text: "pid N (claims HOST:PORT): reason", or the reason alone for the inventory's choice."""
    if r.get("pid") is None:
        return r["reason"]
    return "pid %s (claims %s:%s): %s" % (r["pid"], r["host"], r["port"], r["reason"])


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
        verdict = "token drift allowed" if allow_drift else "output_ids differ"
        checks.append(Check("tokens", target, allow_drift,
                            "%s: baseline %s vs after %s" % (verdict, bi, ai)))
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
    both token lists or both latencies. Raises KeyError on malformed results.
    """
    bs = {(s["host"], s["port"]): s for s in baseline.get("servers") or []}
    as_ = {(s["host"], s["port"]): s for s in after.get("servers") or []}
    offline = after.get("offline")
    if not bs and not as_ and offline is None and baseline.get("offline") is None:
        return GateResult(GateStatus.SKIPPED, message="validation: skipped (no server and no offline check)")
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
    failed = [c for c in checks if not c.passed]
    drift = allow_token_drift and any(c.name == "tokens" and c.detail.startswith("token drift")
                                      for c in checks)
    shown = failed or checks
    message = "; ".join("%s %s %s: %s" % (c.target, c.name, "passed" if c.passed else "FAILED", c.detail)
                        for c in shown)
    return GateResult(GateStatus.FAILED if failed else GateStatus.PASSED, checks, message, drift)
