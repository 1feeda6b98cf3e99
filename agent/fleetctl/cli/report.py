"""Rendering results: the inspect JSON document and Rich tables, identical hosts coalesced.

Hosts whose findings are identical are gathered into one block with their host list (as clubak
gathers identical output); columns whose values differ between blocks are highlighted.

Every string a host or an inventory supplies reaches Rich through `text()`: never parsed as
markup, control characters shown as escapes (security review M5). A host's data of an odd shape
becomes a "malformed" cell, never a crash that loses the report.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from typing import Any, Callable, Iterable

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..engine.context import HostResult
from ..engine.dispatch import describe
from ..probes import redact
from ..vocab import PROBLEM_STATUSES, ChangeState, HostStatus

# C0 controls but tab and newline, DEL, C1 controls, and the Unicode bidi and zero-width format
# characters that reorder or hide text on a terminal, and lone surrogates (no UTF-8 encodes them).
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200b-\u200f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


def visible(value: Any) -> str:
    """`value` as a string (None: "") with each control character shown as \\xNN / \\uNNNN, and each
    lone surrogate (an undecodable byte of a file name, as os.fsdecode gives it) as \\udcNN."""
    s = "" if value is None else str(value)
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100 else f"\\u{ord(m.group()):04x}", s)


def text(value: Any, style: str | None = None) -> Text:
    """A table cell or message built from host or inventory data: plain text (no markup), control
    characters visible (see visible)."""
    return Text(visible(value), style=style)


def _tolerant(build: Callable[[], Any], columns: int) -> Any:
    """build(), or, when the host's data has an odd shape, `columns` cells: the first says so."""
    try:
        return build()
    except (KeyError, TypeError, AttributeError, ValueError, IndexError) as e:
        return ["malformed data from the host: " + visible(f"{type(e).__name__}: {e}")] + [""] * (columns - 1)


STATUS_STYLE = {HostStatus.OK: "green", HostStatus.CHANGED: "yellow", HostStatus.SKIPPED: "cyan",
                HostStatus.FAILED: "red", HostStatus.UNREACHABLE: "magenta", HostStatus.NOT_ATTEMPTED: "dim"}


