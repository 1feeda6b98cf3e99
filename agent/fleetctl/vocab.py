"""One vocabulary: every status word fleetctl prints, reports or writes in `--json`.

Each enum is a `str` enum, so a member *is* its word: `HostStatus.OK == "ok"`, and JSON, Rich
text and f-strings show the word itself. The host-side probes (stdlib only) keep their own string
constants; `tests/unit/test_engine.py` checks that the words here equal theirs.
"""

from __future__ import annotations

from enum import Enum


class _Word(str, Enum):
    """A str enum that formats as its value (enum.StrEnum, which Python 3.10 lacks)."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class HostStatus(_Word):
    """A host's outcome in every command's table, recap line and `--json` ("status")."""

    OK = "ok"
    CHANGED = "changed"
    SKIPPED = "skipped"
    FAILED = "failed"
    UNREACHABLE = "unreachable"
    NOT_ATTEMPTED = "not attempted"


# Statuses listed among the problems (and that make a command exit non-zero).
PROBLEM_STATUSES = (HostStatus.FAILED, HostStatus.UNREACHABLE, HostStatus.NOT_ATTEMPTED)


class PlanStatus(_Word):
    """A plan's verdict (plan.HostPlan.status); `host_status` maps it to a HostStatus."""

    CHANGE = "change"
    OK = "ok"
    SKIPPED = "skipped"
    FAILED = "failed"

    @property
    def host_status(self) -> HostStatus:
        """The host status a plan with this verdict reports: CHANGE -> CHANGED, else the same word."""
        return HostStatus.CHANGED if self is PlanStatus.CHANGE else HostStatus(self.value)


class InstallStatus(_Word):
    """An install seen on a host but not inspected ("status" of an entry of `not_inspected` in
    inspect's report: its interpreter was not run, or not answered, or its container not
    entered; the entry's "reason" says which). Listed by inspect (exit 0); apply, deploy and
    validate fail the host that needs it (exit 2)."""

    NOT_INSPECTED = "not_inspected"


class GateStatus(_Word):
    """A gate's verdict on a change ("validation", "load_gate", "route_gate": {"status": ...} in
    results); a skipped gate says why in its "reason" beside it (engine/gates: NO_SERVER,
    NOT_RESTARTED), shown as "skipped (REASON)"."""

    PASSED = "passed"
    FAILED = "failed"
    SKIPPED = "skipped"


class ChangeState(_Word):
    """A change's state in the host's ledger (probes/change/ledger.py, last ledger line wins)."""

    PENDING = "pending"          # written, not yet validated (or a run was killed): undone by recover
    APPLIED = "applied"          # validated and committed
    ROLLED_BACK = "rolled-back"  # restored byte-identical
    FAILED = "failed"            # a write or restore stopped half-way; see its reason
    SUPERSEDED = "superseded"    # its release was replaced by an upgrade; dropped by `rollback --forget`
