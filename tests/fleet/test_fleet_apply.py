"""`fleetctl apply defrag-tier0`, rollback and status against the lab with stand-in servers:
real sshd, real SGLang releases, the validation gate run on each host."""

from __future__ import annotations

import ast
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import zipfile

import pytest

from fleetctl.engine.playbooks.apply import _findings
from fleetctl.engine.changes import change_probe
from fleetctl.engine.fleet import Fleet
from fleetctl.errors import HostFailed
from fleetctl.engine.gather import gather
from fleetctl.inventory import load
from fleetctl.paths import find_playbook
from fleetctl.engine.playbooks.plan import plan_host
from fleetctl.engine.playbooks.model import load_playbook
from fleetctl.connection import LockBusy
from fleetctl.wheels import ensure_wheel
from fleetctl.vocab import HostStatus
from oracles import apply_diff
from helpers.ledger import over_ssh as ledger_states
from helpers.proc import sigint_default


RELEASES = {"lab-01": "0.4.6.post5", "lab-02": "0.5.2", "lab-03": "0.5.10", "lab-04": "0.5.23"}
SITE = "/opt/sglang/venv/lib/python3.11/site-packages"


def fleetctl(lab, *args):
    return lab.cli(*args)


def apply_json(lab, *args, rc=None):
    return lab.cli_json("apply", "defrag-tier0", *args, rc=rc)


def tree_digest(lab, host):
    """sha256 over every installed sglang file's sha256 on the host (one line of output)."""
    r = lab.ssh(host, f"cd {SITE} && find sglang -type f -name '*.py' | sort | xargs sha256sum | sha256sum")
    assert r.returncode == 0, r.stderr
    return r.stdout.split()[0]


def host_sha(lab, host, rel):
    r = lab.ssh(host, f"sha256sum {SITE}/{rel}")
    assert r.returncode == 0, r.stderr
    return r.stdout.split()[0]


def wheel_sha(version, rel):
    with zipfile.ZipFile(ensure_wheel(version)) as z:
        return hashlib.sha256(z.read(rel)).hexdigest()


def origins_by_independent_reading(text):
    """need_sort origins read afresh: (line, value node) for `need_sort = X` and need_sort=X (X not a name)."""
    out = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "need_sort" for t in node.targets):
            out.append((node.lineno, node.value))
        elif isinstance(node, ast.Call):
            out += [(k.value.lineno, k.value) for k in node.keywords
                    if k.arg == "need_sort" and not isinstance(k.value, ast.Name)]
    return out


@pytest.fixture(autouse=True)
def healthy_servers(server_lab):
    """Every test starts and ends with well-behaved stand-ins and no applied change: a stand-in the
    test gave a behaviour, or one that is not healthy, is reset and restarted (the others are
    left running: a restart costs seconds of CPU)."""
    yield
    for h in server_lab.hosts:
        if h in server_lab.behaved or not server_lab.server_healthy(h):
            server_lab.set_behavior(h, {}, restart=True)  # asserts its own rc
    server_lab.cli_json("rollback", "--last", "all", "--yes", rc=0)  # else later tests would see its state


def test_check_mode_changes_nothing(server_lab):
    before = {h: tree_digest(server_lab, h) for h in server_lab.hosts}
    r, doc, hosts = apply_json(server_lab, "all", "--check", "--diff")
    assert r.returncode == 0, r.stderr
    assert doc["check"] is True and doc["change_id"] is None
    assert hosts["lab-01"]["status"] == "skipped" and "not applicable" in hosts["lab-01"]["skipped_reason"]
    assert {h: hosts[h]["status"] for h in ("lab-02", "lab-03", "lab-04")} == dict.fromkeys(
        ("lab-02", "lab-03", "lab-04"), "changed")
    assert len(hosts["lab-04"]["plan"]["edits"]) == 4
    for h in ("lab-02", "lab-03", "lab-04"):  # the diff the operator approves is the change (review M1)
        for f in hosts[h]["plan"]["files"]:
            body = f["diff"].splitlines()[2:]
            assert any(l.startswith("+") and "fleetctl defrag-tier0: was" in l for l in body), f["diff"]
            assert not any(l.startswith("-") and "fleetctl defrag-tier0" in l for l in body), f["diff"]
            cat = server_lab.ssh(h, f"cat {f['path']}")
            assert cat.returncode == 0, cat.stderr
            patched = apply_diff(cat.stdout, f["diff"], f["rel"])
            assert hashlib.sha256(patched.encode()).hexdigest() == f["post_sha256"]
    assert {h: tree_digest(server_lab, h) for h in server_lab.hosts} == before
    assert server_lab.ssh("lab-04", "test -e /var/lib/fleetctl/ledger.jsonl").returncode != 0


