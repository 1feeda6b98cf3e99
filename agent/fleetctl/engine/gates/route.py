"""The route gate: proof that the routed kernel, the build just activated, serves every rank and
changes no token.

The route check probe (probes/traffic/routecheck.py) runs on the host right before a change (the
baseline) and again after its restart handler and the gates before it; this module is the control side:

    RouteOptions                   the gate's settings (its tolerances)
    RouteGate                      the change engine's gate (engine/gates): the kernel package and
                                   build key the evidence must show, and the settings
    run_route                      the probe's run against the smoke decode's targets
    route_problems                 what makes a baseline unusable (it refuses the host: nothing changed)
    route_baseline / route_gate    the two calls RouteGate makes
    compare_route(baseline, after) the checks, pure functions over two probe answers:

- ranks: expected = tp_size x pp_size x (1 with enable_dp_attention, else dp_size) / nnodes of the
  after run's /server_info (SGLang runs one scheduler process per TP x PP rank and DP replica on
  each node: entrypoints/engine.py `_launch_subprocesses`, managers/data_parallel_controller.py);
  that many processes of the server's tree need fresh evidence (the record of that very process)
  of the expected build (its "build": PUBLIC/PACKAGE/KEY, the directory the hook loaded) that
  routed during the check: eager_routed grew between the probe's two reads, or a CUDA-graph
  captured entry of batch >= 1 for the server's draft width (speculative_num_draft_tokens); a
  failure names each pid with its state (or the build it serves instead) and its fallbacks' reasons.
- tokens: each prompt's greedy output_ids equal to the baseline's; at the first divergence, when
  the baseline's top-2 logprobs there are within `near_tie` of each other, it is reported (passed)
  and that prompt's later positions are not compared (they follow another token).
- logprobs: |after - baseline| <= `logprob_tolerance` for every output token up to the first divergence.
- long prompt: the long prompt ran and made >= long_tokens prompt tokens.
- accept length: sum(completion_tokens) / sum(spec_verify_ct) over all prompts within
  `accept_tolerance` (relative) of the baseline's; a server that does not speculate says so.

Checks and the result are engine/gates' Check and GateResult (name, target "host:port", passed, detail).
"""

from __future__ import annotations

import posixpath
from dataclasses import asdict, dataclass

from ...config import PUBLIC_KERNELS_DIR, REQUEST_TIMEOUT_S
from ...connection import RemoteTimeout
from ...errors import HostFailed
from ...probes.traffic import routecheck
from ...vocab import GateStatus
from ..context import HostContext
from ..validate import refusal
from . import NO_SERVER, Check, Gate, GateResult, GateRun, decoded, verdict

# Seconds one route check needs beyond its health wait (connect, bundle, four decodes, the flush wait).
ROUTE_SLACK_S = 30.0
# The least health wait worth starting a check with.
MIN_HEALTH_S = 5.0
EPS = 1e-9  # limits are inclusive: a difference of exactly the tolerance, as floats compute it, passes
CHECKS = ("ranks", "tokens", "logprobs", "long prompt", "accept length")


@dataclass(frozen=True)
class RouteOptions:
    """The route gate's settings. max_new_tokens: greedy tokens per prompt; long_tokens: the long
    prompt's least prompt tokens; logprob_tolerance: |after - baseline| allowed per output token
    (nats); near_tie: baseline top-2 logprobs this close make a divergence a near tie (reported,
    not failed); accept_tolerance: relative change of the accept length allowed; health_timeout:
    seconds a server gets to answer /health (at most the smoke options' wait)."""

    max_new_tokens: int = routecheck.MAX_NEW_TOKENS
    long_tokens: int = routecheck.LONG_TOKENS
    logprob_tolerance: float = 0.02
    near_tie: float = 0.02
    accept_tolerance: float = 0.05
    health_timeout: float = 120.0


def evidence_dir() -> str:
    """PUBLIC/route-evidence: where the hook writes each process's record (its module docstring: PUBLIC/route-evidence/<euid>/<pid>.json)."""
    return posixpath.join(PUBLIC_KERNELS_DIR, routecheck.EVIDENCE_SUBDIR)


