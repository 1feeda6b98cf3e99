"""The validation gate as pure logic: synthetic smoke-probe results, thresholds at their boundary.

test_smoke.py drives the gate with live stand-in servers; these cases pin what those cannot
(review M2): the latency ratio at exactly `latency_tolerance`, the slack, which latency is
compared, a zero baseline, and the text the operator reads in each failure.
"""

from __future__ import annotations

import pytest

from fleetctl.engine.gates import smoke as gate
from fleetctl.vocab import GateStatus


def server(port=30000, ids=(1, 2, 3), e2e=1.0, client=2.0, ok=True, error=None, host="127.0.0.1"):
    """One server's smoke result as fleetctl.probes.traffic.smoke returns it (only the fields the gate reads)."""
    return {"host": host, "port": port, "ok": ok, "error": error, "output_ids": list(ids),
            "e2e_latency_s": e2e, "latency_s": client}


def result(*servers, offline=None):
    """A host's smoke probe result."""
    return {"servers": list(servers), "offline": offline}


def latency_check(res: gate.GateResult) -> gate.Check:
    """The only latency check of a one-server result."""
    [c] = [c for c in res.checks if c.name == "latency"]
    return c


@pytest.mark.parametrize("after_e2e, passes", [(1.0, True), (1.25, True), (1.251, False), (2.5, False),
                                               (0.5, True)])
def test_latency_boundary_at_the_default_tolerance(after_e2e, passes):
    """Default tolerance 1.25: 1.000 s -> 1.250 s passes, 1.251 s (and a 2.5x slowdown) fails."""
    res = gate.compare(result(server(e2e=1.0)), result(server(e2e=after_e2e)))
    assert res.passed is passes and res.failed is (not passes)
    assert latency_check(res).passed is passes
    assert res.status == (GateStatus.PASSED if passes else GateStatus.FAILED)


def test_latency_detail_names_both_values_and_the_ratio():
    res = gate.compare(result(server(e2e=0.2)), result(server(e2e=0.5)))
    assert latency_check(res).detail == "median e2e_latency 0.5000 s vs baseline 0.2000 s (2.50x, over 1.25x)"
    assert res.message == ("127.0.0.1:30000 latency FAILED: "
                           "median e2e_latency 0.5000 s vs baseline 0.2000 s (2.50x, over 1.25x)")
    ok = gate.compare(result(server(e2e=0.2)), result(server(e2e=0.2)), latency_tolerance=1.5)
    assert latency_check(ok).detail == "median e2e_latency 0.2000 s vs baseline 0.2000 s (1.00x, within 1.50x)"


def test_explicit_tolerance_is_used():
    base, after = result(server(e2e=1.0)), result(server(e2e=1.9))
    assert gate.compare(base, after, latency_tolerance=2.0).passed
    assert gate.compare(base, after, latency_tolerance=1.8).failed


def test_slack_is_added_to_the_ratio():
    """bl * tolerance + slack: 1.0 * 1.25 + 0.05 allows 1.29 s but not 1.31 s; the detail says so."""
    base = result(server(e2e=1.0))
    res = gate.compare(base, result(server(e2e=1.29)), latency_slack_s=0.05)
    assert res.passed
    assert latency_check(res).detail.endswith("(1.29x, within 1.25x + 0.050 s)")
    assert gate.compare(base, result(server(e2e=1.31)), latency_slack_s=0.05).failed
    assert gate.compare(base, result(server(e2e=1.29))).failed  # no slack by default


def test_falls_back_to_client_latency_when_a_side_lacks_e2e():
    """e2e is compared only when both sides have it; else the client-side median, on both sides."""
    for b_e2e, a_e2e in [(None, 1.0), (1.0, None), (None, None)]:
        # e2e alone would pass (1.0 -> 1.0); the client latency 1.0 -> 2.0 must fail
        res = gate.compare(result(server(e2e=b_e2e, client=1.0)), result(server(e2e=a_e2e, client=2.0)))
        assert res.failed, (b_e2e, a_e2e)
        assert latency_check(res).detail.startswith("median client latency 2.0000 s vs baseline 1.0000 s")
    # both present: e2e wins even when the client latency alone would fail
    res = gate.compare(result(server(e2e=1.0, client=1.0)), result(server(e2e=1.0, client=9.0)))
    assert res.passed and latency_check(res).detail.startswith("median e2e_latency 1.0000 s")


def test_zero_baseline():
    """A 0 s baseline: 0 s after passes; anything slower fails (unless the slack covers it), ratio inf."""
    assert gate.compare(result(server(e2e=0.0)), result(server(e2e=0.0))).passed
    res = gate.compare(result(server(e2e=0.0)), result(server(e2e=0.001)))
    assert res.failed and "(infx, over 1.25x)" in latency_check(res).detail
    assert gate.compare(result(server(e2e=0.0)), result(server(e2e=0.001)), latency_slack_s=0.01).passed


