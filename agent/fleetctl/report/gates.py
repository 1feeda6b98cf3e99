"""Terminal tables for the validation gates: the smoke decode, load (bench_serving) and route gate.

Each table reads the result keys the engine's gates write (each gate's name: "validation",
"load_gate", "route_gate"; GATES lists them) and shows the baseline beside the change's figure,
so a change is judged by what it is for.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from rich.console import Console

from ..engine.context import HostResult
from .text import STATUS_STYLE, gate_status, grid, server_rows, table, text, tolerant


def render_validate(results: list[HostResult], console: Console) -> None:
    """Smoke decode table: host, server, health wait, tokens, median latency, tokens/s; a row per
    refused target (data["refused"]: a process that claimed a server's port it does not hold,
    which was sent nothing)."""
    def cells(s: dict) -> list:
        lat = s.get("e2e_latency_s") or s.get("latency_s")
        only = ((s.get("pd") or {}).get("via")
                or (f"node rank {s.get('node_rank')}: /health only" if s.get("health_only") else ""))
        return [f":{s.get('port')} {s.get('model_path') or '?'}" + (" (stand-in)" if s.get("stand_in") else ""),
                f"{s['health_wait_s']:.1f}s" if s.get("health_wait_s") is not None else "",
                tokens(s.get("output_ids")),
                f"{lat * 1000:.1f} ms" if lat else "",
                f"{s['tokens_per_s']:.0f}" if s.get("tokens_per_s") else "",
                "; ".join(x for x in (only, s.get("error")) if x)]

    rows = []
    for r in results:
        rows += server_rows(r, cells, 6, 5)
        for f in (r.data or {}).get("refused") or []:  # not smoke-tested, nothing sent (review N6)
            rows.append([text(r.host), text(r.status, style=STATUS_STYLE.get(r.status)),
                         *map(text, tolerant(lambda f=f: [
                             f"refused: pid {f.get('pid')} {f.get('host')}:{f.get('port')}", "", "", "", "",
                             f.get("reason") or ""], 6))])
        off = (r.data or {}).get("offline")
        if off:
            rows.append([text(r.host), text(r.status, style=STATUS_STYLE.get(r.status)),
                         *map(text, tolerant(lambda off=off: [
                             f"offline: {off['cmd']}", "", "", f"{off['duration_s']:.1f}s", "",
                             " | ".join(map(str, off["tail"][-2:]))], 6))])
    grid("fleetctl validate", ["host", "status", "server", "health wait", "tokens", "median latency", "tokens/s",
                               "detail"], rows, console)


def tokens(ids: Any) -> str:
    """The smoke decode's token ids as the validate table shows them: how many, and a short
    fingerprint to compare hosts by (the first 12 hex digits of the sha256 of their list), not
    the raw ids (`--json` has them: output_ids)."""
    if not ids:
        return ""
    digest = hashlib.sha256(json.dumps(list(ids)).encode()).hexdigest()[:12]
    return f"{len(ids)} ({digest})"


def _num(v: Any, unit: str = "") -> str:
    """A figure as shown in the load tables ('' when absent)."""
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return ""
    return f"{v:.0f}{unit}" if isinstance(v, int) or abs(v) >= 100 else f"{v:.2f}{unit}"


def _workload(w: dict | None) -> str:
    if not w:
        return ""
    pool = f"; {w['demand_tokens']} tokens in flight vs pool {w['pool_tokens']}" if w.get("pool_tokens") else ""
    return (f"{w['profile']}: {w['concurrency']} in flight, {w['num_prompts']} requests, "
            f"in<={w['input_len']} out<={w['output_len']} tokens{pool}")


def render_load(results: list[HostResult], console: Console) -> None:
    """`validate --load`: per host and server, SGLang's own benchmark client's figures (SGLang's
    result names: completed of requested, output_throughput, median/p99 TTFT, p99 ITL, p99 E2E
    latency), the client and workload, and why a server's run failed or did not run (and the
    servers sent nothing: refused, or skipped as non-zero-rank nodes); nothing when no host ran one."""
    rows = []
    for r in results:
        load = (r.data or {}).get("load")
        if not load:
            continue
        if load.get("not_run"):
            rows.append([r.host, r.status, "", "", "", "", "", "", "", f"load: not run: {load['not_run']}"])
        for s in load.get("servers") or []:

            def cells(s=s):
                m = s.get("load") or {}
                detail = f"load: not run: {s['not_run']}" if s.get("not_run") else (s.get("error") or "")
                return [f"{s['host']}:{s['port']}", f"{s.get('client') or ''}\n{_workload(s.get('workload'))}",
                        f"{m['completed']} of {m['requested']}" if m else "",
                        _num(m.get("output_throughput")), f"{_num(m.get('median_ttft_ms'))} / {_num(m.get('p99_ttft_ms'))}"
                        if m else "", _num(m.get("p99_itl_ms")), _num(m.get("p99_e2e_latency_ms")), detail]

            rows.append([r.host, r.status, *tolerant(cells, 8)])
        for k in (load.get("skipped") or []) + (load.get("refused") or []):  # nothing was sent to these
            rows.append([r.host, r.status, f"{k.get('host')}:{k.get('port')}", "", "", "", "", "", "",
                         f"{'skipped' if 'node_rank' in k else 'refused'}: {k.get('reason')}"])
    if rows:
        table("load: SGLang's own benchmark client", ["host", "status", "server", "client and workload", "completed",
                                                      "output tok/s", "TTFT p50 / p99 ms", "ITL p99 ms",
                                                      "E2E p99 ms", "detail"], rows, console,
              lambda c, v: STATUS_STYLE.get(v) if c == "status" else None)


def render_load_gate(results: list[HostResult], console: Console) -> None:
    """The load gate of each host that ran one (data["load_gate"]: engine/gates/load.load_gate): per
    server, the baseline taken right before the change and the run after its restart side by
    side (SGLang's result names), the change (after / baseline), each gated metric's limit and
    verdict; then the output throughput ratio per server (a kernel's speedup). A gate that was
    skipped says why in one line."""
    for r in results:
        gate = (r.data or {}).get("load_gate")
        if not gate:
            continue
        if not gate.get("servers"):
            console.print(text(f"{r.host}: load gate {gate_status(gate)}"))
            continue

        def build(r=r, gate=gate):
            from ..engine.gates.load import SHOWN

            verdicts = {(c["target"], c["name"]): c for c in gate.get("checks") or []}
            names = {"output_throughput": "load-throughput", "p99_itl_ms": "load-itl", "p99_ttft_ms": "load-ttft",
                     "failed": "load-errors"}
            rows, speed = [], []
            for row in gate["servers"]:
                base, after, limits = row.get("baseline") or {}, row.get("after") or {}, row.get("limits") or {}
                for key in SHOWN:
                    b, a = base.get(key), after.get(key)
                    if b is None and a is None:
                        continue
                    ratio = f"{a / b:.2f}x" if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else ""
                    check = verdicts.get((row["target"], names.get(key)))
                    verdict = "" if check is None else ("ok" if check["passed"] else "BREACH")
                    rows.append([row["target"], key, _num(b), _num(a), ratio, _num(limits.get(key)), verdict])
                b, a = base.get("output_throughput"), after.get("output_throughput")
                if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b:
                    speed.append(f"{row['target']} {a / b:.2f}x")
            for c in gate.get("checks") or []:
                if not c["passed"] and c["name"] in ("load-baseline", "load-run"):
                    rows.append([c["target"], c["name"], "", "", "", "", c["detail"]])
            return rows, speed

        try:
            rows, speed = build()
        except (KeyError, TypeError, AttributeError, ValueError, IndexError) as e:
            console.print(text(f"{r.host}: malformed load gate data: {type(e).__name__}: {e}", style="red"))
            continue
        twice = " (the mean of 2 baselines; tolerances widened by their spread)" if gate.get("repeat") == 2 else ""
        table(f"{r.host}: load gate {gate.get('status')}, profile {gate.get('profile')}: baseline right before the "
              f"change vs after its restart{twice}", ["server", "metric", "baseline", "after", "after/baseline",
                                                      "limit", "verdict"], rows, console,
              lambda c, v: "red" if v == "BREACH" else ("green" if v == "ok" else None))
        if speed:
            console.print(text(f"{r.host}: output throughput after/baseline (the change's speedup): {', '.join(speed)}"))


def render_route_gate(results: list[HostResult], console: Console) -> None:
    """The route gate of each host that ran one (data["route_gate"]: engine/gates/route.route_gate):
    one row per check (ranks, tokens, logprobs, long prompt, accept length) per server, its verdict
    and detail (both sides' values, the pids and their fallbacks when a rank did not route). A gate
    that did not run (not restarted) says so in one line."""
    for r in results:
        gate = (r.data or {}).get("route_gate")
        if not gate:
            continue
        if not gate.get("checks"):
            console.print(text(f"{r.host}: route gate {gate_status(gate)}"))
            continue
        try:
            rows = [[c["target"], c["name"], "ok" if c["passed"] else "FAILED", c["detail"]] for c in gate["checks"]]
        except (KeyError, TypeError) as e:
            console.print(text(f"{r.host}: malformed route gate data: {type(e).__name__}: {e}", style="red"))
            continue
        table(f"{r.host}: route gate {gate.get('status')}: the routed kernel against the baseline right before the "
              "change", ["server", "check", "verdict", "detail"], rows, console,
              lambda c, v: "red" if v == "FAILED" else ("green" if v == "ok" else None))


# The gates a change passes, in the order they run: each one's result key (the gate's name:
# engine/gates), its label (the HTML report's summary line), and the table it prints after the
# command's own (None: none of its own; the smoke gate's verdict is a column of the apply and
# deploy tables).
GATES = (("validation", "validation", None),
         ("load_gate", "load gate", render_load_gate),
         ("route_gate", "route gate", render_route_gate))


def render_gates(results: list[HostResult], console: Console) -> None:
    """The tables of the gates of a changing command (apply, deploy kernel), in GATES' order."""
    for _, _, render in GATES:
        if render is not None:
            render(results, console)
