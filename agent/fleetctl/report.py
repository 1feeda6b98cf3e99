"""Rendering results: the inspect JSON document and Rich tables, identical hosts coalesced.

Hosts whose findings are identical are gathered into one block with their host list (as clubak
gathers identical output); columns whose values differ between blocks are highlighted.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any, Callable, Iterable

from rich.console import Console
from rich.table import Table
from rich.text import Text

from .fleet import HostResult
from .vocab import PROBLEM_STATUSES, ChangeState, HostStatus

STATUS_STYLE = {HostStatus.OK: "green", HostStatus.CHANGED: "yellow", HostStatus.SKIPPED: "cyan",
                HostStatus.FAILED: "red", HostStatus.UNREACHABLE: "magenta", HostStatus.NOT_ATTEMPTED: "dim"}


def inspect_document(results: list[HostResult]) -> dict:
    """The `inspect --json` document: {"hosts": [{host, address, status, error, elapsed_s, facts,
    installs, allocator_call_sites, need_sort_origins, scan}]}; lists are complete, never
    truncated. `installs`: [{id, python, sglang, torch, servers (pids), allocator_call_sites,
    need_sort_origins, scan}] (README, "installs"); the top-level call sites, origins and scan
    are the primary install's."""
    hosts = []
    for r in results:
        d = r.data or {}
        hosts.append({
            "host": r.host, "address": r.address, "status": r.status, "error": r.error,
            "elapsed_s": r.elapsed_s, "facts": d.get("facts"),
            "installs": [{k: v for k, v in i.items() if k != "sources"} for i in d.get("installs", [])],
            "allocator_call_sites": d.get("allocator_call_sites", []),
            "need_sort_origins": d.get("need_sort_origins", []),
            "scan": d.get("scan"),
        })
    return {"hosts": hosts}


def coalesce(items: Iterable[tuple[str, Any]]) -> list[tuple[list[str], Any]]:
    """Group (host, value) pairs with equal values: [([hosts], value)], first-seen order."""
    groups: dict[str, tuple[list[str], Any]] = {}
    for host, value in items:
        key = json.dumps(value, sort_keys=True, default=str)
        groups.setdefault(key, ([], value))[0].append(host)
    return list(groups.values())


def host_list(hosts: list[str], limit: int = 6) -> str:
    """'a, b, c' or 'a, b, c … (+N more: 12 hosts)'; the count is always given when shortened."""
    if len(hosts) <= limit:
        return ", ".join(hosts)
    return f"{', '.join(hosts[:limit])} … (+{len(hosts) - limit} more; {len(hosts)} hosts)"


def _install_line(i: dict) -> str:
    sg = i["sglang"]
    err = (i.get("scan") or {}).get("error")
    return (f"{sg['version']} {sg['install']} {sg['package_dir'] or sg['location']}"
            + (f" servers {', '.join(map(str, i['servers']))}" if i.get("servers") else "")
            + (f" ERROR {err}" if err else ""))


def _gpus(f: dict) -> str:
    names = ", ".join(sorted(Counter(f"{g['name']} sm_{(g['compute_cap'] or '?').replace('.', '')}"
                                     for g in f.get("gpus", [])).elements()))
    if names and f.get("gpus_reason"):
        return f"{names}; {f['gpus_reason']}"
    return names or f"none ({f.get('gpus_reason')})"


def _summary(data: dict) -> dict:
    f = data.get("facts") or {}
    sg, torch = f.get("sglang"), f.get("torch")
    sites = data.get("allocator_call_sites", [])
    origins = data.get("need_sort_origins", [])
    passing = Counter(s["need_sort"]["passing"] for s in sites)
    computed = [o for o in origins if not o["literal"]]
    return {
        "python": f"{(f.get('python') or {}).get('path')} ({(f.get('python') or {}).get('version')})",
        "sglang": f"{sg['version']} ({sg.get('install')})" if sg else f"none: {f.get('sglang_reason')}",
        "installs": "\n".join(_install_line(i) for i in data.get("installs", [])) or "none",
        "torch": f"{torch['version']} / CUDA {torch['cuda'] or 'none'}" if torch else "none",
        "gpus": _gpus(f),
        "servers": ", ".join(f":{s['port']} {s.get('model_path') or '?'} tp={s['tp_size']}"
                             + (f" dp={s['dp_size']}" if s.get("dp_size", 1) > 1 else "")
                             + (" (stand-in)" if s.get("kind") == "stand-in" else "")
                             for s in f.get("servers", [])) or "none",
        "call sites": f"{len(sites)}" + (" (" + ", ".join(f"{k} {v}" for k, v in sorted(passing.items())) + ")"
                                         if sites else ""),
        "need_sort origins": (f"{len(origins)}: {len(computed)} computed, {len(origins) - len(computed)} literal"
                              if origins else ("none: this release has no need_sort" if sg else "-")),
    }


