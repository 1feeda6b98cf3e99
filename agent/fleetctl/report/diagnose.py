"""Terminal tables of `fleetctl diagnose`: one row per server (its verdict, the figures behind
it, the action), then the fleet roll-up (engine/diagnose.groups: servers grouped by verdict,
each group's mean device-time shares)."""

from __future__ import annotations

from rich.console import Console

from ..engine.context import HostResult
from ..engine.diagnose import groups
from ..probes.diagnose import kernels
from .text import grid, server_rows, text, tolerant

SHOWN = (kernels.VERIFY, kernels.EXTEND, kernels.DECODE, kernels.MOE_EXPERTS, kernels.MOE_ROUTING, kernels.GEMM,
         kernels.COMM, kernels.SAMPLING, kernels.OTHER, kernels.UNKNOWN)


def shares_line(shares: dict, host_wait: float | None, wait_label: str = "host wait") -> str:
    """"decode_attention 40% · moe_experts 30% · ... · host wait 12%": the classes over 0.5%."""
    parts = [f"{c} {100 * shares[c]:.0f}%" for c in SHOWN if (shares.get(c) or 0) >= 0.005]
    if host_wait is not None:
        parts.append(f"{wait_label} {100 * host_wait:.0f}%")
    return " · ".join(parts)


def render_diagnose(results: list[HostResult], console: Console) -> None:
    """Per server: host, status, server, verdict, why (the figures), action, device-time shares
    (and what the trace's device work was: GPU kernels or the stand-in's annotated regions),
    MoE's worst layer and GPU, KV token usage, accept length; then the roll-up."""
    def cells(s: dict) -> list:
        v = s.get("verdict") or {}
        tr = s.get("trace") or {}
        info = s.get("server_info") or {}
        extra = [f"from {tr.get('source')} events ({tr.get('events')}, table {tr.get('table')})"
                 if tr else "", f"KV token usage {info['token_usage']:.2f}"
                 if isinstance(info.get("token_usage"), (int, float)) else
                 f"KV load {info['kv_load']:.2f}" if isinstance(info.get("kv_load"), (int, float)) else "",
                 f"accept length {info['avg_spec_accept_length']:.2f}"
                 if isinstance(info.get("avg_spec_accept_length"), (int, float)) else ""]
        return [f":{s.get('port')}", str(v.get("verdict") or ""),
                "; ".join(x for x in (v.get("why"), s.get("error")) if x), v.get("action") or "",
                "; ".join(x for x in [shares_line(tr.get("shares") or {}, tr.get("host_wait_share"),
                                                  "host wait" if tr.get("source") == "kernel" else "gaps")
                                      if tr else ""] + extra if x)]

    rows = [row for r in results for row in server_rows(r, cells, 5, 2)]
    grid("fleetctl diagnose", ["host", "status", "server", "verdict", "why", "action", "device time"], rows, console)
    docs = [{"host": r.host, "servers": (r.data or {}).get("servers") or []} for r in results]
    rolled = tolerant(lambda: groups(docs), 1)
    if rolled and isinstance(rolled[0], dict):
        grid("fleet roll-up", ["verdict", "servers", "action", "mean device time"],
             [[text(g["verdict"]), text(", ".join(g["servers"])), text(g["action"] or ""),
               text(shares_line(g["shares"], g["host_wait_share"]))] for g in rolled], console)
