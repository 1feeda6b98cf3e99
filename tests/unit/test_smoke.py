"""The smoke probe against live stand-in servers on loopback, its offline check, the gate fed
with real probe results, and where the API key goes (review N6: only to an identified server's
own listening socket)."""

import copy
import json
import http.server
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest

from fleetctl.engine.gates import smoke as gate
from fleetctl.lab import standin
from fleetctl.probes.facts import procs, targets
from fleetctl.probes.traffic import smoke
from helpers.proc import alive, free_port, wait_listening

BEHAVIORS = {"normal": {}, "shift": {"token_shift": 3}, "slow": {"slowdown": 4.0},
             "never": {"never_healthy": True}, "short": {"truncate_tokens": 8}}


PID_OF = {}  # port -> pid of the stand-in listening there (the `ports` fixture's)


@pytest.fixture(scope="module")
def ports(tmp_path_factory):
    started, ports = [], {}
    for name, behavior in BEHAVIORS.items():
        ports[name] = free_port()
        started.append(standin.start_local(ports[name], behavior, tmp_path_factory.mktemp(name)))
        PID_OF[ports[name]] = started[-1].pid
    for name in ("normal", "shift", "slow", "short"):
        assert smoke.wait_healthy("http://127.0.0.1:%d" % ports[name], 60)[0], name
    yield ports
    for p in started:
        p.terminate()
        p.wait(10)


def probe(port, pid=None, **params):
    """The smoke probe on the server `pid` (default: the stand-in on `port`) that claims `port`,
    as the control side names an identified server."""
    return smoke.main(dict(params, servers=[{"pid": pid or PID_OF[port], "port": port, "host": "127.0.0.1"}]))


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
    proc = standin.start_local(port, {"unhealthy_for_s": 1.5}, tmp_path)
    try:
        # the probe finds a server by the sockets its process listens on: wait for the bind (a
        # loaded machine can take a second to start Python), not for /health
        assert wait_listening(port)
        s = probe(port, proc.pid, repeat=1, health_timeout=60)["servers"][0]
    finally:
        proc.terminate()
        proc.wait(10)
    assert s["ok"], s
    assert time.monotonic() - t0 >= 1.5 and s["health_wait_s"] > 0.5


def test_health_deadline_exceeded(ports):
    t0 = time.monotonic()
    s = probe(ports["never"], health_timeout=1.5)["servers"][0]
    assert 1.5 <= time.monotonic() - t0 < 5
    assert not s["ok"] and s["runs"] == []
    assert "health deadline exceeded" in s["error"] and "503" in s["error"]


def test_nothing_listening(ports):
    port = free_port()
    t0 = time.monotonic()
    s = probe(port, os.getpid(), health_timeout=0.5)["servers"][0]
    assert 0.5 <= time.monotonic() - t0 < 5 and not s["ok"] and s["runs"] == []
    assert s["error"] == ("health deadline exceeded after 0 s: no listener on port %d of pid %d or its descendants"
                          % (port, os.getpid()))


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
    assert (res.status, res.reason) == ("skipped", "no server")
    assert res.to_dict() == {"status": "skipped", "reason": "no server", "checks": [],
                             "message": "validation: skipped (no server and no offline check)", "token_drift": False}


def test_gate_offline_only():
    ok = smoke.main({"offline_cmd": "true"})
    assert gate.compare(ok, ok).passed
    bad = smoke.main({"offline_cmd": "echo numerics off; exit 1"})
    res = gate.compare(ok, bad)
    assert res.failed and "exit 1" in res.message and "numerics off" in res.message


class Recorder(http.server.ThreadingHTTPServer):
    """A loopback HTTP listener of this test's own process (no identified server's) that keeps
    the headers of every request it gets and answers 200 {}."""

    def __init__(self):
        self.got = []
        recorder = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self):
                recorder.got.append(dict(self.headers))
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            do_GET = do_POST = _answer

            def log_message(self, *a):
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        self.port = self.server_address[1]
        threading.Thread(target=self.serve_forever, daemon=True).start()


@pytest.fixture
def recorder():
    r = Recorder()
    yield r
    r.shutdown()
    r.server_close()


@pytest.fixture
def claimers():
    """Two processes that listen on nothing: what a local user starts with a server's argv."""
    started = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]) for _ in range(2)]
    yield [p.pid for p in started]
    for p in started:
        p.kill()
        p.wait(10)


KEY = "sk-test-n6-secret"