def test_apply_is_idempotent_and_rollback_is_byte_identical(server_lab):
    untouched = tree_digest(server_lab, "lab-01")
    r, doc, hosts = apply_json(server_lab, "all", "--yes", rc=0)
    cid = doc["change_id"]
    assert [hosts[h]["status"] for h in RELEASES] == ["skipped", "changed", "changed", "changed"]
    for h in ("lab-02", "lab-03", "lab-04"):
        assert hosts[h]["validation"]["status"] == "passed"
        for f in hosts[h]["plan"]["files"]:
            text = server_lab.ssh(h, f"cat {f['path']}").stdout
            assert hashlib.sha256(text.encode()).hexdigest() == f["post_sha256"]
            values = origins_by_independent_reading(text)
            edited = {e["line"] for e in hosts[h]["plan"]["edits"]}
            assert edited and all(isinstance(v, ast.Constant) for _, v in values)
            assert {line for line, v in values if v.value is True} >= edited
            assert all(v.value is False for line, v in values if line not in edited)  # literal origins kept
    assert tree_digest(server_lab, "lab-01") == untouched

    r, doc, again = apply_json(server_lab, "all", "--yes")
    assert r.returncode == 0
    assert [again[h]["status"] for h in RELEASES] == ["skipped", "ok", "ok", "ok"]

    r = fleetctl(server_lab, "inspect", "lab-04", "--json")
    origins = json.loads(r.stdout)["hosts"][0]["need_sort_origins"]
    assert all(o["literal"] for o in origins)
    assert sum(o["expr"] == "True" for o in origins) == 4

    r = fleetctl(server_lab, "rollback", cid, "all:!lab-01", "--yes", "--json")
    assert r.returncode == 0, r.stdout
    r = fleetctl(server_lab, "rollback", cid, "all:!lab-01", "--yes", "--json")  # again: a no-op
    assert r.returncode == 0, r.stdout
    assert {h["status"] for h in json.loads(r.stdout)["hosts"]} == {"ok"}
    for h in ("lab-02", "lab-03", "lab-04"):
        for f in hosts[h]["plan"]["files"]:
            assert host_sha(server_lab, h, f["rel"]) == wheel_sha(RELEASES[h], f["rel"])


def test_file_edited_after_inspect_is_refused(server_lab, monkeypatch):
    """The pre-image check: a file that changed between this run's inspect and its write."""
    inv = load(server_lab.inventory)
    host = inv.select("lab-04")[0]
    pb = load_playbook(find_playbook("defrag-tier0"))
    with Fleet(server_lab.settings(), timeout=120) as fleet:
        def job(ctx):
            g = gather(ctx, with_sources=True)
            plan = plan_host(pb, host.name, dict(host.vars), g["facts"], _findings(g), g["sources"])
            f = plan.files[0]
            assert ctx.run(["sh", "-c", 'echo "# operator was here" >> "$1"', "sh", f.path]).ok
            files = [{"path": f.path, "pre_sha256": f.pre_sha256, "post_sha256": f.post_sha256,
                      "new_text": f.new_text}]
            with pytest.raises(HostFailed, match="changed since inspect"):
                change_probe(ctx, "apply", change_id="t-refused", playbook=pb.name, operator="test",
                             files=files, root=g["facts"]["sglang"]["location"], commit=False)
            after = ctx.run(["sha256sum", f.path]).stdout.decode().split()[0]
            assert ctx.run(["sed", "-i", "$ d", f.path]).ok
            edited = hashlib.sha256(g["sources"][f.rel].encode() + b"# operator was here\n").hexdigest()
            return ctx.result(HostStatus.OK, data={"after": after, "edited": edited, "rel": f.rel})

        res = fleet.run([host], job)[0]
    assert res.status == "ok", res.error
    assert res.data["after"] == res.data["edited"]  # the file stayed exactly as the operator left it
    assert host_sha(server_lab, "lab-04", res.data["rel"]) == wheel_sha("0.5.23", res.data["rel"])
    led = "/var/lib/fleetctl/ledger.jsonl"
    r = server_lab.ssh("lab-04", f"test ! -e {led} || ! grep -q t-refused {led}")
    assert r.returncode == 0, (r.returncode, r.stderr)  # no ledger line (an ssh failure is 255)