def render_inspect(results: list[HostResult], console: Console) -> None:
    """Print the inspect report: a summary table (identical hosts coalesced, differing columns
    highlighted), then each distinct set of call sites and origins in full, then failures."""
    good = [r for r in results if r.status == HostStatus.OK]
    groups = coalesce((r.host, _summary(r.data)) for r in good)
    if groups:
        cols = list(groups[0][1].keys())
        differs = {c for c in cols if len({str(g[1][c]) for g in groups}) > 1}
        t = Table(title="fleetctl inspect", show_lines=True)
        t.add_column("hosts", style="bold")
        for c in cols:
            t.add_column(c, style="yellow" if c in differs else None, overflow="fold")
        for hosts, s in groups:
            t.add_row(host_list(hosts), *[str(s[c]) for c in cols])
        console.print(t)
    findings = coalesce((r.host, {"sites": r.data.get("allocator_call_sites", []),
                                  "origins": r.data.get("need_sort_origins", [])}) for r in good)
    for hosts, f in findings:
        if not f["sites"] and not f["origins"]:
            continue
        _render_findings(hosts, f["sites"], f["origins"], console)
    render_problems(results, console)


def _render_findings(hosts: list[str], sites: list[dict], origins: list[dict], console: Console) -> None:
    t = Table(title=f"allocator call sites — {host_list(hosts)}", title_justify="left")
    for c in ("file:line", "callee", "need_sort", "expr"):
        t.add_column(c, overflow="fold")
    for s in sites:
        ns = s["need_sort"]
        callee = s["callee"] + (" (alias)" if s.get("aliased") else "")
        style = {"absent": "dim", "default": "dim"}.get(ns["passing"])
        t.add_row(f"{s['file']}:{s['line']}-{s['end_line']}", callee, Text(ns["passing"], style=style),
                  ns.get("expr") or "")
    console.print(t)
    if not origins:
        console.print(Text("no need_sort origins: this release has no need_sort", style="cyan"))
        return
    t = Table(title=f"need_sort origins — {host_list(hosts)}", title_justify="left")
    for c in ("file:line", "kind", "callee", "expr", "literal"):
        t.add_column(c, overflow="fold")
    for o in origins:
        t.add_row(f"{o['file']}:{o['line']}", o["kind"], o.get("callee") or "",
                  Text(o["expr"], style="dim" if o["literal"] else "bold"), "yes" if o["literal"] else "no")
    console.print(t)


def render_problems(results: list[HostResult], console: Console) -> None:
    """Failed, unreachable and not-attempted hosts, coalesced by identical error."""
    bad = [(r.host, (r.status, r.error or "")) for r in results if r.status in PROBLEM_STATUSES]
    if not bad:
        return
    t = Table(title="problems", title_justify="left", show_lines=True)
    t.add_column("hosts", style="bold")
    t.add_column("status")
    t.add_column("error", overflow="fold")
    for hosts, (status, err) in coalesce(bad):
        t.add_row(host_list(hosts), Text(status, style=STATUS_STYLE.get(status)), err)
    console.print(t)


def render_status_line(results: list[HostResult], console: Console) -> None:
    """One recap line, like Ansible's PLAY RECAP: counts per status."""
    counts = Counter(r.status for r in results)
    parts = [Text(f"{k}={v}", style=STATUS_STYLE.get(k)) for k, v in sorted(counts.items())]
    line = Text("recap: ")
    for p in parts:
        line.append(p)
        line.append(" ")
    console.print(line)


