"""Gather facts (Ansible's gather_facts): the inspect job run on every host.

One round trip per host: the `facts` probe, bundled with its helpers, runs on the host's own
interpreter, finds the servers and the installs they run from (each asked of its own interpreter),
and returns facts, installs, and the primary install's allocator call sites and need_sort
origins (see probes/facts.py, probes/procs.py, probes/locate.py, probes/callsites.py).
"""

from __future__ import annotations

from typing import TypedDict

from . import containers
from .. import probes
from ..errors import HostFailed, ProbeFailed
from .context import HostContext, HostResult
from ..vocab import HostStatus



def gather(ctx: HostContext, with_sources: bool = False, scan: bool = True, records: str | None = None,
           cache: bool = True) -> dict:
    """Inspect one host. Returns {"facts", "installs", "allocator_call_sites", "need_sort_origins",
    "scan"} (the last three of the primary install; + "sources": {file relative to the install's
    location: text} of files with need_sort origins, per install and for the primary, when
    `with_sources`; no call sites or origins when not `scan`). `cache`: use and refresh the
    host's scan cache (probes/scancache.py; False: rescan every file). Containers whose servers
    the host shows (facts.containers) are entered (containers.how_to_enter) and their installs
    and servers added (containers.adopt); one that cannot be entered keeps the reason in its
    facts.containers entry ("error"). On a context inside a container, only that container's
    installs (its own scan cache inside it). `records`: the state dir whose host-side container
    change records to read too ("container_records"). Raises ProbeFailed, RemoteTimeout,
    Unreachable, HostFailed (a bad fleetctl_container_exec; the inventory's interpreter, whose
    site files the facts probe refused to start it with: probes/trust.py untrusted)."""
    key = probes.sources_sha256(probes.modules_for("facts")) if cache else None
    if ctx.container is not None:
        inner = ctx.probe("facts", {"python": None, "scan": scan, "with_sources": with_sources, "containers": False,
                                    "cache_key": key, "inside": True})
        if inner.get("refused"):
            raise HostFailed(inner["refused"])
        mine = containers.adopt(inner, ctx)
        return {**inner, "installs": mine["installs"], "facts": {**inner["facts"], "servers": mine["servers"]}}
    params = {"python": ctx.host.python, "scan": scan, "with_sources": with_sources, "cache_key": key}
    if records:
        params["records"] = f"{records}/{containers.RECORDS}"
    g = ctx.probe("facts", params)
    refused = [c for c in g["facts"].get("interpreter_discovery", {}).get("considered", [])
               if c.get("reason") == "inventory" and c.get("skipped")]
    if refused:
        raise HostFailed(f"interpreter {refused[0]['python']} refused: {refused[0]['skipped']} (fleetctl runs it as root)")
    for found in g["facts"].get("containers", []):
        how, note = containers.how_to_enter(ctx.host, found, g["facts"].get("runtime_clis") or {})
        found.update(entered_with=how, note=note, error=None)
        if how is None:
            continue
        try:
            inner = gather(containers.enter(ctx, found, how), with_sources=with_sources, scan=scan, cache=cache)
        except (ProbeFailed, HostFailed) as e:
            found["error"] = f"entering {containers.prefix(found['root'])} with {how}: {e}"
            continue
        g["installs"] = g.get("installs", []) + inner["installs"]
        g["facts"]["servers"] = g["facts"]["servers"] + inner["facts"]["servers"]
    return g


def install_errors(g: dict) -> list[str]:
    """"<install id>: <error>" for each install whose scan failed (its package directory was not
    found): gathered facts that must not pass for an empty scan."""
    return [f"{i['id']}: {i['scan']['error']}" for i in g.get("installs", []) if (i.get("scan") or {}).get("error")]


def install_facts(g: dict, inst: dict | None) -> dict:
    """The host's facts as seen from install `inst`: its sglang, python, torch and the servers
    that run from it (the host's facts unchanged when `inst` is None)."""
    if inst is None:
        return g["facts"]
    return {**g["facts"], "sglang": inst["sglang"], "python": inst["python"], "torch": inst["torch"],
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
    allocator_call_sites: list
    need_sort_origins: list
    scan: dict
    timing: dict


def inspect_job(ctx: HostContext, cache: bool = True) -> HostResult:
    """The `inspect` job: gather() (`cache`: see there) + timing (HostContext.timing); a host
    with an install whose scan failed is failed, with that reason, and keeps its facts."""
    g: InspectData = gather(ctx, cache=cache)
    g["timing"] = ctx.timing
    errors = install_errors(g)
    if errors:
        return ctx.result(HostStatus.FAILED, "; ".join(errors), data=g)
    return ctx.result(HostStatus.OK, None, data=g)


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
    """The `cache clear` job: empty the host's scan cache directory (probes/scancache.py main).
    data: {cache: {path, removed (files), error}}."""
    res = ctx.probe("scancache", {"action": "clear"})
    status = HostStatus.FAILED if res.get("error") else HostStatus.CHANGED if res["removed"] else HostStatus.OK
    return ctx.result(status, res.get("error"), data={"cache": res})