def test_second_concurrent_run_fails_fast(server_lab, monkeypatch):
    inv = load(server_lab.inventory)
    host = inv.select("lab-03")[0]
    with Fleet(server_lab.settings()) as fleet:
        lock = fleet.connection(host).hold_lock("/var/lib/fleetctl", timeout=5, hold_s=300)
        try:
            t0 = time.monotonic()
            r, doc, hosts = apply_json(server_lab, "lab-03", "--yes")
            took = time.monotonic() - t0
            with pytest.raises(LockBusy):
                fleet.connection(host).hold_lock("/var/lib/fleetctl", timeout=5, hold_s=300)
        finally:
            lock.release()
    assert r.returncode == 2
    assert hosts["lab-03"]["status"] == "failed"
    assert "another fleetctl run" in hosts["lab-03"]["error"]
    assert took < 30
    r, doc, hosts = apply_json(server_lab, "lab-03", "--yes")  # the lock went with its holder
    assert hosts["lab-03"]["status"] == "changed", hosts["lab-03"]["error"]


def test_kill_9_mid_apply_leaves_host_whole_and_next_run_recovers(server_lab):
    rel = "sglang/srt/mem_cache/kv_cache_configurator.py"
    original = wheel_sha("0.5.23", rel)
    # after the restart the stand-in stays unhealthy, so the run sits in validation, change pending
    server_lab.set_behavior("lab-04", {"never_healthy": True}, restart=False)
    p = subprocess.Popen([sys.executable, "-m", "fleetctl.cli", "apply", "defrag-tier0", "lab-04", "--yes",
                          "--health-timeout", "60"], env=server_lab.env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 90
        while "pending" not in ledger_states(server_lab, "lab-04").values():
            assert time.monotonic() < deadline and p.poll() is None, "apply never reached pending"
            time.sleep(0.3)
        os.kill(p.pid, signal.SIGKILL)
    finally:
        p.wait()
    sha = host_sha(server_lab, "lab-04", rel)
    states = ledger_states(server_lab, "lab-04")
    pending = [c for c, s in states.items() if s == "pending"]
    assert len(pending) == 1
    entry = [json.loads(line) for line in server_lab.ssh("lab-04", "cat /var/lib/fleetctl/ledger.jsonl")
             .stdout.splitlines() if pending[0] in line][-1]
    assert sha in (original, entry["files"][0]["after_sha256"])  # whole file, old or new

    r = fleetctl(server_lab, "status", "lab-04", "--json")
    assert r.returncode == 2 and "pending" in json.loads(r.stdout)["hosts"][0]["error"]

    # `rollback --last` undoes just the interrupted change, and restarts the server that the
    # killed run may have restarted on the patched file
    server_lab.set_behavior("lab-04", {}, restart=False)
    pid = server_lab.ssh("lab-04", "cat /opt/fleetctl-standin/server.pid").stdout.strip()
    r = fleetctl(server_lab, "rollback", "--last", "lab-04", "--yes", "--json")
    h = json.loads(r.stdout)["hosts"][0]
    assert r.returncode == 0 and h["status"] == "changed" and h["change_id"] == pending[0]
    assert [x["name"] for x in h["handlers"]] == ["restart sglang"]
    assert server_lab.ssh("lab-04", "cat /opt/fleetctl-standin/server.pid").stdout.strip() != pid
    assert host_sha(server_lab, "lab-04", rel) == original
    states = ledger_states(server_lab, "lab-04")
    assert states[pending[0]] == "rolled-back" and "applied" not in states.values()

    r, doc, hosts = apply_json(server_lab, "lab-04", "--yes")
    assert hosts["lab-04"]["status"] == "changed", hosts["lab-04"]["error"]
    assert hosts["lab-04"]["recovered"] == []
    assert ledger_states(server_lab, "lab-04")[doc["change_id"]] == "applied"


def test_a_server_that_dies_after_the_restart_fails_the_gate_at_once(server_lab):
    """Soak finding 11 (bench/results/soak-findings.md): the stand-in SIGKILLed while it starts
    after the change's restart. defrag-tier0's handler asks for a 600 s health wait; the gate
    fails once no successor took the server's place in smoke.EXIT_GRACE_S, and the change is
    rolled back, instead of the run waiting out the 600 s."""
    before = tree_digest(server_lab, "lab-02")
    old = server_lab.ssh("lab-02", "cat /opt/fleetctl-standin/server.pid").stdout.strip()
    server_lab.set_behavior("lab-02", {"never_healthy": True}, restart=False)
    p = subprocess.Popen([sys.executable, "-m", "fleetctl.cli", "apply", "defrag-tier0", "lab-02", "--yes", "--json",
                          "--health-timeout", "20"], env=server_lab.env,
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:  # the handler's restart: a new stand-in, never healthy, in the health wait
            new = server_lab.ssh("lab-02", "cat /opt/fleetctl-standin/server.pid").stdout.strip()
            exe = server_lab.ssh("lab-02", f"readlink /proc/{new}/exe").stdout.strip() if new != old else ""
            if exe and not exe.endswith(("/setsid", "/nohup")):  # past restart.sh's setsid and nohup: the server
                break
            assert time.monotonic() < deadline and p.poll() is None, "apply never restarted the server"
            time.sleep(0.3)
        server_lab.set_behavior("lab-02", {}, restart=False)  # the rollback's restart comes up healthy
        assert server_lab.ssh("lab-02", f"kill -9 {new}").returncode == 0
        killed = time.monotonic()
        out, _ = p.communicate(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    took = time.monotonic() - killed
    h = {x["host"]: x for x in json.loads(out)["hosts"]}["lab-02"]
    assert p.returncode == 2 and h["status"] == "failed", h
    assert "the server exited before it became healthy" in h["error"] and "rolled back" in h["error"], h["error"]
    assert took < 120, took  # the grace (15 s) and the rollback's restart, not the handler's 600 s
    assert tree_digest(server_lab, "lab-02") == before
    assert ledger_states(server_lab, "lab-02")[json.loads(out)["change_id"]] == "rolled-back"


def test_canary_failure_stops_rollout_and_rolls_back(server_lab):
    """lab-02 is the canary; after its restart the stand-in decodes other tokens."""
    server_lab.set_behavior("lab-02", {"token_shift": 1}, restart=False)
    before = {h: tree_digest(server_lab, h) for h in server_lab.hosts}
    r, doc, hosts = apply_json(server_lab, "all", "--yes", "--serial", "1,100%")
    assert r.returncode == 2
    assert hosts["lab-01"]["status"] == "skipped"  # not applicable: not part of any batch
    assert hosts["lab-02"]["batch"] == 1  # the canary batch holds only hosts that change
    assert hosts["lab-02"]["status"] == "failed" and "rolled back" in hosts["lab-02"]["error"]
    assert "tokens" in hosts["lab-02"]["error"]
    assert hosts["lab-02"]["validation"]["status"] == "failed"
    assert hosts["lab-03"]["status"] == hosts["lab-04"]["status"] == "not attempted"
    assert {h: tree_digest(server_lab, h) for h in server_lab.hosts} == before
    assert ledger_states(server_lab, "lab-02")[doc["change_id"]] == "rolled-back"


def test_slower_server_trips_the_latency_gate(server_lab):
    # a fixed 50 ms per decode step (16 steps: +0.8 s) trips 1.25 x baseline + the lab's slack on
    # any machine, where a relative slowdown depends on how fast the baseline is (review L14b)
    server_lab.set_behavior("lab-03", {"delay_ms": 50}, restart=False)
    before = tree_digest(server_lab, "lab-03")
    r, doc, hosts = apply_json(server_lab, "lab-03", "--yes")
    assert r.returncode == 2
    assert hosts["lab-03"]["status"] == "failed" and "latency" in hosts["lab-03"]["error"]
    assert tree_digest(server_lab, "lab-03") == before


def test_status_reports_drift_and_record_differences(server_lab):
    rel = "sglang/version.py"
    r = fleetctl(server_lab, "status", "lab-02", "--json")
    assert r.returncode == 0, r.stdout
    assert server_lab.ssh("lab-02", f"echo '# hand edit' >> {SITE}/{rel}").returncode == 0
    try:
        r = fleetctl(server_lab, "status", "lab-02", "--json")
        h = json.loads(r.stdout)["hosts"][0]
        assert r.returncode == 2
        assert [m["path"].endswith(rel) for m in h["modified"]] == [True]
        assert "modified outside fleetctl" in h["error"]
    finally:
        server_lab.ssh("lab-02", f"sed -i '$ d' {SITE}/{rel}")
    r, doc, hosts = apply_json(server_lab, "lab-02", "--yes")
    assert hosts["lab-02"]["status"] == "changed"
    path = hosts["lab-02"]["plan"]["files"][0]["path"]
    backup = f"/var/lib/fleetctl/backups/{doc['change_id']}{path}"
    assert server_lab.ssh("lab-02", f"cp {backup} {path}").returncode == 0  # "reinstalled"
    r = fleetctl(server_lab, "status", "lab-02", "--json")
    h = json.loads(r.stdout)["hosts"][0]
    assert r.returncode == 2 and [d["change_id"] for d in h["drift"]] == [doc["change_id"]]
    assert h["modified"] == []


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_ctrl_c_lets_the_running_host_finish_and_starts_no_more(server_lab, sig, code):
    """SIGINT (Ctrl-C), or SIGTERM (a CI cancel: handled the same, exit 143), during a
    one-host-at-a-time rollout: the host in progress completes its change (validated, applied),
    the hosts not started are untouched and reported not attempted; the --json document, the
    exit status and the history say the same exit code."""
    server_lab.set_behavior("lab-02", {"unhealthy_for_s": 6}, restart=False)
    before = {h: tree_digest(server_lab, h) for h in ("lab-03", "lab-04")}
    p = subprocess.Popen([sys.executable, "-m", "fleetctl.cli", "apply", "defrag-tier0", "all", "--yes",
                          "--serial", "1", "--json"], env=server_lab.env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, preexec_fn=sigint_default)
    deadline = time.monotonic() + 90
    while "pending" not in ledger_states(server_lab, "lab-02").values():
        assert time.monotonic() < deadline and p.poll() is None, "apply never reached lab-02"
        time.sleep(0.3)
    p.send_signal(sig)
    stdout, stderr = p.communicate(timeout=120)
    hosts = {h["host"]: h for h in json.loads(stdout)["hosts"]}
    assert p.returncode == code and "interrupted" in stderr, (p.returncode, stderr[-2000:])
    # one exit code in the document, the exit status and the run's history record (soak seed
    # 6301 step 69: a SIGTERMed run's document said 130)
    shown = json.loads(server_lab.cli("history", "show", "last", "--json").stdout)
    assert (json.loads(stdout)["exit_code"], shown["run"]["exit_code"]) == (code, code), shown["run"]
    assert hosts["lab-02"]["status"] == "changed"
    assert ledger_states(server_lab, "lab-02")[json.loads(stdout)["change_id"]] == "applied"
    for h in ("lab-03", "lab-04"):
        assert hosts[h]["status"] == "not attempted" and "interrupted" in hosts[h]["error"]
    assert {h: tree_digest(server_lab, h) for h in ("lab-03", "lab-04")} == before
