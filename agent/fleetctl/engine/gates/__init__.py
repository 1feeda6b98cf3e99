"""The validation gates: what a change must pass after it is written, one interface for all.

A gate has a `name` (its key in the change's result data: "validation", "load_gate",
"route_gate"), takes its `baseline` right before the change is written and `judge`s the change
against it after the change's handlers ran. The change engine (engine/changes.py) runs the
gates a `Change` carries (`Change.gates`, armed by apply and deploy) in two loops:

    take_baselines(ctx, gates, run)   before the write: each gate's baseline, in order; None
                                      leaves a gate out (nothing to judge on this host); a
                                      baseline that fails raises HostFailed (the host is
                                      refused, nothing changed)
    judge(ctx, result, armed, run, restarted)
                                      after the handlers: each armed gate's verdict into
                                      result.data[name], in order, until one fails; one rule
                                      for a change that restarted nothing (NOT_RESTARTED)

The gates: smoke.py (greedy tokens and latency of a short decode, before and after), load.py
(SGLang's own benchmark client, before and after), route.py (a routed kernel serves every rank
and changes no token). Adding a gate is a module here (a class with `name`, `baseline`, `judge`)
with its probe (probes/traffic/), an entry in the lists apply and deploy arm, and its table in
report/gates.py's GATES.

Check and GateResult are every gate's verdict: checks (name, target, passed, detail) and a
status (vocab.GateStatus) with, for a skipped gate, its reason.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from ...config import ROLLBACK_RESERVE_S
from ...vocab import GateStatus
from ..context import HostContext, HostResult
from ..validate import SmokeOptions

SMOKE = "validation"  # the smoke gate's name; a change with no gate to run says so under it
NO_SERVER = "no server"  # why a gate with nothing to judge is skipped
# why every gate that judges a server is skipped when the change ran no handler: without a
# restart the server still runs the old code, so its answers prove nothing
NOT_RESTARTED = "not restarted: no fleetctl_restart_cmd"


@dataclass
class Check:
    """One gate check. name: what was checked (the smoke gate's baseline | server | decode |
    tokens | latency | offline | health, the load gate's load-*, the route gate's route.CHECKS);
    target: "host:port" or "offline"; detail: what was compared, with both values."""
    name: str
    target: str
    passed: bool
    detail: str


@dataclass
class GateResult:
    """A gate's verdict: status passed | failed | skipped (reason: why, for skipped only);
    checks; message (the failed checks, else all, as text); token_drift (tokens differed and
    --allow-token-drift let them). Roll back only when `failed`."""
    status: GateStatus
    checks: list[Check] = field(default_factory=list)
    message: str = ""
    token_drift: bool = False
    reason: str | None = None

    @property
    def passed(self) -> bool:
        return self.status == GateStatus.PASSED

    @property
    def failed(self) -> bool:
        return self.status == GateStatus.FAILED

    @property
    def skipped(self) -> bool:
        return self.status == GateStatus.SKIPPED

    def to_dict(self) -> dict:
        """{status, reason (a skipped gate's only), checks, message, token_drift}: the result data's shape."""
        d = asdict(self)
        reason = d.pop("reason")
        return {"status": d.pop("status"), **({"reason": reason} if reason else {}), **d}


def verdict(checks: list[Check], token_drift: bool = False) -> GateResult:
    """The GateResult of `checks`: failed when any failed, else passed; its message names each
    failed check ("TARGET NAME FAILED: DETAIL", "; "), or every check when none failed."""
    failed = [c for c in checks if not c.passed]
    message = "; ".join(f"{c.target} {c.name} {'passed' if c.passed else 'FAILED'}: {c.detail}"
                        for c in failed or checks)
    return GateResult(GateStatus.FAILED if failed else GateStatus.PASSED, checks, message, token_drift)


def skipped(reason: str) -> dict:
    """The result data of a gate that did not judge: {"status": "skipped", "reason": reason}."""
    return {"status": GateStatus.SKIPPED, "reason": reason}


@dataclass(frozen=True)
class GateRun:
    """What every gate of one change on one host is given. facts: the change's (its servers,
    their interpreter); targets: validate.smoke_targets of them (the servers the gates send
    traffic to; their pids as the probes see them); smoke: the command's SmokeOptions (while
    judging: with the health wait the change's handlers ask for); reserve: seconds of the
    host's deadline each probe run leaves for a rollback."""

    facts: dict
    targets: list[dict]
    smoke: SmokeOptions
    reserve: float = ROLLBACK_RESERVE_S


class Gate(Protocol):
    """A validation gate (the module docstring). `name` is its key in the result data."""

    name: str

    def baseline(self, ctx: HostContext, run: GateRun, taken: dict[str, Any]) -> Any | None:
        """Right before the change: this gate's baseline, or None when it has nothing to judge on
        this host; `taken`: the baselines of the gates before it, by name. Raises HostFailed
        when the baseline fails (a change could only fail this gate), RemoteTimeout,
        ProbeFailed, Unreachable."""

    def judge(self, ctx: HostContext, run: GateRun, baseline: Any) -> tuple[dict, list[str]]:
        """After the change's handlers: (result data[name], [problem] or []). Raises
        RemoteTimeout, ProbeFailed, HostFailed, Unreachable."""

    def unrestarted(self, baseline: Any) -> Any | None:
        """What of `baseline` can still be judged when the change ran no handler (the server
        was not restarted): `baseline` itself when none of it came from a server, a part of it,
        or None (here: nothing, the gate judges servers only)."""
        return None


def decoded(taken: dict[str, Any]) -> bool:
    """Whether the smoke gate's baseline among `taken` decoded a server: a gate that sends a
    server traffic arms only then."""
    return bool((taken.get(SMOKE) or {}).get("servers"))


def take_baselines(ctx: HostContext, gates: list[Gate], run: GateRun) -> list[tuple[Gate, Any]]:
    """Each gate's baseline, in the list's order, before a change: [(gate, baseline)] of the
    gates that have something to judge. Raises what Gate.baseline raises."""
    taken: dict[str, Any] = {}
    armed = []
    for gate in gates:
        base = gate.baseline(ctx, run, taken)
        if base is not None:
            taken[gate.name] = base
            armed.append((gate, base))
    return armed


def judge(ctx: HostContext, result: HostResult, armed: list[tuple[Gate, Any]], run: GateRun,
          restarted: bool) -> list[str]:
    """Judge a written change: each armed gate (take_baselines') in order, its verdict set as
    result.data[gate.name], until one reports a problem; returns the problems. With no gate
    armed, result.data[SMOKE] says skipped (NO_SERVER). The one rule for a change that ran no
    handler (`restarted` False): every armed gate's entry says skipped (NOT_RESTARTED) first,
    and only what of its baseline needs no restart (Gate.unrestarted) is judged. Raises what
    Gate.judge raises."""
    if not armed:
        result.data[SMOKE] = skipped(NO_SERVER)
        return []
    if not restarted:
        kept = []
        for gate, base in armed:
            rest = gate.unrestarted(base)
            if rest is not base:
                result.data[gate.name] = skipped(NOT_RESTARTED)
            if rest is not None:
                kept.append((gate, rest))
        armed = kept
    problems: list[str] = []
    for gate, base in armed:
        result.data[gate.name], failed = gate.judge(ctx, run, base)
        problems += failed
        if problems:
            break
    return problems
