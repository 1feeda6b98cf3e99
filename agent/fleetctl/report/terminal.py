"""Terminal tables for inspect, apply, deploy, status, rollback: identical hosts coalesced.

Hosts whose findings are identical are gathered into one block with their host list (as clubak
gathers identical output); columns whose values differ between blocks are highlighted. Every
host string goes through `text.text()`.
"""

from __future__ import annotations

from collections import Counter

from rich.console import Console
from rich.text import Text

from ..engine.context import HostResult
from ..engine.kernels.dispatch import describe
from ..probes import redact
from ..vocab import PROBLEM_STATUSES, ChangeState, HostStatus
from .text import STATUS_STYLE, coalesce, gate_status, grid, host_list, table, text, tolerant, visible


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
            + f" gpus {gpus or 'none'}" + pd_words(s.get("pd"))
            + (" (stand-in)" if s.get("kind") == "stand-in" else ""))


def pd_words(part: dict | None) -> str:
    """A server's PD part (facts pd: probes/facts/pd.py) for the inspect table: " PD prefill
    (bootstrap :N) behind router :P", " PD decode (no router here)", " PD router -> prefill
    URL, decode URL"; "" when it is not disaggregated."""
    if not part:
        return ""
    if part.get("role") == "router":
        peers = [f"prefill {p.get('url')}" for p in part.get("prefill") or []] + [
            f"decode {u}" for u in part.get("decode") or []]
        return " PD router -> " + ", ".join(peers)
    boot = f" (bootstrap :{part['bootstrap_port']})" if part.get("bootstrap_port") else ""
    routers = ", ".join(f":{r.get('port')}" for r in part.get("routers") or [])
    return f" PD {part.get('role')}{boot}" + (f" behind router {routers}" if routers else " (no router here)")


def unreadable_line(u: dict) -> str:
    """A process of a host's facts that looks like a server but whose /proc entries this login
    may not read (facts.servers_unreadable: procs.unreadable_servers): "pid N (USER's) :PORT:
    REASON"."""
    return f"pid {u.get('pid')} ({u.get('user')}'s) :{u.get('port')}: {u.get('reason')}"


# the inspect summary's columns without --details: what a host runs, not where its files are
COMPACT = ("sglang", "torch", "gpus", "servers", "allocator")


def _compact(s: dict) -> dict:
    """The summary's compact cells: installs folded into sglang when there is more than one or one
    was not inspected, call sites and need_sort origins in one "allocator" cell."""
    if "sglang" not in s:  # malformed data: its one cell says so
        return {"sglang": s.get("python", "")}
    installs = s.get("installs", "").split("\n")
    more = [i for i in installs if i.startswith("NOT INSPECTED")]
    count = len(installs) - len(more)
    sglang = s.get("sglang", "") + (f"\n{count} installs (--details)" if count > 1 else "")
    count, _, passing = s.get("call sites", "").partition(" ")
    alloc = f"{count} call sites {passing}".strip() + (f"\nneed_sort {s['need_sort origins']}"
                                                       if s.get("need_sort origins", "-") != "-" else "")
    return {**{k: s[k] for k in COMPACT if k in s}, "sglang": "\n".join([sglang] + more),
            **({"allocator": alloc} if "call sites" in s else {})}


def _summary(data: dict) -> dict:
    try:
        return _summary_of(data)
    except (KeyError, TypeError, AttributeError, ValueError, IndexError) as e:
        return {"python": "malformed data from the host: " + visible(f"{type(e).__name__}: {e}")}


def _warned(found: dict) -> str:
    """The metadata warning of a facts sglang/torch entry (stale or duplicate dist-infos) as a
    line of its own, or ""."""
    return f"\nWARNING: {found['metadata_warning']}" if found.get("metadata_warning") else ""


def _summary_of(data: dict) -> dict:
    f = data.get("facts") or {}
    sg, torch = f.get("sglang"), f.get("torch")
    sites = data.get("allocator_call_sites", [])
    origins = data.get("need_sort_origins", [])
    passing = Counter(s["need_sort"]["passing"] for s in sites)
    computed = [o for o in origins if not o["literal"]]
    return {
        "python": f"{(f.get('python') or {}).get('path')} ({(f.get('python') or {}).get('version')})",
        "sglang": (f"{sg['version']} ({sg.get('install')})" + _warned(sg)) if sg else f"none: {f.get('sglang_reason')}",
        "installs": "\n".join([_install_line(i) for i in data.get("installs", [])]
                              + [f"NOT INSPECTED: {e['reason']}" for e in data.get("not_inspected") or []]) or "none",
        "torch": (f"{torch['version'] or 'unknown: ' + str(torch.get('reason'))} / CUDA {torch['cuda'] or 'none'}"
                  + _warned(torch)) if torch else "none",
        "gpus": _gpus(f),
        "servers": "\n".join([server_line(s) for s in f.get("servers", [])]
                              + [unreadable_line(u) for u in f.get("servers_unreadable") or []]) or "none",
        "call sites": f"{len(sites)}" + (" (" + ", ".join(f"{k} {v}" for k, v in sorted(passing.items())) + ")"
                                         if sites else ""),
        "need_sort origins": (f"{len(origins)}: {len(computed)} computed, {len(origins) - len(computed)} literal"
                              if origins else ("none: this release has no need_sort" if sg else "-")),
    }


