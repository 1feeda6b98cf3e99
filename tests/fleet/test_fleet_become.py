"""Become (ansible_become, sudo) through real sshd: a non-root login with sudo does what root
does (inspect, validate, apply, status, rollback; deploy kernel in test_fleet_deploy), a wrong password or a login without sudo rights is
`failed` with sudo's message and changes nothing, and the password shows up nowhere: not in
fleetctl's output, not on the host (ledger, backups, changed files, /tmp), not in any process's
/proc/PID/cmdline or environ sampled on the host during the run."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from conftest import become_inventory
from fleetctl import lab as labmod


SITE = "/opt/sglang/venv/lib/python3.11/site-packages"
HOSTS = ("lab-03", "lab-04")  # lab-03: NOPASSWD sudo; lab-04: sudo with the password
SPY_PW = "/tmp/.fleetctl-spy-pw"  # the sampler's copy of the password, left out of the search
# Samples /proc/*/cmdline and environ of every process on the host until /tmp/.fleetctl-spy-stop
# (or 240 s): prints `samples=N seen=M found=K`, M counting samples in which a become command
# (its ready marker) was running, K those holding the password (from SPY_PW, never an argument).
SPY = (f"n=0; seen=0; found=0; end=$(($(date +%s)+240)); "
       "while [ ! -e /tmp/.fleetctl-spy-stop ] && [ $(date +%s) -lt $end ]; do "
       "s=$(cat /proc/[0-9]*/cmdline /proc/[0-9]*/environ 2>/dev/null | tr '\\0' '\\n'); n=$((n+1)); "
       "case $s in *fleetctl-ready-*) seen=$((seen+1));; esac; "
       f"printf '%s\\n' \"$s\" | grep -qaFf {SPY_PW} && found=$((found+1)); sleep 0.02; done; "
       "echo samples=$n seen=$seen found=$found")


@pytest.fixture(scope="module")
def become(server_lab, tmp_path_factory):
    """The lab's become users and password (created by `lab up`), and inventories reaching HOSTS as them."""
    password = labmod.become_password(server_lab.lab_id, server_lab.state_dir)
    users = labmod.become_users(server_lab.lab_id)
    d = tmp_path_factory.mktemp("become")

    def inventory(name: str, **per_host: dict) -> str:
        return become_inventory(server_lab, d / f"{name}.yaml", **per_host)

    sudo = {"ansible_user": users["sudo"]}
    return {
        "password": password,
        "good": inventory("good", **{h: sudo for h in HOSTS}),
        "bad": inventory("bad", **{"lab-04": {**sudo, "ansible_become_password": "not-" + password},
                                   "lab-02": {"ansible_user": users["nosudo"],
                                              "ansible_become_password": password},
                                   "lab-03": {"ansible_user": users["tty"]}}),
    }


def cli(lab, *args, stdin=""):
    return subprocess.run([sys.executable, "-m", "fleetctl.cli", *args], capture_output=True, text=True,
                          input=stdin, env=lab.env, timeout=300)


def as_json(r):
    try:
        return {h["host"]: h for h in json.loads(r.stdout)["hosts"]}
    except (json.JSONDecodeError, KeyError):
        raise AssertionError(f"no JSON (exit {r.returncode}): {r.stdout[-2000:]} {r.stderr[-2000:]}") from None


def digest(lab, host):
    r = lab.ssh(host, f"cd {SITE} && find sglang -type f -name '*.py' | sort | xargs sha256sum | sha256sum")
    assert r.returncode == 0, r.stderr
    return r.stdout.split()[0]


