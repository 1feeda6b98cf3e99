"""Ctrl-C as a terminal sends it (SIGINT to the whole foreground process group) during a rolling
apply whose hosts are reached through a ProxyCommand bastion (case turn4/13): real sshd, a real
`ssh -W` through another lab host; no server, so the restart handler (a sleep) is the window the
interrupt lands in."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from helpers.ledger import over_ssh as ledger_states
from helpers.proc import pids_naming, sigint_default

SITE = "/opt/sglang/venv/lib/python3.11/site-packages"
FIRST, NEXT = "lab-02", "lab-03"
# The handler of FIRST's change: long enough for the interrupt to land in it (/tmp is each lab
# host's own: lab/base.py PRIVATE_DIRS).
BEGUN, DONE = "/tmp/fleetctl-test-restart-begun", "/tmp/fleetctl-test-restart-done"
RESTART = f"touch {BEGUN}; sleep 5; touch {DONE}"


def tree_digest(lab, host):
    """sha256 over every installed sglang file's sha256 on the host."""
    r = lab.ssh(host, f"cd {SITE} && find sglang -type f -name '*.py' | sort | xargs sha256sum | sha256sum")
    assert r.returncode == 0, r.stderr
    return r.stdout.split()[0]


@pytest.fixture
def proxied(lab, tmp_path):
    """(an inventory of FIRST and NEXT with the lab's vars and RESTART as their restart command,
    an ssh_config whose every host is reached by `ProxyCommand ssh -F JUMP -W %h:%p jump`
    through lab-01, the JUMP config's path); afterwards, every change of the lab rolled back."""
    key = lab.state_dir / "client_ed25519"
    jump = tmp_path / "jump.cfg"
    jump.write_text(f"Host jump\n  HostName {lab.address('lab-01')}\n  User root\n  IdentityFile {key}\n"
                    f"  IdentitiesOnly yes\n  UserKnownHostsFile {lab.known_hosts}\n  BatchMode yes\n"
                    "  StrictHostKeyChecking yes\n")
    cfg = tmp_path / "ssh_config"
    cfg.write_text(f"Host *\n  ProxyCommand ssh -F {jump} -W %h:%p jump\n  UserKnownHostsFile {lab.known_hosts}\n")
    hosts = yaml.safe_load(lab.inventory.read_text())["all"]["children"]["lab"]["hosts"]
    inv = tmp_path / "hosts.yaml"
    inv.write_text(yaml.safe_dump({"all": {"hosts": {h: {**hosts[h], "fleetctl_restart_cmd": RESTART}
                                                     for h in (FIRST, NEXT)}}}))
    yield inv, cfg, jump
    for h in (FIRST, NEXT):
        lab.ssh(h, f"rm -f {BEGUN} {DONE}")
    lab.cli_json("rollback", "--last", "all", "--yes", rc=0)


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_ctrl_c_to_the_process_group_over_a_proxy_command_lets_the_host_in_progress_finish(lab, proxied, sig, code):
    """SIGINT to the CLI's whole process group (what a terminal's Ctrl-C does; SIGTERM: what GNU
    `timeout` or a CI cancel sends it, handled the same) while the first host of `--serial 1`
    runs its change's restart handler: the proxy of that host is in a session of its own, so the
    host's change completes (the handler ran to its end, the change applied in its ledger), the
    next host is not attempted and its tree untouched, the exit status is 130 (143), and no
    proxy outlives the run. The paramiko kind, which starts the ProxyCommand itself (the ssh
    kind's ssh runs it in the master's session: the case's control)."""
    inv, cfg, jump = proxied
    before = tree_digest(lab, NEXT)
    p = subprocess.Popen([sys.executable, "-m", "fleetctl.cli", "apply", "defrag-tier0", "all", "-i", str(inv),
                          "--ssh-config", str(cfg), "-c", "paramiko", "--yes", "--serial", "1", "--json"],
                         env=lab.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True, preexec_fn=sigint_default)
    try:
        deadline = time.monotonic() + 120
        while lab.ssh(FIRST, f"test -e {BEGUN}").returncode != 0:
            assert time.monotonic() < deadline and p.poll() is None, f"apply never reached {FIRST}'s handler"
            time.sleep(0.3)
        assert pids_naming(str(jump)), "no ProxyCommand runs while the first host is changed"
        os.killpg(p.pid, sig)
        stdout, stderr = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode == code and "interrupted" in stderr, (p.returncode, stderr[-2000:])
    doc = json.loads(stdout)
    assert doc["exit_code"] == code, doc["exit_code"]
    hosts = {h["host"]: h for h in doc["hosts"]}
    assert hosts[FIRST]["status"] == "changed", hosts[FIRST]["error"]
    assert lab.ssh(FIRST, f"test -e {DONE}").returncode == 0, "the handler did not run to its end"
    assert ledger_states(lab, FIRST)[doc["change_id"]] == "applied"
    assert hosts[NEXT]["status"] == "not attempted" and "interrupted" in hosts[NEXT]["error"]
    assert tree_digest(lab, NEXT) == before
    assert pids_naming(str(jump)) == [], "a ProxyCommand outlived the run"


