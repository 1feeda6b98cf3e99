"""A host's ledger (probes/change/ledger.py: ledger.jsonl, one JSON entry per line) as tests read
it: the last state of each change id."""

from __future__ import annotations

import json
from pathlib import Path

LEDGER = "/var/lib/fleetctl/ledger.jsonl"


def last_states(text: str) -> dict[str, str]:
    """{change id: its last state} of ledger.jsonl's text (later lines win)."""
    return {e["change_id"]: e["state"] for e in map(json.loads, text.splitlines())}


def in_dir(state: Path) -> dict[str, str]:
    """last_states of STATE/ledger.jsonl ({} when there is none)."""
    path = Path(state) / "ledger.jsonl"
    return last_states(path.read_text()) if path.exists() else {}


def over_ssh(lab, host: str) -> dict[str, str]:
    """last_states of `host`'s ledger, read over the lab's SSH (the CLI's reading of it is
    checked where it matters, with `fleetctl status`)."""
    r = lab.ssh(host, f"cat {LEDGER} 2>/dev/null || true")
    assert r.returncode == 0, r.stderr
    return last_states(r.stdout)


def from_lab(lab, host: str) -> dict[str, str]:
    """last_states of `host`'s ledger read from the control side: the lab host's private
    /var/lib/fleetctl (lab/base.py PRIVATE_DIRS) under the lab's state dir."""
    from fleetctl.lab import base

    return in_dir(lab.state_dir / "hosts" / host / base.PRIVATE_DIRS["/var/lib/fleetctl"])