def test_the_key_goes_only_to_the_servers_own_socket(ports, recorder, claimers):
    """Review N6: of three identified "servers" (the control side's names), the stand-in that
    holds its port is decoded with the key; one that claims the stand-in's port and one that claims
    a port this test's own listener holds are refused, named with pid, port and why; the
    listener got no request at all."""
    normal, (one, two) = ports["normal"], claimers
    r = smoke.main({"api_key": KEY, "repeat": 1, "health_timeout": 10, "servers": [
        {"pid": PID_OF[normal], "port": normal, "host": "127.0.0.1"},
        {"pid": one, "port": normal, "host": "127.0.0.1"},
        {"pid": two, "port": recorder.port, "host": "127.0.0.1"}]})
    assert recorder.got == []
    [s] = r["servers"]
    assert (s["pid"], s["host"], s["port"], s["ok"]) == (PID_OF[normal], "127.0.0.1", normal, True), s
    assert r["refused"] == [
        {"pid": one, "host": "127.0.0.1", "port": normal,
         "reason": "port %d is server pid %d's listener, not this process's or its descendants'"
                   % (normal, PID_OF[normal])},
        {"pid": two, "host": "127.0.0.1", "port": recorder.port,
         "reason": "port %d is the listener of a process that is no identified server, not this process's or its "
                   "descendants'" % recorder.port}]
    assert KEY not in repr(r)


def test_an_inventory_port_is_used_only_where_an_identified_server_listens(ports, recorder, claimers):
    """fleetctl_sglang_port selects among the identified servers' sockets: the stand-in's port is
    decoded; a port only this test's listener holds is refused with the reason (and the server
    that claims it is named), nothing sent."""
    normal, claimer = ports["normal"], claimers[0]
    named = [{"pid": PID_OF[normal], "port": normal, "host": "127.0.0.1"},
             {"pid": claimer, "port": recorder.port, "host": "127.0.0.1"}]
    ok = smoke.main({"api_key": KEY, "repeat": 1, "servers": named, "port": normal, "host": "127.0.0.1"})
    assert [(s["pid"], s["port"], s["ok"]) for s in ok["servers"]] == [(PID_OF[normal], normal, True)]
    assert ok["refused"] == []
    refused = smoke.main({"api_key": KEY, "repeat": 1, "servers": named, "port": recorder.port, "host": "127.0.0.1"})
    assert refused["servers"] == [] and recorder.got == []
    assert refused["refused"] == [
        {"pid": None, "host": "127.0.0.1", "port": recorder.port,
         "reason": "fleetctl_sglang_port %d: 127.0.0.1:%d is the listener of a process that is no identified server"
                   % (recorder.port, recorder.port)},
        {"pid": claimer, "host": "127.0.0.1", "port": recorder.port,
         "reason": "port %d is the listener of a process that is no identified server, not this process's or its "
                   "descendants'" % recorder.port}]