def inspect_document(results: list[HostResult]) -> dict:
    """The `inspect --json` document: {"hosts": [{host, address, status, error, elapsed_s, facts,
    installs, not_inspected, allocator_call_sites, need_sort_origins, scan, timing}]}; lists are
    complete, never truncated. `installs`: [{id, python, sglang, torch, servers (pids),
    allocator_call_sites, need_sort_origins, scan}] (README, "installs"); `not_inspected`: the
    installs seen but not inspected, [{id, status "not_inspected", reason, python, servers,
    units, user}] (engine/gather.not_inspected); the top-level call sites, origins and scan
    are the primary install's. `timing`: where the host's time went (fleet.HostContext.timing:
    connect_s, probes, upload_bytes, remote_s, parse_s)."""
    hosts = []
    for r in results:
        d = r.data or {}
        hosts.append({
            "host": r.host, "address": r.address, "status": r.status, "error": r.error,
            "elapsed_s": r.elapsed_s, "facts": d.get("facts"),
            "installs": [{k: v for k, v in i.items() if k != "sources"} for i in d.get("installs", [])],
            "not_inspected": d.get("not_inspected", []),
            "allocator_call_sites": d.get("allocator_call_sites", []),
            "need_sort_origins": d.get("need_sort_origins", []),
            "scan": d.get("scan"),
            "timing": d.get("timing"),
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
    unread = len((i.get("scan") or {}).get("parse_errors") or [])
    root = i.get("root")
    where = (f" in container {root.get('name')} ({root.get('image')}, {root['runtime']}, entered with "
             f"{(i.get('container') or {}).get('how')}; a change there lasts until it is recreated)") if root else ""
    return (f"{sg['version']} {sg['install']} {sg['package_dir'] or sg['location']}{where}"
            + (f" servers {', '.join(map(str, i['servers']))}" if i.get("servers") else "")
            + (f" ERROR {err}" if err else "")
            + (f" ({unread} not scanned: see --json scan.parse_errors)" if unread else ""))


def _gpus(f: dict) -> str:
    names = ", ".join(sorted(Counter(f"{g['name']} sm_{str(g['compute_cap'] or '?').replace('.', '')}"
                                     for g in f.get("gpus", [])).elements()))
    if names and f.get("gpus_reason"):
        return f"{names}; {f['gpus_reason']}"
    return names or f"none ({f.get('gpus_reason')})"


def server_line(s: dict) -> str:
    """One server of a host's facts for the inspect table: ":PORT MODEL tp=N [dp=N [(attention)]]
    [pp=N] [node R/N of ADDR] gpus IDS [(stand-in)]"; a GPU id CUDA_VISIBLE_DEVICES lacks is "?"."""
    dp = s.get("dp_size", 1)
    nodes = s.get("nnodes", 1)
    gpus = ",".join("?" if g is None else str(g) for g in s.get("gpu_ids") or [])
    return (f":{s['port']} {s.get('model_path') or '?'} tp={s['tp_size']}"
            + (f" dp={dp}" + (" (attention)" if s.get("enable_dp_attention") else "") if dp > 1 else "")
            + (f" pp={s['pp_size']}" if s.get("pp_size", 1) > 1 else "")
            + (f" node {s.get('node_rank')}/{nodes} of {s.get('dist_init_addr')}" if nodes > 1 else "")
            + f" gpus {gpus or 'none'}"
            + (" (stand-in)" if s.get("kind") == "stand-in" else ""))


def _summary(data: dict) -> dict:
    try:
        return _summary_of(data)
    except (KeyError, TypeError, AttributeError, ValueError, IndexError) as e:
        return {"python": "malformed data from the host: " + visible(f"{type(e).__name__}: {e}")}


def _summary_of(data: dict) -> dict:
    f = data.get("facts") or {}
    sg, torch = f.get("sglang"), f.get("torch")
    sites = data.get("allocator_call_sites", [])
    origins = data.get("need_sort_origins", [])
    passing = Counter(s["need_sort"]["passing"] for s in sites)
    computed = [o for o in origins if not o["literal"]]
    return {
        "python": f"{(f.get('python') or {}).get('path')} ({(f.get('python') or {}).get('version')})",
        "sglang": f"{sg['version']} ({sg.get('install')})" if sg else f"none: {f.get('sglang_reason')}",
        "installs": "\n".join([_install_line(i) for i in data.get("installs", [])]
                              + [f"NOT INSPECTED: {e['reason']}" for e in data.get("not_inspected") or []]) or "none",
        "torch": f"{torch['version']} / CUDA {torch['cuda'] or 'none'}" if torch else "none",
        "gpus": _gpus(f),
        "servers": "\n".join(server_line(s) for s in f.get("servers", [])) or "none",
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
        cols = list(max((g[1] for g in groups), key=len).keys())
        differs = {c for c in cols if len({str(g[1].get(c, "")) for g in groups}) > 1}
        t = Table(title="fleetctl inspect", show_lines=True)
        t.add_column("hosts", style="bold")
        for c in cols:
            t.add_column(c, style="yellow" if c in differs else None, overflow="fold")
        for hosts, s in groups:
            t.add_row(text(host_list(hosts)), *[text(s.get(c, "")) for c in cols])
        console.print(t)
    findings = coalesce((r.host, {"sites": r.data.get("allocator_call_sites", []),
                                  "origins": r.data.get("need_sort_origins", [])}) for r in good)
    for hosts, f in findings:
        if not f["sites"] and not f["origins"]:
            continue
        try:
            _render_findings(hosts, f["sites"], f["origins"], console)
        except (KeyError, TypeError, AttributeError, ValueError, IndexError) as e:
            console.print(text(f"{host_list(hosts)}: malformed call sites from the host: {type(e).__name__}: {e}",
                               style="red"))
    render_allocator_replay(good, console)
    render_problems(results, console)


# a replay whose need_sort run sorts on at least this share of its prefills is under memory pressure
PRESSURE_SHARE = 0.5


def replay_line(info: dict, runs: list[dict]) -> str:
    """One line: what defrag-tier0 (need_sort=True) would change for one install, from its
    allocator replay (engine/gather.allocator_replay: `info` its allocator_replay_info, `runs` its
    allocator_replay): per allocator the mean contiguous runs per prefill allocation False -> True,
    how many times fewer, the fully contiguous share, the sorts in all prefills and the longest;
    "under pressure" when the True run sorts on PRESSURE_SHARE of its prefills or more; the trace
    after. A release without need_sort, or a replay not run, says so with its reason."""
    if info.get("status") == "no_need_sort":
        return f"defrag-tier0 would change nothing here: {info.get('reason')}"
    if info.get("status") != "replayed":
        return f"not replayed: {info.get('reason')}"
    parts, pressure = [], False
    for kind in ("token", "paged"):
        pair = {r["need_sort"]: r for r in runs if r["kind"] == kind}
        if set(pair) != {False, True}:
            continue
        off, on = pair[False], pair[True]
        pressure |= (on["sorts"] or 0) >= PRESSURE_SHARE * on["prefills"]
        name = "token" if kind == "token" else f"paged/{on['page_size']}"
        fewer = off["runs_per_alloc_mean"] / on["runs_per_alloc_mean"]
        parts.append(f"{name} {off['runs_per_alloc_mean']:.1f} -> {on['runs_per_alloc_mean']:.1f} runs per prefill "
                     f"({fewer:.1f}x fewer; contiguous {off['contiguous_share']:.0%} -> {on['contiguous_share']:.0%}; "
                     f"{on['sorts']} sorts in {on['prefills']} prefills, {on['sort_max_s'] * 1000:.1f} ms max)")
    t = info.get("trace") or {}
    regime = ("UNDER PRESSURE, a sort on most admissions" if pressure else "with headroom")
    return (f"defrag-tier0 here ({regime}): " + "; ".join(parts)
            + f" [pool {t.get('pool')} ({t.get('pool_source')}), {t.get('concurrency')} concurrent, "
              f"{t.get('requests')} requests, seed {t.get('seed')}]")


def render_allocator_replay(results: list[HostResult], console: Console) -> None:
    """The allocator replay's answer per install (replay_line), identical hosts coalesced; nothing
    when no install was replayed (inspect without --allocator-replay)."""
    def line(i: dict) -> str:
        return _tolerant(lambda: [replay_line(i["allocator_replay_info"], i.get("allocator_replay") or [])], 1)[0]

    rows = [(r.host, (f"{(i.get('sglang') or {}).get('version')} {(i.get('sglang') or {}).get('package_dir')}", line(i)))
            for r in results for i in r.data.get("installs", []) if "allocator_replay_info" in i]
    if rows:
        table("allocator replay: what defrag-tier0 (need_sort=True) would change", ["hosts", "install", "answer"],
              [[host_list(hosts), install, line] for hosts, (install, line) in coalesce(rows)], console)


def _render_findings(hosts: list[str], sites: list[dict], origins: list[dict], console: Console) -> None:
    t = Table(title=text(f"allocator call sites — {host_list(hosts)}"), title_justify="left")
    for c in ("file:line", "callee", "need_sort", "expr"):
        t.add_column(c, overflow="fold")
    for s in sites:
        ns = s["need_sort"]
        callee = s["callee"] + (" (alias)" if s.get("aliased") else "")
        style = {"absent": "dim", "default": "dim"}.get(ns["passing"])
        t.add_row(text(f"{s['file']}:{s['line']}-{s['end_line']}"), text(callee), text(ns["passing"], style=style),
                  text(ns.get("expr")))
    console.print(t)
    if not origins:
        console.print(Text("no need_sort origins: this release has no need_sort", style="cyan"))
        return
    t = Table(title=text(f"need_sort origins — {host_list(hosts)}"), title_justify="left")
    for c in ("file:line", "kind", "callee", "expr", "literal"):
        t.add_column(c, overflow="fold")
    for o in origins:
        t.add_row(text(f"{o['file']}:{o['line']}"), text(o["kind"]), text(o.get("callee")),
                  text(o["expr"], style="dim" if o["literal"] else "bold"), "yes" if o["literal"] else "no")
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
        t.add_row(text(host_list(hosts)), text(status, style=STATUS_STYLE.get(status)), text(err))
    console.print(t)


def render_lasts(results: list[HostResult], console: Console) -> None:
    """For each host whose job ran in a container (data["lasts"], data["root"]): which
    container, how it was entered, and how long a change there lasts (container.LASTS)."""
    for r in results:
        if r.data.get("lasts"):
            root = r.data.get("root") or {}
            console.print(text(f"{r.host}: container {root.get('name')} ({root.get('image')}), entered with "
                               f"{r.data.get('entered_with')}: a change there {r.data['lasts']}", style="yellow"),
                          highlight=False, soft_wrap=True)


def render_status_line(results: list[HostResult], console: Console) -> None:
    """One recap line, like Ansible's PLAY RECAP: counts per status."""
    counts = Counter(r.status for r in results)
    parts = [text(f"{k}={v}", style=STATUS_STYLE.get(k)) for k, v in sorted(counts.items())]
    line = Text("recap: ")
    for p in parts:
        line.append(p)
        line.append(" ")
    console.print(line)


def table(title: str, columns: list[str], rows: list[list[Any]], console: Console,
          style_of: Callable[[str, Any], str | None] | None = None) -> None:
    """Print a simple table (one row per item; cells stringified)."""
    t = Table(title=text(title), title_justify="left")
    for c in columns:
        t.add_column(c, overflow="fold")
    for row in rows:
        t.add_row(*[text(v, style=style_of(c, v) if style_of else None) for c, v in zip(columns, row)])
    console.print(t)


def render_rollback(results: list[HostResult], console: Console) -> None:
    """Per-host outcome of a rollback: which change, how many files or links were restored."""
    t = Table(title="rollback", title_justify="left")
    for c in ("host", "status", "change", "detail"):
        t.add_column(c, overflow="fold")
    for r in results:
        d = r.data or {}

        def detail(r=r, d=d):
            if r.error:
                return r.error
            if d.get("nothing"):
                return f"nothing to do: {d['nothing']}"
            forced = f"; forced over {', '.join(map(str, d['forced']))}" if d.get("forced") else ""
            return f"restored {len(d.get('files') or [])} file(s)/link(s) byte-identical{forced}"

        t.add_row(text(r.host), text(r.status, style=STATUS_STYLE.get(r.status)), text(d.get("change_id")),
                  *map(text, _tolerant(lambda detail=detail: [detail()], 1)))
    console.print(t)


def render_recover(results: list[HostResult], console: Console) -> None:
    """Per-host outcome of `fleetctl recover`: each pending change undone and what happened to
    each of its files."""
    t = Table(title="recover", title_justify="left")
    for c in ("host", "status", "change", "files"):
        t.add_column(c, overflow="fold")
    for r in results:
        d = r.data or {}

        def cells(d=d, r=r):
            done = d.get("recovered") or []
            changes = "\n".join(f"{c['change_id']} -> {c['state']}" for c in done) or "nothing pending"
            files = "\n".join(f"{f['path']}: {f['action']}" for c in done for f in c.get("files") or [])
            return [changes, files or r.error or ""]

        t.add_row(text(r.host), text(r.status, style=STATUS_STYLE.get(r.status)), *map(text, _tolerant(cells, 2)))
    console.print(t)


def render_validate(results: list[HostResult], console: Console) -> None:
    """Smoke decode table: host, server, health wait, tokens, median latency, tokens/s; a row per
    refused target (data["refused"]: a process that claimed a server's port it does not hold,
    which was sent nothing)."""
    t = Table(title="fleetctl validate", title_justify="left")
    for c in ("host", "status", "server", "health wait", "tokens", "median latency", "tokens/s", "detail"):
        t.add_column(c, overflow="fold")
    for r in results:
        servers = (r.data or {}).get("servers") or [None]
        for s in servers:
            status = text(r.status, style=STATUS_STYLE.get(r.status))
            if s is None:
                t.add_row(text(r.host), status, "", "", "", "", "", text(r.error))
                continue

            def cells(s=s):
                lat = s.get("e2e_latency_s") or s.get("latency_s")
                only = f"node rank {s.get('node_rank')}: /health only" if s.get("health_only") else ""
                return [f":{s.get('port')} {s.get('model_path') or '?'}" + (" (stand-in)" if s.get("stand_in") else ""),
                        f"{s['health_wait_s']:.1f}s" if s.get("health_wait_s") is not None else "",
                        " ".join(map(str, s.get("output_ids") or [])),
                        f"{lat * 1000:.1f} ms" if lat else "",
                        f"{s['tokens_per_s']:.0f}" if s.get("tokens_per_s") else "",
                        "; ".join(x for x in (only, s.get("error")) if x)]

            t.add_row(text(r.host), status, *map(text, _tolerant(cells, 6)))
        for f in (r.data or {}).get("refused") or []:  # not smoke-tested, nothing sent (review N6)
            t.add_row(text(r.host), text(r.status, style=STATUS_STYLE.get(r.status)),
                      *map(text, _tolerant(lambda f=f: [f"refused: pid {f.get('pid')} {f.get('host')}:{f.get('port')}",
                                                        "", "", "", "", f.get("reason") or ""], 6)))
        off = (r.data or {}).get("offline")
        if off:
            t.add_row(text(r.host), text(r.status, style=STATUS_STYLE.get(r.status)),
                      *map(text, _tolerant(lambda off=off: [
                          f"offline: {off['cmd']}", "", "", f"{off['duration_s']:.1f}s", "",
                          " | ".join(map(str, off["tail"][-2:]))], 6)))
    console.print(t)


def render_apply(results: list[HostResult], console: Console, diff: bool, check: bool,
                 title: str | None = None) -> None:
    """Per-host outcome of a playbook run; with `diff`, unified diffs coalesced across hosts."""
    if diff:
        diffs = coalesce((r.host, "".join(f["diff"] for f in r.data["plan"]["files"]))
                         for r in results if r.data.get("plan") and r.data["plan"]["files"])
        for hosts, diff_text in diffs:
            console.rule(text(f"diff — {host_list(hosts)}"))
            console.print(text(diff_text), highlight=False, soft_wrap=True)
    t = Table(title=title or ("check mode: nothing was changed" if check else "apply"), title_justify="left")
    for c in ("hosts", "status", "edits", "left alone", "validation", "detail"):
        t.add_column(c, overflow="fold")
    rows = []
    for r in results:
        plan = r.data.get("plan") or {}
        v = r.data.get("validation") or {}
        val = (v.get("status", "") + (" (token drift allowed)" if v.get("token_drift") else "")
               + (f"; gate: {v['gate']}" if v.get("gate") else ""))
        rows.append((r.host, (r.status, len(plan.get("edits", [])), len(plan.get("left_alone", [])),
                              val, r.error or r.data.get("skipped_reason") or r.data.get("commit_note") or "")))
    for hosts, (status, edits, left, val, detail) in coalesce(rows):
        t.add_row(text(host_list(hosts)), text(status, style=STATUS_STYLE.get(status)), str(edits), str(left),
                  text(val), text(detail))
    console.print(t)


def render_handlers(results: list[HostResult], console: Console) -> None:
    """The handler commands (restarts) each planned host would run after its change, identical
    ones coalesced, secrets redacted: shown with the plan, before the confirmation (review L10)."""
    planned = ((r.host, [[h.get("name"), redact.text(str(h.get("command")))]
                         for h in ((r.data or {}).get("plan") or {}).get("handlers") or []])
               for r in results)
    for hosts, handlers in coalesce((h, hs) for h, hs in planned if hs):
        console.print(text(f"handlers run after the change — {host_list(hosts)}:", style="bold"))
        for name, command in handlers:
            console.print(text(f"  {name}: {command}"), highlight=False, soft_wrap=True)


def _space(space: dict | None) -> str:
    """'backups 1.2 MiB, kernel builds 80.0 MiB (state dir 81.3 MiB)' from the status probe's
    space (bytes), or '?' when the host did not say."""
    if not space:
        return "?"
    mib = lambda n: f"{int(n) / (1 << 20):.1f} MiB"  # noqa: E731
    return f"backups {mib(space['backups'])}, kernel builds {mib(space['kernels'])} (state dir {mib(space['total'])})"


def _kernels(d: dict) -> str:
    """The status table's kernels cell: per active kernel 'verify_attention 1a2b3c4d5e6f (cpu):
    routes all shapes (operator: --route all, 2026-...)' (engine/dispatch.describe of the
    host's PUBLIC/NAME/dispatch.json), one line each."""
    tables = d.get("dispatch") or {}
    lines = []
    for name, key in (d.get("kernels") or {}).items():
        table = tables.get(name)
        backend = f" ({table['backend']})" if isinstance(table, dict) and isinstance(table.get("backend"), str) else ""
        lines.append(f"{name} {str(key)[:12]}{backend}: {describe(table, key)}")
    return "\n".join(lines)


def render_status(results: list[HostResult], console: Console) -> None:
    """Applied changes and drift per host."""
    t = Table(title="fleetctl status", title_justify="left", show_lines=True)
    for c in ("host", "sglang", "applied changes", "kernels", "drift", "modified outside fleetctl", "space used"):
        t.add_column(c, overflow="fold")
    for r in results:
        d = r.data or {}
        if "changes" not in d:  # unreachable or failed before the ledger was read: nothing is known
            unknown = text(f"unknown ({r.status})", style=STATUS_STYLE.get(r.status))
            t.add_row(text(r.host), unknown, unknown, unknown, unknown, unknown, unknown)
            continue

        def cells(d=d):
            applied = [str(c["change_id"]) + (" (PENDING: interrupted or in progress)"
                                                  if c["state"] == ChangeState.PENDING else "")
                       for c in d.get("changes") or [] if c["state"] in (ChangeState.APPLIED, ChangeState.PENDING)]
            return [d.get("sglang") or "", "\n".join(applied) or "none",
                    _kernels(d) or "none",
                    "\n".join(f"{x['path']} ({x['change_id']})" for x in d.get("drift") or []) or "none",
                    "\n".join(str(m["path"]) for m in d.get("modified") or []) or "none",
                    _space(d.get("space"))]

        t.add_row(text(r.host), *map(text, _tolerant(cells, 6)))
    console.print(t)
    render_problems(results, console)


def render_deploy(results: list[HostResult], console: Console) -> None:
    """Per-host outcome of a kernel deploy: backend/arch, build key, built or reused, the active
    build (check mode: would build or reuse, the build active now, and why that backend), what its
    dispatch table routes (check mode: the table it would write), validation."""
    t = Table(title="deploy kernel", title_justify="left")
    for c in ("hosts", "status", "backend", "build", "active", "dispatch", "validation", "detail"):
        t.add_column(c, overflow="fold")
    rows = []
    for r in results:
        d = r.data or {}
        key = (d.get("build_key") or "")[:12]
        built = ("would reuse" if d.get("reused") else "would build") if d.get("check") else (
            "reused" if d.get("reused") else (f"built in {d['build']['seconds']:.0f}s" if d.get("build") else ""))
        # changed in check mode: would activate `key`, and `previous` is still active
        activated = r.status == HostStatus.OK or (r.status == HostStatus.CHANGED and not d.get("check"))
        active = key if activated else (d.get("previous") or "")[:12]
        # the table on the host judged against the build it serves: switched back, the previous
        # build's; check mode: the table and build it would write
        serves = d.get("build_key") if activated or d.get("check") else d.get("previous")
        routes = (("would write: " if d.get("check") else "") + describe(d["table"], serves)
                  if d.get("table") else d.get("table_note") or "")
        rows.append((r.host, (r.status, f"{d.get('backend') or ''} {d.get('arch') or ''}".strip(), built, active,
                              routes, (d.get("validation") or {}).get("status", ""),
                              r.error or d.get("commit_note") or (d.get("why") if d.get("check") else "") or "")))
    for hosts, (status, backend, built, active, routes, val, detail) in coalesce(rows):
        t.add_row(text(host_list(hosts)), text(status, style=STATUS_STYLE.get(status)), text(backend), text(built),
                  text(active), text(routes), text(val), text(detail))
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


def render_cache_clear(results: list[HostResult], console: Console) -> None:
    """Per host: the scan cache directory emptied and how many files it held."""
    rows = [[r.host, r.status, (r.data.get("cache") or {}).get("path") or "", (r.data.get("cache") or {}).get("removed", ""),
             r.error or ""] for r in results]
    table("scan cache cleared", ["host", "status", "path", "files removed", "error"], rows, console,
          lambda c, v: STATUS_STYLE.get(v) if c == "status" else None)


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

            rows.append([r.host, r.status, *_tolerant(cells, 8)])
        for k in (load.get("skipped") or []) + (load.get("refused") or []):  # nothing was sent to these
            rows.append([r.host, r.status, f"{k.get('host')}:{k.get('port')}", "", "", "", "", "", "",
                         f"{'skipped' if 'node_rank' in k else 'refused'}: {k.get('reason')}"])
    if rows:
        table("load: SGLang's own benchmark client", ["host", "status", "server", "client and workload", "completed",
                                                      "output tok/s", "TTFT p50 / p99 ms", "ITL p99 ms",
                                                      "E2E p99 ms", "detail"], rows, console,
              lambda c, v: STATUS_STYLE.get(v) if c == "status" else None)


def render_load_gate(results: list[HostResult], console: Console) -> None:
    """The load gate of each host that ran one (data["load_gate"]: engine/load.load_gate): per
    server, the baseline taken right before the change and the run after its restart side by
    side (SGLang's result names), the change (after / baseline), each gated metric's limit and
    verdict; then the output throughput ratio per server (a kernel's speedup). A gate that was
    skipped says why in one line."""
    for r in results:
        gate = (r.data or {}).get("load_gate")
        if not gate:
            continue
        if not gate.get("servers"):
            console.print(text(f"{r.host}: load gate {gate.get('status')}"))
            continue

        def build(r=r, gate=gate):
            from ..engine.load import SHOWN

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
    """The route gate of each host that ran one (data["route_gate"]: engine/routegate.route_gate):
    one row per check (ranks, tokens, logprobs, long prompt, accept length) per server, its verdict
    and detail (both sides' values, the pids and their fallbacks when a rank did not route). A gate
    that did not run (not restarted) says so in one line."""
    for r in results:
        gate = (r.data or {}).get("route_gate")
        if not gate:
            continue
        if not gate.get("checks"):
            console.print(text(f"{r.host}: route gate {gate.get('status')}"))
            continue
        try:
            rows = [[c["target"], c["name"], "ok" if c["passed"] else "FAILED", c["detail"]] for c in gate["checks"]]
        except (KeyError, TypeError) as e:
            console.print(text(f"{r.host}: malformed route gate data: {type(e).__name__}: {e}", style="red"))
            continue
        table(f"{r.host}: route gate {gate.get('status')}: the routed kernel against the baseline right before the "
              "change", ["server", "check", "verdict", "detail"], rows, console,
              lambda c, v: "red" if v == "FAILED" else ("green" if v == "ok" else None))
