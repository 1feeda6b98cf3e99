"""The smoke probe against live stand-in servers on loopback, its offline check, and the gate
fed with real probe results."""

import copy
import socket
import time

import pytest

from fleetctl.engine import gate
from fleetctl.lab import standin
from fleetctl.probes import smoke

BEHAVIORS = {"normal": {}, "shift": {"token_shift": 3}, "slow": {"slowdown": 4.0},
             "never": {"never_healthy": True}, "short": {"truncate_tokens": 8}}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ports(tmp_path_factory):
    procs, ports = [], {}
    for name, behavior in BEHAVIORS.items():
        ports[name] = free_port()
        procs.append(standin.start_local(ports[name], behavior, tmp_path_factory.mktemp(name)))
    for name in ("normal", "shift", "slow", "short"):
        assert smoke.wait_healthy("http://127.0.0.1:%d" % ports[name], 60)[0], name
    yield ports
    for p in procs:
        p.terminate()
        p.wait(10)


def probe(port, **params):
    return smoke.main(dict(params, servers=[{"host": "127.0.0.1", "port": port}]))


@pytest.fixture(scope="module")
def baseline(ports):
    return probe(ports["normal"])


def as_port(result, port):
    """A real probe result relabelled to another port, so the gate pairs it with the baseline."""
    r = copy.deepcopy(result)
    for s in r["servers"]:
        s["port"] = port
    return r


def test_probe_ok(baseline):
    s = baseline["servers"][0]
    assert s["ok"] and s["error"] is None, s
    assert len(s["output_ids"]) == 16 and s["ids_consistent"] is True
    assert len(s["runs"]) == 3 and all(len(r["output_ids"]) == 16 for r in s["runs"])
    assert s["model_path"] == "fleetctl-standin/tiny" and s["stand_in"] is True
    assert 0 < s["e2e_latency_s"] <= s["latency_s"]
    assert s["tokens_per_s"] == pytest.approx(16 / s["e2e_latency_s"])
    assert baseline["offline"] is None


def test_probe_waits_through_startup(tmp_path):
    port = free_port()
    t0 = time.monotonic()
    proc = standin.start_local(port, {"unhealthy_for_s": 2}, tmp_path)
    try:
        s = probe(port, repeat=1, health_timeout=60)["servers"][0]
    finally:
        proc.terminate()
        proc.wait(10)
    assert s["ok"], s
    assert time.monotonic() - t0 >= 2 and s["health_wait_s"] > 1.5


def test_health_deadline_exceeded(ports):
    t0 = time.monotonic()
    s = probe(ports["never"], health_timeout=1.5)["servers"][0]
    assert 1.5 <= time.monotonic() - t0 < 5
    assert not s["ok"] and s["runs"] == []
    assert "health deadline exceeded" in s["error"] and "503" in s["error"]


def test_nothing_listening(ports):
    s = probe(free_port(), health_timeout=0.5)["servers"][0]
    assert not s["ok"] and "no answer" in s["error"]


def test_wrong_token_count_detected(ports):
    s = probe(ports["short"], repeat=1)["servers"][0]
    assert not s["ok"]
    assert "expected 16 output_ids, got 8" in s["error"]
    assert "completion_tokens is 8" in s["error"] and "finish_reason" in s["error"]


def test_offline_pass_fail_and_tail():
    ok = smoke.offline_check("seq 1 30; echo done", timeout=10)
    assert ok["ok"] and ok["returncode"] == 0 and ok["tail"][-1] == "done" and len(ok["tail"]) == 20
    bad = smoke.main({"offline_cmd": "echo boom >&2; exit 1", "offline_timeout": 10})["offline"]
    assert not bad["ok"] and bad["returncode"] == 1 and bad["tail"] == ["boom"]


def test_offline_timeout_kills_process_group(tmp_path):
    pidfile = tmp_path / "child.pid"
    t0 = time.monotonic()
    r = smoke.offline_check("sleep 30 & echo $! > %s; wait" % pidfile, timeout=1)
    assert r["timed_out"] and not r["ok"] and time.monotonic() - t0 < 10
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 10  # the kill is sent; its delivery and the reaping may lag
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(child)  # the backgrounded grandchild died with the group


def alive(pid):
    """Running and not a zombie (a killed orphan may wait a while for init to reap it)."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_gate_passes_same_tokens(ports, baseline):
    res = gate.compare(baseline, probe(ports["normal"]), latency_tolerance=3.0)
    assert res.passed and not res.failed and not res.token_drift
    assert {c.name for c in res.checks} == {"tokens", "latency"}


def test_gate_fails_on_token_change_with_both_lists(ports, baseline):
    after = as_port(probe(ports["shift"]), ports["normal"])
    res = gate.compare(baseline, after, latency_tolerance=100)
    assert res.failed and not res.passed
    assert "output_ids differ" in res.message
    assert str(baseline["servers"][0]["output_ids"]) in res.message
    assert str(after["servers"][0]["output_ids"]) in res.message
    drift = gate.compare(baseline, after, latency_tolerance=100, allow_token_drift=True)
    assert drift.passed and drift.token_drift and "token drift allowed" in drift.message


def test_gate_fails_on_latency_with_both_latencies(ports, baseline):
    after = as_port(probe(ports["slow"]), ports["normal"])
    res = gate.compare(baseline, after, allow_token_drift=True)
    assert res.failed
    lat = next(c for c in res.checks if c.name == "latency")
    assert not lat.passed and lat.detail in res.message
    assert "%.4f" % baseline["servers"][0]["e2e_latency_s"] in lat.detail
    assert "%.4f" % after["servers"][0]["e2e_latency_s"] in lat.detail
    assert gate.compare(baseline, after, latency_slack_s=10.0).passed


def test_gate_decode_failure_and_missing_server(ports, baseline):
    broken = as_port(probe(ports["short"], repeat=1), ports["normal"])
    res = gate.compare(baseline, broken)
    assert res.failed and "decode FAILED" in res.message and "got 8" in res.message
    gone = gate.compare(baseline, {"servers": [], "offline": None})
    assert gone.failed and "missing after the change" in gone.message


def test_gate_skipped_without_server_is_not_passed():
    empty = smoke.main({})
    res = gate.compare(empty, empty)
    assert res.skipped and not res.passed and not res.failed
    assert res.status == "skipped (no server)"
    assert res.to_dict()["status"] == "skipped (no server)"


def test_gate_offline_only():
    ok = smoke.main({"offline_cmd": "true"})
    assert gate.compare(ok, ok).passed
    bad = smoke.main({"offline_cmd": "echo numerics off; exit 1"})
    res = gate.compare(ok, bad)
    assert res.failed and "exit 1" in res.message and "numerics off" in res.message
