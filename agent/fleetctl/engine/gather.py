"""Gather facts (Ansible's gather_facts): the inspect job run on every host.

One round trip per host: the `facts` probe, bundled with its helpers, runs on the host's own
interpreter, finds the servers and the installs they run from (each asked of its own interpreter),
and returns facts, installs, and the primary install's allocator call sites and need_sort
origins (see probes/facts/host.py, probes/facts/procs.py, probes/facts/locate.py, probes/facts/callsites.py).
"""

from __future__ import annotations

import time
from typing import TypedDict

from . import containers
from .. import probes
from ..config import DEFAULT_SGLANG_PORT, PROBE_SLACK_S
from ..connection import RemoteTimeout, command
from ..errors import HostFailed, ProbeFailed
from .context import HostContext, HostResult
from ..vocab import HostStatus, InstallStatus

# what a restarted server's successor must share with it (probes/facts/targets.py live): its
# effective uid, and its systemd service or its parent; the facts of each server carry them
SUCCESSION = ("uid", "unit", "ppid")


def gather(ctx: HostContext, with_sources: bool = False, scan: bool = True, records: str | None = None,
           cache: bool = True) -> dict:
    """Inspect one host. Returns {"facts", "installs", "allocator_call_sites", "need_sort_origins",
    "scan"} (the last three of the primary install; + "sources": {file relative to the install's
    location: text} of files with need_sort origins, per install and for the primary, when
    `with_sources`; no call sites or origins when not `scan`). `cache`: use and refresh the
    host's scan cache (probes/facts/scancache.py; False: rescan every file). Containers whose servers
    the host shows (facts.containers) are entered (containers.how_to_enter) and their installs
    and servers added (containers.adopt); one that cannot be entered keeps the reason in its
    facts.containers entry ("error"). On a context inside a container, only that container's
    installs (its own scan cache inside it). `records`: the state dir whose host-side container
    change records to read too ("container_records"). Raises ProbeFailed, RemoteTimeout,
    Unreachable, HostFailed (a bad fleetctl_container_exec; the inventory's interpreter, which
    is not executable)."""
    ctx.phase("gather")
    key = probes.sources_sha256(probes.modules_for("facts.host")) if cache else None
    if ctx.container is not None:
        inner = ctx.probe("facts.host", {"python": None, "scan": scan, "with_sources": with_sources, "containers": False,
                                         "cache_key": key, "inside": True, "deadline_s": ctx.remaining(),
                                         "unprivileged_user": ctx.host.unprivileged_user})
        if inner.get("refused"):
            raise HostFailed(inner["refused"])
        mine = containers.adopt(inner, ctx)
        return {**inner, "installs": mine["installs"], "facts": {**inner["facts"], "servers": mine["servers"]}}
    # deadline_s: the host tools the probe runs (nvidia-smi, systemctl, a runtime's inspect) end
    # within the host's deadline, a stuck one named in the facts (probes/bounded.py)
    params = {"python": inventory_python(ctx), "scan": scan, "with_sources": with_sources, "cache_key": key,
              "unprivileged_user": ctx.host.unprivileged_user, "deadline_s": ctx.remaining()}
    if records:
        params["records"] = f"{records}/{containers.RECORDS}"
    g = ctx.probe("facts.host", params)
    refused = [c for c in g["facts"].get("interpreter_discovery", {}).get("considered", [])
               if c.get("reason") == "inventory" and c.get("skipped")]
    if refused:
        raise HostFailed(f"interpreter {refused[0]['python']}: {refused[0]['skipped']}")
    found_all = g["facts"].get("containers", [])
    for found in found_all:
        how, note = containers.how_to_enter(ctx.host, found, g["facts"].get("runtime_clis") or {})
        found.update(entered_with=how, note=note, error=None)
    to_enter = [f for f in found_all if f["entered_with"]]
    for k, found in enumerate(to_enter):
        how = found["entered_with"]
        # each container's probe on its own bound: an equal share of the host's time left, one
        # share kept for the host's own work after (a hung runtime exec costs that container only)
        share = ctx.remaining() / (len(to_enter) - k + 1)
        t0 = time.monotonic()
        try:
            inner = gather(containers.enter(ctx, found, how, within=share), with_sources=with_sources, scan=scan,
                           cache=cache)
        except (ProbeFailed, HostFailed) as e:
            found["error"] = f"entering {containers.prefix(found['root'])} with {how}: {e}"
            continue
        except RemoteTimeout:
            found["error"] = (f"entering {containers.prefix(found['root'])} with {how}: {containers.exec_name(how)} "
                              f"hung: no answer in {time.monotonic() - t0:.0f} s")
            continue
        g["installs"] = g.get("installs", []) + inner["installs"]
        g["facts"]["servers"] = g["facts"]["servers"] + inner["facts"]["servers"]
    return g