def run_route(ctx: HostContext, targets: list[dict], facts: dict, opts: RouteOptions, health_timeout: float,
              reserve: float = 0.0) -> dict:
    """Run the route check probe on the host against the smoke decode's `targets`
    (validate.smoke_targets of the servers in `facts`) and the inventory's fleetctl_sglang_port /
    _host: {"servers": [probes/routecheck.route_server], "refused": [...], "evidence_dir"}. Health
    waits up to min(health_timeout, opts.health_timeout) seconds, cut to what the host's deadline
    leaves after `reserve` seconds. Raises RemoteTimeout (no time left), ProbeFailed, Unreachable."""
    port = ctx.host.sglang_port
    if not targets and port is None:
        return {"servers": [], "refused": [], "evidence_dir": evidence_dir()}
    budget = ctx.remaining() - reserve
    health = min(health_timeout, opts.health_timeout, budget - ROUTE_SLACK_S * max(1, len(targets)))
    if health < MIN_HEALTH_S:
        raise RemoteTimeout(f"no time left for the route check ({budget:.0f} s before the host deadline)")
    params = {"servers": targets, "port": port, "host": ctx.host.sglang_host if port is not None else None,
              "api_key": ctx.host.sglang_api_key, "server_user": ctx.host.server_user,
              "evidence_dir": evidence_dir(), "health_timeout": health,
              "request_timeout": REQUEST_TIMEOUT_S, "max_new_tokens": opts.max_new_tokens,
              "long_tokens": opts.long_tokens}
    return ctx.probe("traffic.routecheck", params, timeout=budget)  # stdlib: the host's interpreter (validate.smoke)


def route_problems(res: dict, opts: RouteOptions | None = None) -> list[str]:
    """What makes a route check answer (run_route) unusable as a baseline: ["route HOST:PORT: why"]
    per server that was not healthy, gave no /server_info, failed a prompt or could not run the
    long prompt (`opts.long_tokens`), or, when no server was checked and some were refused, ["no
    server to route-check (nothing sent): <each refusal>"]."""
    long_tokens = (opts or RouteOptions()).long_tokens
    bad = []
    for s in res.get("servers") or []:
        where = f"route {s.get('host')}:{s.get('port')}"
        if not s.get("ok"):
            bad.append(f"{where}: {s.get('error') or 'failed'}")
            continue
        long = next((p for p in s.get("prompts") or [] if p.get("name") == routecheck.LONG), None)
        if long is None or (long.get("prompt_tokens") or 0) < long_tokens:
            bad.append(f"{where}: the long prompt did not make {long_tokens} tokens")
    if not res.get("servers") and res.get("refused"):
        bad.append("no server to route-check (nothing sent): " + "; ".join(map(refusal, res["refused"])))
    return bad


def route_baseline(ctx: HostContext, targets: list[dict], facts: dict, opts: RouteOptions, health_timeout: float,
                   reserve: float) -> dict:
    """The route gate's baseline, right before a change (run_route). Raises HostFailed ("baseline
    route check failed: not changing this host: ...") when it fails (route_problems): a change could
    only fail its gate. Raises RemoteTimeout, ProbeFailed, Unreachable."""
    res = run_route(ctx, targets, facts, opts, health_timeout, reserve=reserve)
    bad = route_problems(res, opts)
    if bad:
        raise HostFailed("baseline route check failed: not changing this host: " + "; ".join(bad))
    return res


def route_gate(ctx: HostContext, targets: list[dict], facts: dict, opts: RouteOptions, health_timeout: float,
               baseline: dict, reserve: float, build: str | None) -> tuple[dict, list[str]]:
    """The same check as the baseline's after the change's restart handler and smoke gate, and the
    gate (compare_route, for `build`): (result data["route_gate"]: {status, checks, message,
    token_drift, options, runs: {baseline, after}}, [the problem "route gate failed: ..."] or
    []). Raises RemoteTimeout, ProbeFailed, Unreachable."""
    after = run_route(ctx, targets, facts, opts, health_timeout, reserve=reserve)
    result = compare_route(baseline, after, opts, build=build)
    data = {**result.to_dict(), "options": asdict(opts),
            "runs": {"baseline": baseline, "after": after}}
    return data, ([f"route gate failed: {result.message}"] if result.failed else [])