def test_tokens_identical_differ_and_drift():
    same = gate.compare(result(server(ids=(5, 6))), result(server(ids=(5, 6))))
    assert same.passed and not same.token_drift
    assert [(c.name, c.passed, c.detail) for c in same.checks][0] == ("tokens", True, "2 greedy tokens identical")
    diff = gate.compare(result(server(ids=(5, 6))), result(server(ids=(5, 7))))
    assert diff.failed and not diff.token_drift
    assert diff.message == "127.0.0.1:30000 tokens FAILED: output_ids differ: baseline [5, 6] vs after [5, 7]"
    drift = gate.compare(result(server(ids=(5, 6))), result(server(ids=(5, 7))), allow_token_drift=True)
    assert drift.passed and drift.token_drift
    assert drift.checks[0].detail == "token drift allowed: baseline [5, 6] vs after [5, 7]"
    # allowed but not needed: no drift to note
    assert not gate.compare(result(server()), result(server()), allow_token_drift=True).token_drift


def test_failed_baseline_failed_decode_and_missing_servers():
    t = "127.0.0.1:30000"
    bad_base = gate.compare(result(server(ok=False, error="boom")), result(server()))
    assert bad_base.failed
    assert bad_base.checks == [gate.Check("baseline", t, False, "baseline decode failed: boom")]
    bad_after = gate.compare(result(server()), result(server(ok=False, error="HTTP 500")))
    assert bad_after.checks == [gate.Check("decode", t, False, "HTTP 500")]
    silent = gate.compare(result(server()), result(server(ok=False)))
    assert silent.checks == [gate.Check("decode", t, False, "decode failed")]
    gone = gate.compare(result(server()), result())
    assert gone.failed and gone.message == "127.0.0.1:30000 server FAILED: missing after the change"
    assert gone.checks == [gate.Check("server", t, False, "missing after the change")]
    new = gate.compare(result(server()), result(server(), server(port=30001)))
    assert new.failed and new.message == "127.0.0.1:30001 server FAILED: not in the baseline"
    assert new.checks[-1] == gate.Check("server", "127.0.0.1:30001", False, "not in the baseline")
    # servers pair by (host, port), not by position
    swapped = gate.compare(result(server(port=1, ids=(1,)), server(port=2, ids=(2,))),
                           result(server(port=2, ids=(2,)), server(port=1, ids=(1,))))
    assert swapped.passed and [c.target for c in swapped.checks] == ["127.0.0.1:1"] * 2 + ["127.0.0.1:2"] * 2


def test_passing_message_lists_every_check():
    res = gate.compare(result(server(ids=(1,), e2e=1.0)), result(server(ids=(1,), e2e=1.0)))
    assert res.message == ("127.0.0.1:30000 tokens passed: 1 greedy tokens identical; "
                           "127.0.0.1:30000 latency passed: median e2e_latency 1.0000 s vs baseline 1.0000 s "
                           "(1.00x, within 1.25x)")
    assert res.to_dict()["status"] == "passed" and len(res.to_dict()["checks"]) == 2
    # the shape the golden outputs hold ("validation" of apply and deploy): a reason only when skipped
    assert list(res.to_dict()) == ["status", "checks", "message", "token_drift"]


def test_skipped_offline_and_missing_offline():
    empty = result()
    skipped = gate.compare(empty, empty)
    assert skipped.status == GateStatus.SKIPPED and skipped.skipped and not skipped.passed and not skipped.failed
    assert skipped.reason == "no server" and list(skipped.to_dict())[:2] == ["status", "reason"]
    assert skipped.message == "validation: skipped (no server and no offline check)" and skipped.checks == []
    ok = {"ok": True, "cmd": "true", "returncode": 0, "duration_s": 0.1, "tail": ["fine"]}
    res = gate.compare(result(offline=ok), result(offline=ok))
    assert res.passed and res.message == "offline offline passed: true: exit 0; last lines: fine"
    bad = dict(ok, ok=False, returncode=3, tail=["a", "b"])
    res = gate.compare(result(offline=ok), result(offline=bad))
    assert res.failed and res.message == "offline offline FAILED: true: exit 3; last lines: a | b"
    slow = dict(ok, ok=False, timed_out=True, duration_s=30.2, returncode=None, tail=None)
    res = gate.compare(result(offline=ok), result(offline=slow))
    assert res.message == "offline offline FAILED: true: timed out after 30 s; last lines: "
    lost = gate.compare(result(offline=ok), result())
    assert lost.failed and lost.message == "offline offline FAILED: offline check missing after the change"
    assert lost.checks == [gate.Check("offline", "offline", False, "offline check missing after the change")]
    # an offline check only after the change still runs and counts
    assert gate.compare(empty, result(offline=bad)).failed


def test_malformed_result_raises_key_error():
    with pytest.raises(KeyError):
        gate.compare(result({"host": "h"}), result(server()))