@pytest.mark.parametrize("kind", ["paramiko", "ssh"])
def test_become_user_does_what_root_does_and_the_password_is_nowhere(server_lab, become, kind):
    lab, pw = server_lab, become["password"]
    inv = ["-i", become["good"], "-c", kind, "-K"]
    root = as_json(cli(lab, "inspect", "all", "--json", "-c", kind))
    before = {h: digest(lab, h) for h in HOSTS}
    assert lab.ssh("lab-04", f"umask 077; cat > {SPY_PW}", input=pw).returncode == 0
    spy = subprocess.Popen(["ssh", "-o", "BatchMode=yes", "-o", f"UserKnownHostsFile={lab.known_hosts}",
                            "-i", str(lab.state_dir / "client_ed25519"), f"root@{lab.address('lab-04')}", SPY],
                           stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
    runs = []
    try:
        time.sleep(0.5)
        runs.append(r := cli(lab, "inspect", "all", "--json", *inv, stdin=pw + "\n"))
        mine = as_json(r)
        for h in HOSTS:
            assert mine[h]["status"] == "ok", mine[h]
            for k in ("facts", "allocator_call_sites", "need_sort_origins"):
                assert mine[h][k] == root[h][k], (h, k)
        root_v = as_json(cli(lab, "validate", "all", "--json", "-c", kind))
        runs.append(r := cli(lab, "validate", "all", "--json", *inv, stdin=pw + "\n"))
        mine_v = as_json(r)
        for h in HOSTS:  # the smoke decode ran on the host under sudo: same server, same tokens
            assert mine_v[h]["status"] == "ok" and root_v[h]["status"] == "ok", mine_v[h]
            assert ([(s["port"], s["ok"], s["output_ids"]) for s in mine_v[h]["servers"]]
                    == [(s["port"], s["ok"], s["output_ids"]) for s in root_v[h]["servers"]]), h
            assert mine_v[h]["servers"] and mine_v[h]["servers"][0]["output_ids"], mine_v[h]
        runs.append(r := cli(lab, "apply", "defrag-tier0", "all", "--yes", "--json", *inv, stdin=pw + "\n"))
        applied = as_json(r)
        assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
        cid = json.loads(r.stdout)["change_id"]
        for h in HOSTS:
            assert applied[h]["status"] == "changed" and applied[h]["validation"]["status"] == "passed"
            for f in applied[h]["plan"]["files"]:
                st = lab.ssh(h, f"stat -c %U {f['path']} && sha256sum {f['path']}").stdout.split()
                assert st[0] == "root" and st[1] == f["post_sha256"], (h, f["path"], st)
        runs.append(r := cli(lab, "status", "all", "--json", *inv, stdin=pw + "\n"))
        assert r.returncode == 0 and {as_json(r)[h]["status"] for h in HOSTS} == {"ok"}, r.stdout[-2000:]
        ledger = lab.ssh("lab-04", "cat /var/lib/fleetctl/ledger.jsonl").stdout
        assert cid in ledger
        backups = lab.ssh("lab-04", f"find /var/lib/fleetctl/backups/{cid} -type f | wc -l").stdout.strip()
        assert int(backups) >= 1
        # the password on the host: ledger, backups, every changed (uploaded) file, /tmp
        files = " ".join(f["path"] for f in applied["lab-04"]["plan"]["files"])
        g = lab.ssh("lab-04", f"grep -rlaF --exclude={SPY_PW.rsplit('/', 1)[1]} -f {SPY_PW} "
                    f"/var/lib/fleetctl /tmp {files}; echo rc=$?")
        assert g.stdout.strip() == "rc=1", g.stdout  # grep: 1 = searched everything, found nothing
        runs.append(r := cli(lab, "rollback", cid, "all", "--yes", "--json", *inv, stdin=pw + "\n"))
        assert r.returncode == 0 and {as_json(r)[h]["status"] for h in HOSTS} == {"changed"}, r.stdout[-2000:]
    finally:
        lab.ssh("lab-04", "touch /tmp/.fleetctl-spy-stop")
        out = spy.communicate(timeout=30)[0]
        lab.ssh("lab-04", f"rm -f /tmp/.fleetctl-spy-stop {SPY_PW}")
    assert {h: digest(lab, h) for h in HOSTS} == before  # rolled back byte-identical
    counts = dict(kv.split("=") for kv in out.split())
    assert int(counts["seen"]) > 0, out  # the sampler did see become commands running
    assert counts["found"] == "0", out
    for r in runs:
        assert pw not in r.stdout and pw not in r.stderr


def test_wrong_password_no_sudo_rights_and_requiretty_fail_with_sudos_message(server_lab, become):
    state = "cat /var/lib/fleetctl/ledger.jsonl 2>/dev/null | sha256sum"
    before = {h: (digest(server_lab, h), server_lab.ssh(h, state).stdout) for h in ("lab-02", "lab-03", "lab-04")}
    r = cli(server_lab, "apply", "defrag-tier0", "all", "--yes", "--json", "-i", become["bad"])
    hosts = as_json(r)
    assert r.returncode != 0
    assert hosts["lab-04"]["status"] == "failed" and "sudo refused the password" in hosts["lab-04"]["error"]
    assert "Sorry, try again" in hosts["lab-04"]["error"]
    assert hosts["lab-02"]["status"] == "failed" and "not in the sudoers file" in hosts["lab-02"]["error"], hosts
    assert hosts["lab-03"]["status"] == "failed"
    assert "sudo requires a tty (Defaults requiretty)" in hosts["lab-03"]["error"], hosts["lab-03"]
    assert {h: (digest(server_lab, h), server_lab.ssh(h, state).stdout) for h in ("lab-02", "lab-03", "lab-04")} == before
    assert become["password"] not in r.stdout + r.stderr
