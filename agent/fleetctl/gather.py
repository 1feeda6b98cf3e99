"""Gather facts (Ansible's gather_facts): the inspect job run on every host.

One round trip per host: the `facts` probe, bundled with `callsites`, runs on the host's own
interpreter, finds the interpreter that runs SGLang, and returns facts, allocator call sites and
need_sort origins (see probes/facts.py and probes/callsites.py for the sources of each fact).
"""

from __future__ import annotations

from .fleet import HostContext

PROBE_MODULES = ["redact", "callsites", "facts"]


def gather(ctx: HostContext, with_sources: bool = False, scan: bool = True) -> dict:
    """Inspect one host. Returns {"facts", "allocator_call_sites", "need_sort_origins", "scan"}
    (+ "sources": {file relative to site-packages: text} of files with need_sort origins when
    `with_sources`; no call sites or origins when not `scan`). Raises ProbeError, RemoteTimeout,
    Unreachable."""
    params = {"python": ctx.host.python, "scan": scan, "with_sources": with_sources}
    return ctx.probe("facts", params, modules=PROBE_MODULES)