def render_inspect(results: list[HostResult], console: Console, details: bool = False) -> None:
    """Print the inspect report: a summary (identical hosts coalesced, differing columns
    highlighted; without `details` its compact columns, COMPACT), with `details` each distinct set
    of call sites and origins in full, then the allocator replay and failures."""
    good = [r for r in results if r.status == HostStatus.OK]
    groups = [(hosts, s if details else _compact(s))
              for hosts, s in coalesce((r.host, _summary(r.data)) for r in good)]
    if groups:
        cols = list(max((g[1] for g in groups), key=len).keys())
        differs = {c for c in cols if len({str(g[1].get(c, "")) for g in groups}) > 1}
        grid("fleetctl inspect", ["hosts"] + cols,
             [[text(host_list(hosts), style="bold")] + [text(s.get(c, "")) for c in cols] for hosts, s in groups],
             console, show_lines=True, column_style={c: "yellow" for c in differs})
    findings = coalesce((r.host, {"sites": r.data.get("allocator_call_sites", []),
                                  "origins": r.data.get("need_sort_origins", [])}) for r in good)
    for hosts, f in findings if details else ():
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
        return tolerant(lambda: [replay_line(i["allocator_replay_info"], i.get("allocator_replay") or [])], 1)[0]

    rows = [(r.host, (f"{(i.get('sglang') or {}).get('version')} {(i.get('sglang') or {}).get('package_dir')}", line(i)))
            for r in results for i in r.data.get("installs", []) if "allocator_replay_info" in i]
    if rows:
        table("allocator replay: what defrag-tier0 (need_sort=True) would change", ["hosts", "install", "answer"],
              [[host_list(hosts), install, line] for hosts, (install, line) in coalesce(rows)], console)


def _render_findings(hosts: list[str], sites: list[dict], origins: list[dict], console: Console) -> None:
    rows = []
    for s in sites:
        ns = s["need_sort"]
        callee = s["callee"] + (" (alias)" if s.get("aliased") else "")
        style = {"absent": "dim", "default": "dim"}.get(ns["passing"])
        rows.append([text(f"{s['file']}:{s['line']}-{s['end_line']}"), text(callee), text(ns["passing"], style=style),
                     text(ns.get("expr"))])
    grid(f"allocator call sites — {host_list(hosts)}", ["file:line", "callee", "need_sort", "expr"], rows, console)
    if not origins:
        console.print(Text("no need_sort origins: this release has no need_sort", style="cyan"))
        return
    grid(f"need_sort origins — {host_list(hosts)}", ["file:line", "kind", "callee", "expr", "literal"],
         [[text(f"{o['file']}:{o['line']}"), text(o["kind"]), text(o.get("callee")),
           text(o["expr"], style="dim" if o["literal"] else "bold"), text("yes" if o["literal"] else "no")]
          for o in origins], console)


def render_problems(results: list[HostResult], console: Console) -> None:
    """Failed, unreachable and not-attempted hosts, coalesced by identical error."""
    bad = [(r.host, (r.status, r.error or "")) for r in results if r.status in PROBLEM_STATUSES]
    if not bad:
        return
    grid("problems", ["hosts", "status", "error"],
         [[text(host_list(hosts), style="bold"), text(status, style=STATUS_STYLE.get(status)), text(err)]
          for hosts, (status, err) in coalesce(bad)], console, show_lines=True)


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


def render_rollback(results: list[HostResult], console: Console) -> None:
    """Per-host outcome of a rollback: which change, how many files or links were restored."""
    rows = []
    for r in results:
        d = r.data or {}

        def detail(r=r, d=d):
            if r.error:
                return r.error
            if d.get("nothing"):
                return f"nothing to do: {d['nothing']}"
            if d.get("forgotten"):
                return "; ".join(f"forgot {g['change_id']} ({g['upgraded']['dist']} {g['upgraded']['from']} -> "
                                 f"{g['upgraded']['to']}): restored nothing"
                                 + (f", removed {', '.join(g['removed'])}" if g["removed"] else "")
                                 + (f", left (edited since) {', '.join(g['left'])}" if g["left"] else "")
                                 + (f", kept (a later change's) {', '.join(g['adopted'])}" if g.get("adopted") else "")
                                 for g in d["forgotten"]) + "; apply the playbook again"
            forced = f"; forced over {', '.join(map(str, d['forced']))}" if d.get("forced") else ""
            return f"restored {len(d.get('files') or [])} file(s)/link(s) byte-identical{forced}"

        rows.append([text(r.host), text(r.status, style=STATUS_STYLE.get(r.status)), text(d.get("change_id")),
                     *map(text, tolerant(lambda detail=detail: [detail()], 1))])
    grid("rollback", ["host", "status", "change", "detail"], rows, console)


