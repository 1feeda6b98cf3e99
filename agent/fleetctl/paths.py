"""Where fleetctl finds its playbooks and kernel packages on the operator's machine."""

from __future__ import annotations

import os
from pathlib import Path

from .errors import ParseError

_REPO = Path(__file__).resolve().parents[2]


def project_dir(kind: str) -> Path:
    """The directory of `kind` ("playbooks" or "kernels"): $FLEETCTL_<KIND>_DIR, else ./<kind>
    when it exists, else the one shipped beside the fleetctl package."""
    env = os.environ.get(f"FLEETCTL_{kind.upper()}_DIR")
    if env:
        return Path(env)
    local = Path.cwd() / kind
    return local if local.is_dir() else _REPO / kind


def find_playbook(name: str) -> Path:
    """A playbook by path, or by name in the playbooks directory (NAME or NAME.yaml).
    Raises ParseError (exit 4, like a missing inventory) when there is none."""
    p = Path(name)
    if p.suffix in (".yaml", ".yml") and p.exists():
        return p
    d = project_dir("playbooks")
    for cand in (d / f"{name}.yaml", d / f"{name}.yml"):
        if cand.exists():
            return cand
    known = sorted(x.stem for x in d.glob("*.y*ml"))
    raise ParseError(f"no playbook {name!r} in {d} (playbooks there: {', '.join(known) or 'none'})")