def test_a_restarted_server_is_followed_to_its_successor(tmp_path):
    """The baseline named the server as the facts probe identified it (procs.find_servers: pid,
    interpreter, import path, port); after a restart (new pid, the same interpreter and port, but
    started from another environment: a handler's, whose PYTHONPATH differs) the probe decodes
    the new process, and only because it holds the port."""
    home = tmp_path / "fleetctl-standin"
    home.mkdir()
    for f in standin.FILES:
        shutil.copy(f, home / f.name)
    port = free_port()

    def start(**env):
        return subprocess.Popen([sys.executable, str(home / "server.py"), "--port", str(port),
                                 "--behavior", str(tmp_path / "none.json")], cwd=tmp_path, env=dict(os.environ, **env),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    first = start()
    try:
        assert smoke.wait_healthy("http://127.0.0.1:%d" % port, 60)[0]
        servers = {s["pid"]: s for s in procs.find_servers()[0]}
        assert first.pid in servers, servers
        identified = servers[first.pid]
        named = {k: identified[k] for k in ("pid", "python", "port", "host")}  # as validate.smoke_targets names it
        assert named["port"] == port and identified["import_path"][0] == str(home)
        first.terminate()
        first.wait(10)
        second = start(PYTHONPATH=str(tmp_path))
        try:
            r = smoke.main({"servers": [named], "repeat": 1, "health_timeout": 60})
            again = {s["pid"]: s for s in procs.find_servers()[0]}.get(second.pid, {})
        finally:
            second.terminate()
            second.wait(10)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait(10)
    assert again.get("import_path") not in (None, identified["import_path"])  # another environment's
    assert len(r["servers"]) == 1, r
    [s] = r["servers"]
    assert (s["pid"], s["port"], s["ok"]) == (second.pid, port, True), s
    assert r["refused"] == []


def _identified(tmp_path, port, behavior):
    """A stand-in on `port` that procs.find_servers identifies (its files copied into a home of its
    own, as the lab installs it), and the selector the control side names it by (validate.smoke_targets)."""
    home = tmp_path / "fleetctl-standin"
    home.mkdir(exist_ok=True)
    for f in standin.FILES:
        shutil.copy(f, home / f.name)
    (tmp_path / "behavior.json").write_text(json.dumps(behavior))
    proc = subprocess.Popen([sys.executable, str(home / "server.py"), "--port", str(port), "--behavior",
                             str(tmp_path / "behavior.json")], cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert wait_listening(port)
    found = {s["pid"]: s for s in procs.find_servers()[0]}
    assert proc.pid in found, found
    return proc, {k: found[proc.pid][k] for k in ("pid", "python", "port", "host")}


def _stop(*procs_):
    for p in procs_:
        if p is not None and p.poll() is None:
            p.kill()
            p.wait(10)


# the servers as the facts probe identified them, alone or with the inventory's fleetctl_sglang_port
# (targets.select: each one's claimed port, or the inventory's)
INVENTORY_PORT = pytest.mark.parametrize("inventory_port", [False, True], ids=["claimed", "inventory"])


def _params(named, inventory_port):
    return dict({"servers": [named], "repeat": 1, "health_timeout": 120},
                **({"port": named["port"], "host": "127.0.0.1"} if inventory_port else {}))


@INVENTORY_PORT
def test_a_server_that_exits_during_the_health_wait_ends_it(tmp_path, monkeypatch, inventory_port):
    """Finding 11 of the soak (bench/results/soak-findings.md): a server killed while it starts
    (here: answering 503) ends the wait once no successor took its place in EXIT_GRACE_S, not at
    the health deadline (a handler's 600 s)."""
    monkeypatch.setattr(smoke, "EXIT_GRACE_S", 1.0)
    port = free_port()
    proc, named = _identified(tmp_path, port, {"never_healthy": True})
    killer = threading.Timer(1.0, proc.kill)
    try:
        killer.start()
        t0 = time.monotonic()
        r = smoke.main(_params(named, inventory_port))
        took = time.monotonic() - t0
    finally:
        killer.cancel()
        _stop(proc)
    [s] = r["servers"]
    assert not s["ok"] and took < 15, (took, s)
    assert s["error"].startswith("%s: pid %d exited and no server took its place in 1 s (last answer " % (
        smoke.EXITED, proc.pid)), s["error"]


@INVENTORY_PORT
def test_a_server_gone_before_the_wait_is_waited_for_only_the_grace(tmp_path, monkeypatch, inventory_port):
    """The same when the server exited before the probe came (the soak's case: killed before it
    listened): choose() waits EXIT_GRACE_S for a successor, not the whole deadline, and the
    error says it exited."""
    monkeypatch.setattr(smoke, "EXIT_GRACE_S", 1.0)
    port = free_port()
    proc, named = _identified(tmp_path, port, {})
    _stop(proc)
    t0 = time.monotonic()
    r = smoke.main(_params(named, inventory_port))
    took = time.monotonic() - t0
    [s] = r["servers"]
    assert not s["ok"] and 1.0 <= took < 15, (took, s)
    why = ("nothing listens on 127.0.0.1:%d yet (servers: pid %d (exited))" % (port, proc.pid) if inventory_port
           else targets.GONE % proc.pid)
    assert s["error"].startswith("%s: %s (waited " % (smoke.EXITED, why)), s["error"]


def test_a_supervisor_restart_during_the_health_wait_is_followed(tmp_path):
    """A server that exits during the wait and is started again (a supervisor's restart, within
    EXIT_GRACE_S) is followed to its successor, which is decoded."""
    port = free_port()
    first, named = _identified(tmp_path, port, {"never_healthy": True})
    second = []

    def restart():
        first.kill()
        first.wait(10)
        (tmp_path / "behavior.json").write_text("{}")
        second.append(subprocess.Popen([sys.executable, str(tmp_path / "fleetctl-standin" / "server.py"), "--port",
                                        str(port), "--behavior", str(tmp_path / "behavior.json")], cwd=tmp_path,
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    timer = threading.Timer(1.0, restart)
    try:
        timer.start()
        r = smoke.main({"servers": [named], "repeat": 1, "health_timeout": 120})
    finally:
        timer.join()
        _stop(first, *second)
    [s] = r["servers"]
    assert (s["ok"], s["pid"]) == (True, second[0].pid), s