def render_recover(results: list[HostResult], console: Console) -> None:
    """Per-host outcome of `fleetctl recover`: each pending change undone (a container's named by
    its install) and what happened to each of its files."""
    rows = []
    for r in results:
        d = r.data or {}

        def cells(d=d, r=r):
            done = d.get("recovered") or []
            changes = "\n".join(f"{c['change_id']} -> {c['state']}" + (f" (in {c['install']})" if c.get("install") else "")
                                for c in done) or "nothing pending"
            files = "\n".join(f"{f['path']}: {f['action']}" for c in done for f in c.get("files") or [])
            return [changes, files or r.error or ""]

        rows.append([text(r.host), text(r.status, style=STATUS_STYLE.get(r.status)), *map(text, tolerant(cells, 2))])
    grid("recover", ["host", "status", "change", "files"], rows, console)


def render_apply(results: list[HostResult], console: Console, diff: bool, check: bool,
                 title: str | None = None) -> None:
    """Per-host outcome of a playbook run; with `diff`, unified diffs coalesced across hosts."""
    if diff:
        diffs = coalesce((r.host, "".join(f["diff"] for f in r.data["plan"]["files"]))
                         for r in results if r.data.get("plan") and r.data["plan"]["files"])
        for hosts, diff_text in diffs:
            console.rule(text(f"diff — {host_list(hosts)}"))
            console.print(text(diff_text), highlight=False, soft_wrap=True)
    rows = []
    for r in results:
        plan = r.data.get("plan") or {}
        v = r.data.get("validation") or {}
        val = (gate_status(v) + (" (token drift allowed)" if v.get("token_drift") else "")
               + (f"; gate: {v['gate']}" if v.get("gate") else ""))
        rows.append((r.host, (r.status, len(plan.get("edits", [])), len(plan.get("left_alone", [])),
                              val, r.error or r.data.get("skipped_reason") or r.data.get("commit_note") or "")))
    grid(title or ("check mode: nothing was changed" if check else "apply"),
         ["hosts", "status", "edits", "left alone", "validation", "detail"],
         [[text(host_list(hosts)), text(status, style=STATUS_STYLE.get(status)), text(edits), text(left), text(val),
           text(detail)] for hosts, (status, edits, left, val, detail) in coalesce(rows)], console)


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
    rows = []
    for r in results:
        d = r.data or {}
        if "changes" not in d:  # unreachable or failed before the ledger was read: nothing is known
            unknown = text(f"unknown ({r.status})", style=STATUS_STYLE.get(r.status))
            rows.append([text(r.host), unknown] + [text("")] * 5)
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

        rows.append([text(r.host), *map(text, tolerant(cells, 6))])
    grid("fleetctl status", ["host", "sglang", "applied changes", "kernels", "drift", "modified outside fleetctl",
                             "space used"], rows, console, show_lines=True)
    render_problems(results, console)


def render_deploy(results: list[HostResult], console: Console) -> None:
    """Per-host outcome of a kernel deploy: backend/arch, build key, built or reused, the active
    build (check mode: would build or reuse, the build active now, and why that backend), what its
    dispatch table routes (check mode: the table it would write), validation."""
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
                              routes, gate_status(d.get("validation") or {}),
                              r.error or d.get("commit_note") or (d.get("why") if d.get("check") else "") or "")))
    grid("deploy kernel", ["hosts", "status", "backend", "build", "active", "dispatch", "validation", "detail"],
         [[text(host_list(hosts)), text(status, style=STATUS_STYLE.get(status)), text(backend), text(built),
           text(active), text(routes), text(val), text(detail)]
          for hosts, (status, backend, built, active, routes, val, detail) in coalesce(rows)], console)


def render_hosts(docs: list[dict], console: Console) -> None:
    """Print `fleetctl hosts`: one row per host (reach.describe entries: kind, address, port,
    user, identity files, jump chain, host key name), then each host's known_hosts lines that
    apply, then the hosts whose resolution was refused. Every value is printed as text (no Rich
    markup is read from it)."""
    rows = []
    for d in (d for d in docs if not d["error"]):
        jump = " -> ".join(d["jump"]) or (f"ProxyCommand {d['proxy_command']}" if d["proxy_command"] else "direct")
        rows.append([Text(str(v if v is not None else "")) for v in (
            d["host"], d["connection"], d["address"], d["port"], d["user"], "\n".join(d["identity_files"]), jump,
            d["host_key_name"])])
    grid("fleetctl hosts", ["host", "connection", "address", "port", "user", "identity files", "jump",
                            "host key name"], rows, console, show_lines=True)
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