def table(title: str, columns: list[str], rows: list[list[Any]], console: Console,
          style_of: Callable[[str, Any], str | None] | None = None) -> None:
    """Print a simple table (one row per item; cells stringified)."""
    t = Table(title=title, title_justify="left")
    for c in columns:
        t.add_column(c, overflow="fold")
    for row in rows:
        t.add_row(*[Text(str(v), style=style_of(c, v) if style_of else None) for c, v in zip(columns, row)])
    console.print(t)


def render_rollback(results: list[HostResult], console: Console) -> None:
    """Per-host outcome of a rollback: which change, how many files or links were restored."""
    t = Table(title="rollback", title_justify="left")
    for c in ("host", "status", "change", "detail"):
        t.add_column(c, overflow="fold")
    for r in results:
        d = r.data or {}
        if r.error:
            detail = r.error
        elif d.get("nothing"):
            detail = f"nothing to do: {d['nothing']}"
        else:
            forced = f"; forced over {', '.join(d['forced'])}" if d.get("forced") else ""
            detail = f"restored {len(d.get('files', []))} file(s)/link(s) byte-identical{forced}"
        t.add_row(r.host, Text(r.status, style=STATUS_STYLE.get(r.status)), d.get("change_id") or "", detail)
    console.print(t)


def render_validate(results: list[HostResult], console: Console) -> None:
    """Smoke decode table: host, server, health wait, tokens, median latency, tokens/s."""
    t = Table(title="fleetctl validate", title_justify="left")
    for c in ("host", "status", "server", "health wait", "tokens", "median latency", "tokens/s", "detail"):
        t.add_column(c, overflow="fold")
    for r in results:
        servers = (r.data or {}).get("servers") or [None]
        for s in servers:
            if s is None:
                t.add_row(r.host, Text(r.status, style=STATUS_STYLE.get(r.status)), "", "", "", "", "", r.error or "")
                continue
            lat = s.get("e2e_latency_s") or s.get("latency_s")
            t.add_row(r.host, Text(r.status, style=STATUS_STYLE.get(r.status)),
                      f":{s['port']} {s.get('model_path') or '?'}" + (" (stand-in)" if s.get("stand_in") else ""),
                      f"{s['health_wait_s']:.1f}s" if s.get("health_wait_s") is not None else "",
                      " ".join(map(str, s.get("output_ids") or [])),
                      f"{lat * 1000:.1f} ms" if lat else "", f"{s['tokens_per_s']:.0f}" if s.get("tokens_per_s") else "",
                      s.get("error") or "")
        off = (r.data or {}).get("offline")
        if off:
            t.add_row(r.host, Text(r.status, style=STATUS_STYLE.get(r.status)), "offline: " + off["cmd"],
                      "", "", f"{off['duration_s']:.1f}s", "", " | ".join(off["tail"][-2:]))
    console.print(t)


def render_apply(results: list[HostResult], console: Console, diff: bool, check: bool,
                 title: str | None = None) -> None:
    """Per-host outcome of a playbook run; with `diff`, unified diffs coalesced across hosts."""
    if diff:
        diffs = coalesce((r.host, "".join(f["diff"] for f in r.data["plan"]["files"]))
                         for r in results if r.data.get("plan") and r.data["plan"]["files"])
        for hosts, text in diffs:
            console.rule(f"diff — {host_list(hosts)}")
            console.print(Text(text), highlight=False, soft_wrap=True)
    t = Table(title=title or ("check mode: nothing was changed" if check else "apply"), title_justify="left")
    for c in ("hosts", "status", "edits", "left alone", "validation", "detail"):
        t.add_column(c, overflow="fold")
    rows = []
    for r in results:
        plan = r.data.get("plan") or {}
        v = r.data.get("validation") or {}
        val = v.get("status", "") + (" (token drift allowed)" if v.get("token_drift") else "")
        rows.append((r.host, (r.status, len(plan.get("edits", [])), len(plan.get("left_alone", [])),
                              val, r.error or r.data.get("skipped_reason") or "")))
    for hosts, (status, edits, left, val, detail) in coalesce(rows):
        t.add_row(host_list(hosts), Text(status, style=STATUS_STYLE.get(status)), str(edits), str(left), val, detail)
    console.print(t)


