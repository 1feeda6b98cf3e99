"""The `--json` documents: the envelope every one carries, and inspect's host entries (the shape
scripts read).
"""

from __future__ import annotations

from ..engine.context import HostResult

# The version of the `--json` documents' shape: raised when a key is removed or changes meaning
# (added keys keep it).
SCHEMA_VERSION = 1


def envelope(doc: dict, exit_code: int, run_id: str | None) -> dict:
    """`doc` (a command's `--json` document) with the keys every one carries first:
    schema_version (SCHEMA_VERSION), run_id (the run's id in the history, as `history show`
    takes it; None for a command or run not recorded: --no-history, an unusable history, a
    command that is no run) and exit_code (the command's exit status for these results)."""
    return {"schema_version": SCHEMA_VERSION, "run_id": run_id, "exit_code": exit_code, **doc}


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