@dataclass(frozen=True)
class RouteGate(Gate):
    """The route gate of a change (engine/gates Gate): the evidence must show kernel package
    `package`'s build `key` routed (deploy: the package and the key it just activated; the
    route-verify-attention playbook's route step: the hook's package and the key its `current`
    named when the change was planned; None where none was active: the gate fails), with these
    settings; armed where the smoke gate's baseline decoded a server. Its result data: route_gate's."""

    package: str
    key: str | None
    options: RouteOptions = RouteOptions()
    name = "route_gate"

    @property
    def build(self) -> str | None:
        """PUBLIC/PACKAGE/KEY: the build directory the hook names in its evidence (its "build");
        None without a key."""
        return posixpath.join(PUBLIC_KERNELS_DIR, self.package, self.key) if self.key else None

    def baseline(self, ctx: HostContext, run: GateRun, taken: dict) -> dict | None:
        if not decoded(taken):
            return None
        return route_baseline(ctx, run.targets, run.facts, self.options, run.smoke.health_timeout, reserve=run.reserve)

    def judge(self, ctx: HostContext, run: GateRun, baseline: dict) -> tuple[dict, list[str]]:
        return route_gate(ctx, run.targets, run.facts, self.options, run.smoke.health_timeout, baseline,
                          reserve=run.reserve, build=self.build)


# ---- the checks (pure) ---------------------------------------------------------------------

def expected_ranks(info: dict) -> int | None:
    """tp_size x pp_size x (1 with enable_dp_attention, else dp_size) / nnodes of a /server_info
    answer (routecheck.server_info: absent keys None, taken as 1 and False); None when that is not
    a whole number of at least 1 (a layout SGLang refuses)."""
    def size(k):
        v = info.get(k)
        return 1 if v is None else v
    total = size("tp_size") * size("pp_size") * (1 if info.get("enable_dp_attention") else size("dp_size"))
    nnodes = size("nnodes")
    if nnodes < 1 or total < 1 or total % nnodes:
        return None
    return total // nnodes


def _routed(entry: dict, before: dict | None, draft_tokens: int | None) -> str | None:
    """How a fresh evidence entry routed during the check ("eager_routed A -> B", "captured batch
    N for draft width T"), None when it did not. `before`: the same process's entry read before
    the prompts (a missing or other process's record counts as 0 routed calls)."""
    rec = entry["record"]
    was = 0
    if before and before.get("state") == "fresh" and before["record"]["start_time"] == rec["start_time"]:
        was = before["record"]["eager_routed"]
    if rec["eager_routed"] > was:
        return f"eager_routed {was} -> {rec['eager_routed']}"
    for c in rec["captured"]:
        if c["batch"] >= 1 and (draft_tokens is None or c["draft_tokens"] == draft_tokens):
            return f"captured batch {c['batch']} for draft width {c['draft_tokens']}"
    return None


def _fallbacks(rec: dict | None) -> str:
    if not rec or not rec.get("fallbacks"):
        return "no fallbacks"
    return "fallbacks " + ", ".join(f"{k!r} x{v}" for k, v in sorted(rec["fallbacks"].items()))


def ranks_check(target: str, after: dict, build: str | None) -> Check:
    """Every expected rank (expected_ranks) routed `build` (PUBLIC/PACKAGE/KEY) during the check
    (module docstring); a process whose evidence names another build counts for nothing, and
    without a build (None: none was active) the check fails."""
    if build is None:
        return Check("ranks", target, False, "no build of the routed kernel was active when the change was planned: "
                                             "nothing it routes can be checked")
    info = after.get("server_info") or {}
    want = expected_ranks(info)
    if want is None:
        return Check("ranks", target, False, f"no rank count from /server_info {info}")
    before = {e["pid"]: e for e in (after.get("evidence") or {}).get("before") or []}
    draft = info.get("speculative_num_draft_tokens")
    routed, other = [], []
    for e in (after.get("evidence") or {}).get("after") or []:
        fresh = e.get("state") == "fresh"
        how = _routed(e, before.get(e["pid"]), draft) if fresh else None
        if fresh and e["record"].get("build") != build:
            other.append(f"pid {e['pid']} serves build {e['record'].get('build')}, not {build} "
                         f"({how or _fallbacks(e['record'])})")
        elif how:
            routed.append(f"pid {e['pid']} {how}")
        elif fresh:
            other.append(f"pid {e['pid']} did not route during the check (eager_routed "
                         f"{e['record']['eager_routed']}, {len(e['record']['captured'])} captured shapes; "
                         f"{_fallbacks(e['record'])})")
        else:
            other.append(f"pid {e['pid']} {e.get('state')}: {e.get('why')}"
                         + (f" ({_fallbacks(e['record'])})" if e.get("record") else ""))
    layout = (f"tp {info.get('tp_size')} x pp {info.get('pp_size')} x "
              f"{'1 (dp attention)' if info.get('enable_dp_attention') else 'dp %s' % info.get('dp_size')}"
              f" / nnodes {info.get('nnodes')}")
    ok = len(routed) >= want
    detail = f"{len(routed)} of {want} expected ranks ({layout}) routed during the check"
    if not info.get("speculative_algorithm"):
        detail += "; the server does not speculate (speculative_algorithm none): nothing verifies"
    parts = routed + ([] if ok and not other else other)
    return Check("ranks", target, ok, detail + (": " + "; ".join(parts) if parts else ""))