def inventory_python(ctx: HostContext) -> str | None:
    """The inventory's interpreter (Host.interpreter) as the path the facts probe asks: its
    absolute path, or the path the name resolves to on the host's PATH (probes.which: one more
    command, only for a name such as `/usr/bin/env python3`'s); the name itself when it resolves
    to nothing (the probe's start then fails the host, saying so). None: the inventory names none.
    The lookup's reply is found after its marker (command.framed): a login shell's banner is not a path.
    Raises RemoteTimeout, Unreachable."""
    python, _ = ctx.host.interpreter or (None, ())
    if python is None or python.startswith("/"):
        return python
    marker = command.reply_marker("which")
    r = ctx.run(command.framed(probes.which(python), marker), what="the interpreter's lookup on PATH")
    path = (command.reply(r.stdout, marker) or b"").decode("utf-8", "replace").strip()
    return path if r.ok and path.startswith("/") and "\n" not in path else python


def install_errors(g: dict) -> list[str]:
    """"<install id>: <error>" for each install whose scan failed (its package directory was not
    found): gathered facts that must not pass for an empty scan."""
    return [f"{i['id']}: {i['scan']['error']}" for i in g.get("installs", []) if (i.get("scan") or {}).get("error")]


def install_facts(g: dict, inst: dict | None) -> dict:
    """The host's facts as seen from install `inst`: its sglang, python, torch, the servers
    that run from it and the other processes that use it (in_use: probes/facts/inuse.py; None
    when the host did not say) (the host's facts unchanged when `inst` is None)."""
    if inst is None:
        return g["facts"]
    return {**g["facts"], "sglang": inst["sglang"], "python": inst["python"], "torch": inst["torch"],
            "in_use": inst.get("in_use"),
            "servers": [s for s in g["facts"]["servers"] if s.get("install") == inst["id"]]}


def find_install(g: dict, install: str) -> dict:
    """The gathered install whose id is `install`. Raises HostFailed naming the host's installs."""
    for i in g.get("installs", []):
        if i["id"] == install:
            return i
    raise HostFailed(f"no install {install} on this host (installs: "
                     f"{', '.join(i['id'] for i in g.get('installs', [])) or 'none'})")


class InspectData(TypedDict, total=False):
    """`inspect` data: gather()'s document (facts: the primary install's and the host's;
    installs: one entry per install found, each with its scan; allocator_call_sites and
    need_sort_origins, scan: the primary install's) and timing (HostContext.timing: seconds,
    counts, bytes)."""

    facts: dict
    installs: list
    not_inspected: list
    allocator_call_sites: list
    need_sort_origins: list
    scan: dict
    timing: dict


def not_inspected(g: dict) -> list[dict]:
    """What gathered facts `g` saw of SGLang but did not inspect, each {"id" (None when not
    known), "status": "not_inspected", "reason", "python", "servers": [pid], "units", "user",
    "root" (a container's, or absent)}: the facts probe's own (installs whose interpreter was
    refused or did not answer: probes/facts/host.py discover), then each container or foreign process
    gather() did not enter, or failed to enter (facts.containers "note" / "error"). A container
    nothing was asked to enter (no "entered_with": the collection enters none) is left out."""
    out = list(g.get("not_inspected") or [])
    for c in g.get("facts", {}).get("containers") or []:
        if "entered_with" not in c or not (c.get("error") or c.get("entered_with") is None):
            continue
        root = c.get("root") or {}
        pids = ", ".join(map(str, c.get("servers") or [root.get("pid")]))
        where = (f"container {root.get('name') or (root.get('container_id') or '?')[:12]} ({root.get('runtime')})"
                 if c.get("kind") in ("container", "rootless") else "its own mount namespace")
        out.append({"id": None, "status": InstallStatus.NOT_INSPECTED, "python": c.get("python"),
                    "servers": list(c.get("servers") or []), "units": [], "user": None, "root": root,
                    "reason": f"install of server pid {pids} in {where} not inspected: {c.get('error') or c.get('note')}"})
    return out


