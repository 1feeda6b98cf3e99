"""The gate interface (engine/gates/__init__.py): baselines taken in order, a gate that talks to
servers armed only where the smoke decode found one, the gates judged in order until one fails,
the one rule for a change that restarted nothing, and a skipped gate's reason beside its status
word (the terminal shows "skipped (REASON)" as before)."""

from __future__ import annotations

import io
from dataclasses import dataclass, field

from rich.console import Console

from fleetctl.engine.context import HostResult
from fleetctl.engine.gates import (NO_SERVER, NOT_RESTARTED, SMOKE, Gate, GateRun, decoded, judge, skipped,
                                   take_baselines)
from fleetctl.engine.gates.smoke import SmokeGate
from fleetctl.engine.validate import SmokeOptions
from fleetctl.report import gates as report
from fleetctl.report.text import gate_status
from fleetctl.vocab import HostStatus

RUN = GateRun({}, [], SmokeOptions())
SERVER = {"host": "127.0.0.1", "port": 30000, "ok": True}


@dataclass
class Fake(Gate):
    """A gate as data: its baseline (None: nothing to judge; a callable gets `taken`), its verdict's
    problems, and what it was asked."""

    name: str
    base: object = "b"
    problems: list = field(default_factory=list)
    judged: list = field(default_factory=list)

    def baseline(self, ctx, run, taken):
        return self.base(taken) if callable(self.base) else self.base

    def judge(self, ctx, run, baseline):
        self.judged.append(baseline)
        return {"status": "failed" if self.problems else "passed", "of": baseline}, list(self.problems)


def smoke_fake() -> Fake:
    """A Fake under the smoke gate's name whose unrestarted is the smoke gate's."""
    fake = Fake(SMOKE)
    fake.unrestarted = SmokeGate.unrestarted.__get__(fake)
    return fake


def result() -> HostResult:
    return HostResult("h", "a", HostStatus.CHANGED, data={})


def test_baselines_are_taken_in_order_and_a_server_gate_arms_only_after_a_decoded_server():
    first = Fake(SMOKE, base={"servers": [SERVER], "offline": None})
    seen = []
    after = Fake("after", base=lambda taken: seen.append(dict(taken)) or ("armed" if decoded(taken) else None))
    armed = take_baselines(None, [first, Fake("none", base=None), after], RUN)
    assert [(g.name, b) for g, b in armed] == [(SMOKE, first.base), ("after", "armed")]
    assert seen == [{SMOKE: first.base}]  # a gate sees the baselines before it, not the ones it left out
    nothing = Fake(SMOKE, base={"servers": [], "offline": {"ok": True}})
    assert [g.name for g, _ in take_baselines(None, [nothing, Fake("after", base=lambda t: decoded(t) or None)], RUN)] \
        == [SMOKE]


def test_the_gates_are_judged_in_order_until_one_fails():
    a, b, c = Fake(SMOKE), Fake("b", problems=["b failed"]), Fake("c")
    r = result()
    assert judge(None, r, [(a, 1), (b, 2), (c, 3)], RUN, restarted=True) == ["b failed"]
    assert (a.judged, b.judged, c.judged) == ([1], [2], [])
    assert r.data == {SMOKE: {"status": "passed", "of": 1}, "b": {"status": "failed", "of": 2}}


def test_no_gate_to_run_says_so_under_the_smoke_gates_name():
    r = result()
    assert judge(None, r, [], RUN, restarted=False) == [] and r.data == {SMOKE: skipped(NO_SERVER)}
    assert r.data[SMOKE] == {"status": "skipped", "reason": "no server"}


def test_a_change_that_restarted_nothing_skips_what_needs_a_restart_and_judges_the_rest():
    """The one rule: every armed gate says skipped (not restarted) first; what of its baseline
    needs no restart (the smoke gate's offline check) is judged after, over that entry."""
    smoke_base = {"servers": [SERVER], "refused": [], "offline": {"ok": True, "cmd": "true"}}
    smoke, load = smoke_fake(), Fake("load_gate", problems=["never judged"])
    r = result()
    assert judge(None, r, [(smoke, smoke_base), (load, [1])], RUN, restarted=False) == []
    assert smoke.judged == [{"servers": [], "offline": smoke_base["offline"]}] and load.judged == []
    assert r.data == {SMOKE: {"status": "passed", "of": {"servers": [], "offline": smoke_base["offline"]}},
                      "load_gate": {"status": "skipped", "reason": NOT_RESTARTED}}
    # without an offline check nothing is judged; with servers restarted everything is
    assert SmokeGate().unrestarted({"servers": [SERVER], "offline": None}) is None
    offline_only = {"servers": [], "offline": {"ok": True}}
    assert SmokeGate().unrestarted(offline_only) is offline_only  # nothing from a server: judged as it is
    r = result()
    judge(None, r, [(smoke_fake(), offline_only)], RUN, restarted=False)
    assert r.data == {SMOKE: {"status": "passed", "of": offline_only}}


def test_a_skipped_gate_shows_its_reason_as_the_status_sentence_it_replaced():
    assert gate_status({"status": "skipped", "reason": NOT_RESTARTED}) == \
        "skipped (not restarted: no fleetctl_restart_cmd)"
    assert gate_status({"status": "passed"}) == "passed" and gate_status({}) == ""
    assert gate_status({"status": "skipped (no server)"}) == "skipped (no server)"  # a record of an earlier run
    out = io.StringIO()
    r = HostResult("here", "local", HostStatus.CHANGED, data={"load_gate": skipped(NOT_RESTARTED),
                                                              "route_gate": skipped(NOT_RESTARTED)})
    report.render_gates([r], Console(file=out, width=200))
    assert out.getvalue().splitlines() == ["here: load gate skipped (not restarted: no fleetctl_restart_cmd)",
                                           "here: route gate skipped (not restarted: no fleetctl_restart_cmd)"]
    assert [key for key, _, _ in report.GATES] == [SMOKE, "load_gate", "route_gate"]