def render_status(results: list[HostResult], console: Console) -> None:
    """Applied changes and drift per host."""
    t = Table(title="fleetctl status", title_justify="left", show_lines=True)
    for c in ("host", "sglang", "applied changes", "kernels", "drift", "modified outside fleetctl"):
        t.add_column(c, overflow="fold")
    for r in results:
        d = r.data or {}
        if "changes" not in d:  # unreachable or failed before the ledger was read: nothing is known
            unknown = Text(f"unknown ({r.status})", style=STATUS_STYLE.get(r.status))
            t.add_row(r.host, unknown, unknown, unknown, unknown, unknown)
            continue
        applied = [c["change_id"] + (" (PENDING: interrupted or in progress)"
                                     if c["state"] == ChangeState.PENDING else "")
                   for c in d.get("changes", []) if c["state"] in (ChangeState.APPLIED, ChangeState.PENDING)]
        kernels = "\n".join(f"{k} -> {v[:12]}" for k, v in (d.get("kernels") or {}).items())
        t.add_row(r.host, str(d.get("sglang") or ""), "\n".join(applied) or "none", kernels or "none",
                  "\n".join(f"{x['path']} ({x['change_id']})" for x in d.get("drift", [])) or "none",
                  "\n".join(m["path"] for m in d.get("modified") or []) or "none")
    console.print(t)
    render_problems(results, console)


def render_deploy(results: list[HostResult], console: Console) -> None:
    """Per-host outcome of a kernel deploy: backend/arch, build key, built or reused, validation."""
    t = Table(title="deploy kernel", title_justify="left")
    for c in ("hosts", "status", "backend", "build", "active", "validation", "detail"):
        t.add_column(c, overflow="fold")
    rows = []
    for r in results:
        d = r.data or {}
        key = (d.get("build_key") or "")[:12]
        built = "reused" if d.get("reused") else (f"built in {d['build']['seconds']:.0f}s" if d.get("build") else "")
        active = key if r.status in (HostStatus.OK, HostStatus.CHANGED) else (d.get("previous") or "")[:12]
        rows.append((r.host, (r.status, f"{d.get('backend') or ''} {d.get('arch') or ''}".strip(), built, active,
                              (d.get("validation") or {}).get("status", ""), r.error or "")))
    for hosts, (status, backend, built, active, val, detail) in coalesce(rows):
        t.add_row(host_list(hosts), Text(status, style=STATUS_STYLE.get(status)), backend, built, active, val, detail)
    console.print(t)


def render_hosts(docs: list[dict], console: Console) -> None:
    """Print `fleetctl hosts`: one row per host (reach.describe entries: kind, address, port,
    user, identity files, jump chain, host key name), then each host's known_hosts lines that
    apply, then the hosts whose resolution was refused. Every value is printed as text (no Rich
    markup is read from it)."""
    t = Table(title="fleetctl hosts", show_lines=True)
    for c in ("host", "connection", "address", "port", "user", "identity files", "jump", "host key name"):
        t.add_column(c, overflow="fold")
    for d in (d for d in docs if not d["error"]):
        jump = " -> ".join(d["jump"]) or (f"ProxyCommand {d['proxy_command']}" if d["proxy_command"] else "direct")
        t.add_row(*(Text(str(v if v is not None else "")) for v in (
            d["host"], d["connection"], d["address"], d["port"], d["user"], "\n".join(d["identity_files"]), jump,
            d["host_key_name"])))
    console.print(t)
    for d in (d for d in docs if not d["error"] and d["connection"] != "local"):
        console.print(Text(f"{d['host']}: known_hosts {' '.join(d['known_hosts']) or 'none'}", style="bold"))
        for line in d["known_hosts_lines"] or ["(no line applies: the host key is unknown)"]:
            console.print(Text("  " + line))
    for d in (d for d in docs if d["error"]):
        console.print(Text(f"{d['host']}: {d['error']}", style="red"))