def test_a_second_ctrl_c_keeps_the_finished_hosts_and_exits_within_a_second(lab):
    """Issue 50 (review newcomer-turn4 item 6): `inspect all` with lab-02's sshd frozen (TCP
    accepted, no banner: its connect waits for --connect-timeout 120); once the other hosts
    finished, one SIGINT (lab-02 is the one host still in progress), then a second: the CLI
    exits 130 within a second of it, prints the finished hosts' results and lab-02 as
    interrupted, and `history show last` has them all."""
    import threading

    lab.fault("lab-02", "freeze")
    try:
        p = subprocess.Popen([sys.executable, "-m", "fleetctl.cli", "inspect", "all", "--connect-timeout", "120",
                              "--json"], env=lab.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True, preexec_fn=sigint_default)
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(iter(p.stderr.readline, "")), daemon=True)
        reader.start()
        try:
            time.sleep(20)  # the three reachable hosts' inspect: a few seconds each, in parallel
            assert p.poll() is None, "the run ended before lab-02's connect timed out"
            p.send_signal(signal.SIGINT)
            deadline = time.monotonic() + 10
            while not any("interrupted:" in line for line in lines):
                assert time.monotonic() < deadline, "".join(lines)[-2000:]
                time.sleep(0.1)
            assert any("waiting for 1 host(s)" in line for line in lines), "".join(lines)[-2000:]
            t0 = time.monotonic()
            p.send_signal(signal.SIGINT)
            stdout = p.stdout.read()
            p.wait(timeout=30)
            took = time.monotonic() - t0
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    finally:
        lab.fault("lab-02", "thaw")
    reader.join(timeout=5)
    assert p.returncode == 130, (p.returncode, "".join(lines)[-2000:])
    assert took < 1.0, f"exited {took:.2f} s after the second Ctrl-C"
    hosts = {h["host"]: h for h in json.loads(stdout)["hosts"]}
    assert [hosts[h]["status"] for h in ("lab-01", "lab-03", "lab-04")] == ["ok"] * 3
    assert hosts["lab-02"]["status"] == "failed" and "interrupted" in hosts["lab-02"]["error"]
    assert any("stopped while lab-02 was in progress" in line for line in lines)
    r = lab.cli("history", "show", "last", "--json", timeout=60)
    assert r.returncode == 0, r.stderr
    shown = json.loads(r.stdout)
    recorded = {h["host"]: h["status"] for h in shown.get("hosts") or shown.get("run", {}).get("hosts", [])}
    assert recorded == {"lab-01": "ok", "lab-02": "failed", "lab-03": "ok", "lab-04": "ok"}, shown