def inspect_job(ctx: HostContext, cache: bool = True, replay: dict | None = None) -> HostResult:
    """The `inspect` job: gather() (`cache`: see there) + timing (HostContext.timing) + every
    install seen but not inspected (not_inspected: listed, the host stays ok); a host with an
    install whose scan failed is failed, with that reason, and keeps its facts. `replay`: the
    allocator replay's trace parameters (allocator_replay: each install gets its answer)."""
    g: InspectData = gather(ctx, cache=cache)
    g["not_inspected"] = not_inspected(g)
    if replay is not None:
        allocator_replay(ctx, g, replay)
    g["timing"] = ctx.timing
    errors = install_errors(g)
    if errors:
        return ctx.result(HostStatus.FAILED, "; ".join(errors), data=g)
    return ctx.result(HostStatus.OK, None, data=g)


def allocator_replay(ctx: HostContext, g: dict, trace: dict) -> None:
    """Replay each host install's own KV allocator with need_sort False and True (probes/traffic/allocreplay.py,
    under the install's interpreter, its deadline the host's time left, at most
    allocreplay.DEADLINE_S seconds), trace parameters `trace` (allocreplay.DEFAULTS' keys; pool
    None: the install's servers' max_total_num_tokens, asked by the probe with the inventory's
    fleetctl_sglang_port, _host and _api_key). Adds to each install of `g` "allocator_replay":
    [runs] and "allocator_replay_info": {status ("replayed", "no_need_sort", "failed",
    "not_run"), reason, classes, trace, stubbed, torch, elapsed_s}; a replay that fails is that
    install's reason, never the host's failure. Raises RemoteTimeout, Unreachable."""
    from ..probes.traffic import allocreplay

    port = ctx.host.sglang_port
    for inst in g.get("installs", []):
        info = {"status": "not_run", "reason": None, "classes": [], "trace": None, "stubbed": [], "torch": None,
                "elapsed_s": None, "ran_as": None}
        inst["allocator_replay"], inst["allocator_replay_info"] = [], info
        if not inst["id"].startswith("host:"):
            info["reason"] = "an install in a container: the replay runs on the host's own installs"
            continue
        if (inst.get("scan") or {}).get("error") or not inst["sglang"].get("package_dir"):
            info["reason"] = "its package directory was not found"
            continue
        servers = [{"pid": s["pid"], "python": s.get("python"), "port": int(s.get("port") or DEFAULT_SGLANG_PORT),
                    "host": s.get("host") or "127.0.0.1", **{k: s[k] for k in SUCCESSION if s.get(k) is not None}}
                   for s in g["facts"].get("servers", [])
                   if s.get("install") == inst["id"] and s.get("pid") is not None]
        deadline = min(allocreplay.DEADLINE_S, ctx.remaining() - 5)
        if deadline < 10:
            info["reason"] = (f"no time left for the replay ({deadline + 5:.0f} s before the host's deadline): "
                              "give a larger --timeout")
            continue
        params = {"package_dir": inst["sglang"]["package_dir"], "location": inst["sglang"]["location"],
                  "trace": trace, "servers": servers, "port": port,
                  "host": ctx.host.sglang_host if port is not None else None,
                  "api_key": ctx.host.sglang_api_key, "server_user": ctx.host.server_user, "deadline_s": deadline,
                  "unprivileged_user": ctx.host.unprivileged_user}
        try:
            res = ctx.probe("traffic.allocreplay", params, python=inst["python"]["path"],
                            timeout=deadline + PROBE_SLACK_S)
        except (ProbeFailed, HostFailed) as e:
            info.update(status="failed", reason=f"the replay probe failed: {e}")
            continue
        inst["allocator_replay"] = res.pop("runs")
        info.update(res)


def install_context(ctx: HostContext, install: str | None) -> tuple[HostContext, dict | None]:
    """(the context a job on install `install` runs in, the install when it is a container's):
    `ctx` itself for a host install or none named; for a container install (an id that does
    not start with "host:"), `ctx` entered into its container, found by a gather without a
    scan. Raises HostFailed (no such install), ProbeFailed, RemoteTimeout, Unreachable."""
    if not install or install.startswith("host:"):
        return ctx, None
    g = gather(ctx, scan=False)
    inst = find_install(g, install)
    found = next(c for c in g["facts"]["containers"] if c["root"] == inst["root"])
    return containers.enter(ctx, found, found["entered_with"]), inst


def cache_clear_job(ctx: HostContext) -> HostResult:
    """The `cache clear` job: empty the host's scan cache directory (probes/facts/scancache.py main).
    data: {cache: {path, removed (files), error}}."""
    res = ctx.probe("facts.scancache", {"action": "clear"})
    status = HostStatus.FAILED if res.get("error") else HostStatus.CHANGED if res["removed"] else HostStatus.OK
    return ctx.result(status, res.get("error"), data={"cache": res})