def _prompts(res: dict) -> dict:
    return {p["name"]: p for p in res.get("prompts") or []}


def _first_divergence(b: list, a: list) -> int | None:
    for i, (x, y) in enumerate(zip(b, a)):
        if x != y:
            return i
    return None if len(b) == len(a) else min(len(b), len(a))


def _top2_gap(p: dict, i: int) -> float | None:
    """|top-1 - top-2| of prompt answer `p`'s top logprobs at output position `i`, None when unknown."""
    tops = p.get("top2") or []
    if i >= len(tops) or len(tops[i]) < 2 or any(t[0] is None for t in tops[i][:2]):
        return None
    return abs(tops[i][0][0] - tops[i][1][0])


def divergence(b: dict, a: dict, near_tie: float) -> tuple[int | None, bool, str]:
    """(first position where prompt answers `b` (baseline) and `a` differ, or None; whether it is
    a near tie (the baseline's top-2 logprobs there within `near_tie`); text for the check)."""
    bi, ai = b.get("output_ids") or [], a.get("output_ids") or []
    i = _first_divergence(bi, ai)
    if i is None:
        return None, False, ""
    gap = _top2_gap(b, i)
    tie = gap is not None and gap <= near_tie + EPS
    bt = bi[i] if i < len(bi) else "end"
    at = ai[i] if i < len(ai) else "end"
    why = (f"the baseline's top-2 logprobs there are {gap:.4f} apart" if gap is not None
           else "the baseline has no top-2 logprobs there")
    return i, tie, f"position {i}: baseline token {bt} vs after {at} ({why})"


def token_checks(target: str, baseline: dict, after: dict, opts: RouteOptions) -> list[Check]:
    """The tokens and logprobs checks of one server (module docstring), prompts paired by name."""
    bp, ap = _prompts(baseline), _prompts(after)
    tok_bad, tok_notes, lp_bad, worst = [], [], [], (0.0, None)
    compared = 0
    for name, b in bp.items():
        a = ap.get(name)
        if a is None or a.get("error") or a.get("output_ids") is None:
            tok_bad.append(f"{name}: no answer after the change ({(a or {}).get('error') or 'missing'})")
            continue
        if a.get("chars") != b.get("chars"):
            tok_bad.append(f"{name}: the prompt differs from the baseline's ({b.get('chars')} vs {a.get('chars')} "
                           "characters)")
            continue
        i, tie, why = divergence(b, a, opts.near_tie)
        if i is not None:
            (tok_notes if tie else tok_bad).append(f"{name}: {'near tie' if tie else 'output_ids differ'} at {why}")
        upto = len(b["output_ids"]) if i is None else i
        compared += upto
        bl, al = b.get("logprobs") or [], a.get("logprobs") or []
        for j in range(upto):
            x = bl[j] if j < len(bl) else None
            y = al[j] if j < len(al) else None
            if x is None or y is None:
                lp_bad.append(f"{name} position {j}: no logprob ({'baseline' if x is None else 'after'})")
                break
            d = abs(y - x)
            if d > worst[0]:
                worst = (d, f"{name} position {j}")
            if d > opts.logprob_tolerance + EPS:
                lp_bad.append(f"{name} position {j}: {y:.4f} vs baseline {x:.4f} (|diff| {d:.4f})")
                break
    n = len(bp)
    if tok_bad:
        tokens = Check("tokens", target, False, "; ".join(tok_bad + tok_notes))
    else:
        tokens = Check("tokens", target, True, f"greedy tokens of {n} prompts identical to the baseline"
                       + (" but for near ties, not compared after them: " + "; ".join(tok_notes) if tok_notes else ""))
    if lp_bad:
        logprobs = Check("logprobs", target, False, f"over {opts.logprob_tolerance}: " + "; ".join(lp_bad))
    else:
        # where the largest |diff| is only says something when it shows: a 0.0000 is float noise,
        # whose place changes from run to run
        shown = f"{worst[0]:.4f}"
        logprobs = Check("logprobs", target, True, f"{compared} output logprobs within {opts.logprob_tolerance} of the "
                         f"baseline (largest |diff| {shown}" + (f" at {worst[1]})" if worst[1] and float(shown) else ")"))
    return [tokens, logprobs]


