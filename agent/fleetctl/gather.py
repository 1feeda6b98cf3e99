"""Gather facts (Ansible's gather_facts): the inspect job run on every host.

One round trip per host: the `facts` probe, bundled with its helpers, runs on the host's own
interpreter, finds the servers and the installs they run from (each asked of its own interpreter),
and returns facts, installs, and the primary install's allocator call sites and need_sort
origins (see probes/facts.py, probes/procs.py, probes/locate.py, probes/callsites.py).
"""

from __future__ import annotations

from . import probes
from .fleet import HostContext, HostFailed, HostResult
from .vocab import HostStatus

PROBE_MODULES = probes.FACTS_MODULES


def gather(ctx: HostContext, with_sources: bool = False, scan: bool = True, cache: bool = True) -> dict:
    """Inspect one host. Returns {"facts", "installs", "allocator_call_sites", "need_sort_origins",
    "scan"} (the last three of the primary install; + "sources": {file relative to the install's
    location: text} of files with need_sort origins, per install and for the primary, when
    `with_sources`; no call sites or origins when not `scan`). `cache`: use and refresh the host's
    scan cache (probes/scancache.py; False: rescan every file). Raises ProbeError, RemoteTimeout,
    Unreachable."""
    params = {"python": ctx.host.python, "scan": scan, "with_sources": with_sources,
              "cache_key": probes.sources_sha256(PROBE_MODULES) if cache else None}
    return ctx.probe("facts", params, modules=PROBE_MODULES)


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


def inspect_job(ctx: HostContext, cache: bool = True) -> HostResult:
    """The `inspect` job: gather() (`cache`: see there) + timing (HostContext.timing); a host
    with an install whose scan failed is failed, with that reason, and keeps its facts."""
    g = gather(ctx, cache=cache)
    g["timing"] = ctx.timing
    errors = install_errors(g)
    if errors:
        return ctx.result(HostStatus.FAILED, "; ".join(errors), data=g)
    return ctx.result(HostStatus.OK, None, data=g)


def cache_clear_job(ctx: HostContext) -> HostResult:
    """The `cache clear` job: empty the host's scan cache directory (probes/scancache.py main).
    data: {cache: {path, removed (files), error}}."""
    res = ctx.probe("scancache", {"action": "clear"}, modules=["scancache"])
    status = HostStatus.FAILED if res.get("error") else HostStatus.CHANGED if res["removed"] else HostStatus.OK
    return ctx.result(status, res.get("error"), data={"cache": res})

