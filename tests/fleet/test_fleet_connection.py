"""The connection seam through real sshd (paramiko): known_hosts marker lines (case 01),
keepalives that notice a dead peer, bounded uploads, the run-level deadline, and a connection
cut while a written change is being validated (rolled back in the same run when the host comes
back within the reserve; left pending, and undone by the next run, when it does not)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from conftest import write_ssh_config
from fleetctl.connection import RemoteTimeout, Settings, Unreachable
from fleetctl.engine.fleet import Fleet
from fleetctl.inventory import load
from fleetctl.wheels import ensure_wheel
from fleetctl.vocab import HostStatus
from helpers.ledger import from_lab as ledger

CA_KEY = "AAAAC3NzaC1lZDI1NTE5AAAAIKtZZipMIFKufYYiG98eBzugs9Xw6YwLoWhGGtpp7Rrn"  # case 01's CA (not a real one)
KEEPALIVE = "Host *\n  ServerAliveInterval 1\n  ServerAliveCountMax 2\n"
CUT_HEALTH_TIMEOUT_S = 300  # the health wait a cut interrupts: far longer than noticing the cut takes


def plain_line(lab, host: str) -> str:
    return next(line for line in lab.known_hosts.read_text().splitlines() if line.split()[0] == lab.address(host))


def inspect(lab, pattern: str, cfg, *args: str):
    r = lab.cli("inspect", pattern, "--json", "--ssh-config", str(cfg), *args, timeout=180)
    try:
        hosts = {h["host"]: h for h in json.loads(r.stdout)["hosts"]}
    except json.JSONDecodeError:
        raise AssertionError(f"no JSON (exit {r.returncode}): {r.stdout[-2000:]} {r.stderr[-2000:]}") from None
    return r, hosts


def test_case01_cert_authority_line_refuses_only_the_host_it_covers(lab, tmp_path):
    known = tmp_path / "known_hosts"
    prefix = lab.address("lab-02").rsplit(".", 1)[0]
    known.write_text(f"{plain_line(lab, 'lab-01')}\n"
                     f"@cert-authority {prefix}.*,!{lab.address('lab-01')} ssh-ed25519 {CA_KEY}\n")
    r, hosts = inspect(lab, "lab-01:lab-02", write_ssh_config(tmp_path / "config", known))
    assert r.returncode == 3, r.stderr
    assert hosts["lab-01"]["status"] == "ok" and hosts["lab-01"]["facts"]["hostname"] == "lab-01"
    h2 = hosts["lab-02"]
    assert h2["status"] == "unreachable" and h2["facts"] is None
    assert h2["error"] == (f"a CA vouches for this host (@cert-authority at {known}:2); paramiko cannot "
                           "verify host certificates: use ansible_connection: ssh")
    assert "Traceback" not in r.stdout + r.stderr
    # --accept-new never pins a key that a CA was meant to vouch for
    r, hosts = inspect(lab, "lab-02", write_ssh_config(tmp_path / "config", known), "--accept-new")
    assert r.returncode == 3 and "CA vouches" in hosts["lab-02"]["error"]
    assert lab.address("lab-02") not in known.read_text()


def test_case01_variant_b_revoked_key_is_refused_though_a_plain_line_lists_it(lab, tmp_path):
    known = tmp_path / "known_hosts"
    line = plain_line(lab, "lab-01")
    keytype, key = line.split()[1:3]
    known.write_text(f"{line}\n{plain_line(lab, 'lab-02')}\n@revoked * {keytype} {key}\n")
    for extra in ((), ("--accept-new",)):
        r, hosts = inspect(lab, "lab-01:lab-02", write_ssh_config(tmp_path / "config", known), *extra)
        assert r.returncode == 3
        assert hosts["lab-02"]["status"] == "ok"
        h1 = hosts["lab-01"]
        assert h1["status"] == "unreachable" and h1["facts"] is None
        assert "is revoked" in h1["error"] and f"{known}:3" in h1["error"] and "SHA256:" in h1["error"]


# paramiko with the keepalives of the host's ssh_config; the ssh kind's master with fleetctl's own
# where the ssh_config sets none (security review turn 3, H2: it had none, and a cut hung to the deadline)
@pytest.mark.parametrize("kind,said", [("paramiko", "no answer to 2 keepalives sent 1 s apart"),
                                       ("ssh", "keepalives: 2 unanswered, 1 s apart")])
def test_keepalives_notice_a_dead_peer_within_interval_times_count(lab, tmp_path, kind, said):
    if kind == "paramiko":
        settings = Settings(ssh_config=write_ssh_config(tmp_path / "config", lab.known_hosts, KEEPALIVE))
    else:
        settings = Settings(ssh_config=write_ssh_config(tmp_path / "config", lab.known_hosts), connection="ssh",
                            server_alive_interval=1, server_alive_count_max=2)
    host = load(lab.inventory).select("lab-02")[0]
    cut = {}

    def cut_link():
        time.sleep(1.0)
        lab.fault("lab-02", "down")
        cut["at"] = time.monotonic()

    def job(ctx):
        threading.Thread(target=cut_link, daemon=True).start()
        try:
            ctx.run(["sleep", "60"], timeout=60)
        except Unreachable as e:
            return ctx.result(HostStatus.OK, data={"error": str(e), "noticed": time.monotonic()})
        return ctx.result(HostStatus.OK, data={"error": None})

    try:
        with Fleet(settings, timeout=90) as fleet:
            res = fleet.run([host], job)[0]
    finally:
        lab.fault("lab-02", "up")
    assert res.status == "ok" and res.data["error"], res.error
    assert said in res.data["error"]
    # 2 unanswered keepalives 1 s apart, the first sent at most 1 s after the cut; slack for 2 busy cores
    assert res.data["noticed"] - cut["at"] < 1 * 2 + 1 + 1.5


def test_upload_to_a_host_that_stops_answering_times_out(lab, tmp_path):
    host = load(lab.inventory).select("lab-03")[0]

    def job(ctx):
        ctx.conn.put_bytes(b"warm-up", "/tmp/fleetctl-upload-test", timeout=10)
        lab.fault("lab-03", "delay", 20_000)  # every byte now waits 20 s in the proxy
        t0 = time.monotonic()
        with pytest.raises(RemoteTimeout):
            ctx.conn.put_bytes(b"x" * 100_000, "/tmp/fleetctl-upload-test", timeout=3)
        return ctx.result(HostStatus.OK, data={"took": time.monotonic() - t0})

    try:
        with Fleet(lab.settings(), timeout=90) as fleet:
            res = fleet.run([host], job)[0]
    finally:
        lab.fault("lab-03", "delay", 0)
        # the session whose bytes sit in the proxy is this test's: end it on lab-03, and only there
        for pid in lab.pids("lab-03"):
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while lab.pids("lab-03") and time.monotonic() < deadline:
            time.sleep(0.2)
    assert res.status == "ok", res.error
    assert res.data["took"] < 3 + 2 + 3 + 2  # the deadline, the kill grace, the collection margin
    assert lab.pids("lab-03") == []


def test_run_timeout_ends_a_run_of_hung_hosts(lab):
    for h in ("lab-03", "lab-04"):
        lab.fault(h, "hang")
    try:
        t0 = time.monotonic()
        r, hosts = inspect(lab, "all", lab.ssh_config, "--run-timeout", "8", "--timeout", "12")
        took = time.monotonic() - t0
    finally:
        for h in ("lab-03", "lab-04"):
            lab.fault(h, "unhang")
    assert r.returncode == 2
    assert {h: hosts[h]["status"] for h in hosts} == {"lab-01": "ok", "lab-02": "ok", "lab-03": "failed",
                                                       "lab-04": "failed"}
    assert "--run-timeout 8 s" in hosts["lab-04"]["error"]
    assert took < 8 + 6  # the run deadline, the CLI's start and exit
    # the hung interpreters die on the hosts by their own deadline (12 s), not left behind
    deadline = time.monotonic() + 30
    while any(lab.pids(h) for h in ("lab-03", "lab-04")) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = {p: open(f"/proc/{p}/cmdline", "rb").read() for h in ("lab-03", "lab-04") for p in lab.pids(h)}
    assert left == {}


# ------------------------------------------------------------------ a cut during validation

REL = "sglang/srt/mem_cache/kv_cache_configurator.py"


def installed_sha(server_lab, host: str) -> str:
    r = server_lab.ssh(host, f"cd /opt/sglang/venv/lib/python3*/site-packages && sha256sum {REL}")
    assert r.returncode == 0, r.stderr
    return r.stdout.split()[0]


def wheel_sha() -> str:
    import hashlib
    import zipfile
    with zipfile.ZipFile(ensure_wheel("0.5.23")) as z:
        return hashlib.sha256(z.read(REL)).hexdigest()


def apply_and_cut(server_lab, tmp_path, down_s: float, connect_timeout: float
                  ) -> tuple[subprocess.CompletedProcess, dict, float]:
    """Apply defrag-tier0 to lab-04 whose stand-in never gets healthy after the restart; once
    this run's change is pending (the health wait), cut lab-04's link for `down_s` seconds (a
    server started after that is healthy again)."""
    cfg = write_ssh_config(tmp_path / "config", server_lab.known_hosts, KEEPALIVE)
    server_lab.set_behavior("lab-04", {"never_healthy": True}, restart=False)
    before = set(ledger(server_lab, "lab-04"))
    p = subprocess.Popen([sys.executable, "-m", "fleetctl.cli", "apply", "defrag-tier0", "lab-04", "--yes", "--json",
                          "--health-timeout", str(CUT_HEALTH_TIMEOUT_S), "--connect-timeout", str(connect_timeout),
                          "--ssh-config", str(cfg)],
                         env=server_lab.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while "pending" not in [s for c, s in ledger(server_lab, "lab-04").items() if c not in before]:
            assert time.monotonic() < deadline and p.poll() is None, "apply never reached pending"
            time.sleep(0.2)
        # the server restarted by the rollback comes up healthy (the behaviour file is read at
        # start), so the health wait after a rollback that restarted (review L13) is short
        server_lab.set_behavior("lab-04", {}, restart=False)
        server_lab.fault("lab-04", "down")
        t0 = time.monotonic()
        time.sleep(down_s)
    finally:
        server_lab.fault("lab-04", "up")
    out, err = p.communicate(timeout=CUT_HEALTH_TIMEOUT_S + 300)
    took = time.monotonic() - t0
    try:
        host = json.loads(out)["hosts"][0]
    except (json.JSONDecodeError, IndexError):
        raise AssertionError(f"no JSON (exit {p.returncode}): {out[-2000:]} {err[-2000:]}") from None
    return subprocess.CompletedProcess(p.args, p.returncode, out, err), host, took


def rollback_last(server_lab) -> tuple[subprocess.CompletedProcess, dict]:
    """`fleetctl rollback --last lab-04`, retried while the lock of a lost session is still held
    (it goes when lab-04's sshd learns that the session is gone)."""
    deadline = time.monotonic() + 90
    while True:
        r = server_lab.cli("rollback", "--last", "lab-04", "--yes", "--json")
        h = json.loads(r.stdout)["hosts"][0]
        if "another fleetctl run" not in (h["error"] or "") or time.monotonic() > deadline:
            return r, h
        time.sleep(2)


@pytest.fixture
def lab04_restored(server_lab):
    yield
    server_lab.set_behavior("lab-04", {}, restart=True)
    r, h = rollback_last(server_lab)  # whatever the test left applied or pending
    assert r.returncode == 0, h["error"]
    assert "pending" not in ledger(server_lab, "lab-04").values()


def test_cut_shorter_than_the_reserve_is_rolled_back_in_the_same_run(server_lab, tmp_path, lab04_restored):
    original = wheel_sha()
    r, host, took = apply_and_cut(server_lab, tmp_path, down_s=3, connect_timeout=20)
    assert r.returncode == 2, r.stderr[-2000:]
    assert host["status"] == "failed" and host["rolled_back"] is True
    # the cut lands during a command or while the health wait opens its next channel: either way lost
    assert host["error"].startswith("rolled back: the connection was lost (connection lost "), host["error"]
    assert "keepalives" in host["error"]
    # the rollback ran under the host lock, taken again on the new connection (review H2, open 3)
    assert "reconnected and took the host lock again to roll back" in host["error"]
    assert ledger(server_lab, "lab-04")[host["change_id"]] == "rolled-back"
    assert installed_sha(server_lab, "lab-04") == original
    # noticed by keepalives (2 x 1 s), not by the end of the health wait: the reconnect, the rollback and
    # the restarted server's start take seconds to tens of seconds on a loaded machine, the wait 300 s
    assert took < CUT_HEALTH_TIMEOUT_S / 2


def test_cut_longer_than_the_reconnect_leaves_the_change_pending_and_the_next_run_undoes_it(
        server_lab, tmp_path, lab04_restored):
    original = wheel_sha()
    r, host, _ = apply_and_cut(server_lab, tmp_path, down_s=12, connect_timeout=4)
    assert r.returncode == 3, r.stderr[-2000:]
    cid = json.loads(r.stdout)["change_id"]
    assert ledger(server_lab, "lab-04")[cid] == "pending"
    assert host["status"] == "unreachable"
    assert host["error"].startswith(f"change {cid} pending: the next apply, rollback or deploy undoes it")
    server_lab.set_behavior("lab-04", {}, restart=False)
    out, h = rollback_last(server_lab)
    assert out.returncode == 0 and h["status"] == "changed", h["error"]
    assert h["change_id"] == cid and [c["change_id"] for c in h["recovered"]] == [cid]
    assert ledger(server_lab, "lab-04")[cid] == "rolled-back"
    assert installed_sha(server_lab, "lab-04") == original