def long_check(target: str, after: dict, opts: RouteOptions) -> Check:
    """The long prompt ran after the change and made at least opts.long_tokens prompt tokens."""
    p = _prompts(after).get(routecheck.LONG)
    if p is None:
        return Check("long prompt", target, False, "not sent")
    got = p.get("prompt_tokens")
    if p.get("error") or got is None or got < opts.long_tokens:
        return Check("long prompt", target, False, p.get("error") or f"{got} prompt tokens, fewer than {opts.long_tokens}")
    return Check("long prompt", target, True, f"{got} prompt tokens ({p.get('chars')} characters), "
                                              f"{len(p.get('output_ids') or [])} greedy tokens")


def accept_length(res: dict) -> tuple[float | None, str]:
    """(sum of completion_tokens / sum of spec_verify_ct over the prompts of route check answer
    `res`, or None when the server does not speculate or verified nothing; text saying which)."""
    info = res.get("server_info") or {}
    ps = res.get("prompts") or []
    done = sum(p.get("completion_tokens") or 0 for p in ps)
    steps = sum(p.get("spec_verify_ct") or 0 for p in ps)
    if not info.get("speculative_algorithm"):
        return None, "does not speculate (speculative_algorithm none)"
    if not steps:
        return None, f"speculates ({info['speculative_algorithm']}) but reported no spec_verify_ct"
    return done / steps, f"{done} tokens / {steps} verify steps = {done / steps:.3f}"


def accept_check(target: str, baseline: dict, after: dict, opts: RouteOptions) -> Check:
    """The accept length within opts.accept_tolerance of the baseline's (module docstring)."""
    bl, bwhy = accept_length(baseline)
    al, awhy = accept_length(after)
    if bl is None:
        return Check("accept length", target, al is None,
                     f"the baseline {bwhy}: no accept length to compare" + ("" if al is None else f"; after: {awhy}"))
    if al is None:
        return Check("accept length", target, False, f"after the change the server {awhy}; baseline {bwhy}")
    ok = abs(al - bl) <= opts.accept_tolerance * bl + EPS
    return Check("accept length", target, ok, f"{al:.3f} vs baseline {bl:.3f} ({al / bl:.3f}x, "
                                              f"{'within' if ok else 'over'} {opts.accept_tolerance:.0%}; after {awhy})")


def server_checks(target: str, b: dict | None, a: dict | None, opts: RouteOptions, refused: list[dict],
                  build: str | None) -> list[Check]:
    """The checks of one server: its baseline entry `b` and after entry `a` (None: missing); the
    ranks must have routed `build`."""
    if b is None or a is None:
        why = "; ".join(refusal(r) for r in refused if r.get("port") == (b or a)["port"])
        return [Check("server", target, False, ("not in the baseline" if b is None else "missing after the change")
                      + (f" (refused: {why})" if why else ""))]
    if not b.get("ok"):
        return [Check("baseline", target, False, f"baseline route check failed: {b.get('error')}")]
    if a.get("server_info") is None:
        return [Check("route run", target, False, a.get("error") or "no /server_info after the change")]
    return [ranks_check(target, a, build), *token_checks(target, b, a, opts), long_check(target, a, opts),
            accept_check(target, b, a, opts)]


def compare_route(baseline: dict, after: dict, opts: RouteOptions | None = None, *,
                  build: str | None) -> GateResult:
    """The route gate for one host: `baseline` and `after` are route check answers (run_route);
    `build`: the build directory the evidence must name (RouteGate.build). Servers are paired by
    (host, port). Returns a GateResult (checks: CHECKS per server, or one "server" / "baseline" /
    "route run" check when a side is missing or failed) whose message names each failed check;
    skipped (NO_SERVER) when neither side has a server. Raises KeyError on malformed answers."""
    opts = opts or RouteOptions()
    bs = {(s["host"], s["port"]): s for s in baseline.get("servers") or []}
    as_ = {(s["host"], s["port"]): s for s in after.get("servers") or []}
    if not bs and not as_:
        return GateResult(GateStatus.SKIPPED, message="route gate: skipped (no server)", reason=NO_SERVER)
    checks = []
    for key in list(bs) + [k for k in as_ if k not in bs]:
        checks += server_checks("%s:%s" % key, bs.get(key), as_.get(key), opts,
                                (after if key in bs else baseline).get("refused") or [], build)
    return verdict(checks)
