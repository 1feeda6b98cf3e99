"""The run history through real sshd (the stand-in servers' lab): a lab sequence (inspect, apply
--check, apply defrag-tier0, validate, rollback) leaves each run and host result in the store
with its status, exit code and change ids, and `history show` prints the apply's report again
with its diffs; a run killed with SIGKILL is listed as interrupted; two runs at once are both
recorded; a become password given with -K and an --api-key in a server's argv are nowhere in the
file's bytes (its -wal and every decompressed blob included), nor a vaulted handler command
or the vault password (`history show --json` included); a corrupt file is one warning and
changes no exit code.

`lab_history` (session scope) is the store that sequence fills: the HTML report's test may reuse
it (`from test_fleet_history import lab_history`)."""

from __future__ import annotations

import json
import os
import secrets
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import become_inventory
from fleetctl import lab as labmod
from fleetctl.history.model import RunState
from fleetctl.history.store import Store
from report_runs import stored_bytes
from helpers.lab import standin_wrapper

PORT = 30051
HOME = "/opt/fleetctl-history"  # root's, 0755: the stand-in's import path must be trusted
PYTHON = "/opt/sglang/venv/bin/python"
SERVER = f"{HOME}/fleetctl-standin/server.py"
# A second stand-in on lab-03 whose command line carries --api-key (as in test_fleet_redaction):
# the wrapper passes the stand-in only the options it knows.
WRAPPER = standin_wrapper(("--host", "--port", "--model-path"))


@dataclass
class LabHistory:
    """The store a lab sequence filled (`path`), its run ids by step, and the apply's change id."""

    path: Path
    runs: dict[str, str]
    change_id: str


def fleetctl(lab, path, *args, stdin=None, env=None):
    return subprocess.run([sys.executable, "-m", "fleetctl.cli", *args], capture_output=True, text=True,
                          input=stdin, env={**lab.env, "FLEETCTL_HISTORY": str(path), **(env or {})}, timeout=300)



@pytest.fixture(scope="session")
def lab_history(server_lab, tmp_path_factory) -> LabHistory:
    """inspect all, apply --check all, apply lab-01:lab-04, validate lab-04 and rollback of that
    change, each recorded in a history file of their own; the lab is left without the change."""
    path = tmp_path_factory.mktemp("lab-history") / "history.sqlite"
    steps = [("inspect", ["inspect", "all"]),
             ("check", ["apply", "defrag-tier0", "all", "--check"]),
             ("apply", ["apply", "defrag-tier0", "lab-01:lab-04", "--yes", "--repeat", "1"]),
             ("validate", ["validate", "lab-04", "--repeat", "1"])]
    runs, cid = {}, None
    for step, args in steps + [("rollback", None)]:
        if step == "rollback":
            args = ["rollback", cid, "lab-04", "--yes"]
        r = fleetctl(server_lab, path, *args, "--json")
        assert r.returncode == 0, (step, r.stdout[-3000:], r.stderr[-3000:])
        if step == "apply":
            cid = json.loads(r.stdout)["change_id"]
        s = Store.open(path)
        runs[step] = s.runs()[-1].run_id
        s.close()
    return LabHistory(path, runs, cid)


def test_each_run_and_host_result_is_recorded(lab_history, server_lab):
    s = Store.open(lab_history.path)
    got = {step: s.run(rid) for step, rid in lab_history.runs.items()}
    assert {k: (r.command, r.state, r.exit_code) for k, r in got.items()} == {
        "inspect": ("inspect", RunState.FINISHED, 0), "check": ("apply", RunState.FINISHED, 0),
        "apply": ("apply", RunState.FINISHED, 0), "validate": ("validate", RunState.FINISHED, 0),
        "rollback": ("rollback", RunState.FINISHED, 0)}
    statuses = {k: {h.host: h.status for h in r.hosts} for k, r in got.items()}
    assert statuses == {
        "inspect": dict.fromkeys(server_lab.hosts, "ok"),
        "check": {"lab-01": "skipped", "lab-02": "changed", "lab-03": "changed", "lab-04": "changed"},
        "apply": {"lab-01": "skipped", "lab-04": "changed"},
        "validate": {"lab-04": "ok"}, "rollback": {"lab-04": "changed"}}
    cid = lab_history.change_id
    envelope = {"schema_version": 1, "exit_code": 0}
    assert (got["check"].doc, got["apply"].doc) == (
        {**envelope, "run_id": lab_history.runs["check"], "change_id": None, "check": True},
        {**envelope, "run_id": lab_history.runs["apply"], "change_id": cid, "check": False})
    assert got["rollback"].hosts[0].doc["change_id"] == cid and got["rollback"].hosts[0].change_ids == [cid]
    assert [h.change_ids for h in got["apply"].hosts] == [[], [cid]] and got["check"].hosts[1].change_ids == []
    applied = got["apply"].hosts[1]
    assert applied.address == server_lab.address("lab-04") and applied.elapsed_s > 0
    assert applied.doc["validation"]["status"] == "passed"
    assert all(f["diff"].startswith("---") for f in applied.doc["plan"]["files"])
    assert [i["id"].startswith("host:/opt/sglang/venv/") for i in got["inspect"].hosts[3].doc["installs"]] == [True]
    assert got["apply"].argv == ["fleetctl", "apply", "defrag-tier0", "lab-01:lab-04", "--yes", "--repeat", "1",
                                 "--json"]
    assert [r.run_id for r in s.runs(command="apply", host="lab-01")] == [lab_history.runs["check"],
                                                                          lab_history.runs["apply"]]
    assert [r.run_id for r in s.runs(status="skipped")] == [lab_history.runs["check"], lab_history.runs["apply"]]


def test_history_show_prints_the_apply_again_with_its_diffs(lab_history, server_lab):
    r = fleetctl(server_lab, lab_history.path, "history", "show", lab_history.runs["apply"], env={"COLUMNS": "200"})
    assert r.returncode == 0, r.stderr
    assert f"fleetctl apply defrag-tier0 lab-01:lab-04 --yes --repeat 1 --json" in r.stdout
    assert "diff — lab-04" in r.stdout and "fleetctl defrag-tier0: was" in r.stdout
    assert f"change id: {lab_history.change_id}" in r.stdout and "recap: changed=1 skipped=1" in r.stdout
    r = fleetctl(server_lab, lab_history.path, "history", "list", "--command", "apply", "--json")
    assert [x["run_id"] for x in json.loads(r.stdout)["runs"]] == [lab_history.runs["check"],
                                                                    lab_history.runs["apply"]]


def test_a_run_killed_with_sigkill_shows_as_interrupted(server_lab, tmp_path):
    path = tmp_path / "history.sqlite"
    p = subprocess.Popen([sys.executable, "-m", "fleetctl.cli", "inspect", "all", "--history", str(path)],
                         env=server_lab.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not (path.exists() and Store.open(path).runs(status="running")):
            assert time.monotonic() < deadline and p.poll() is None, "the run's start was never recorded"
            time.sleep(0.05)
        os.kill(p.pid, signal.SIGKILL)
    finally:
        p.wait()
    [run] = Store.open(path).runs()
    assert (run.command, run.state, run.exit_code, run.hosts) == ("inspect", RunState.INTERRUPTED, None, [])
    r = fleetctl(server_lab, path, "history", "list", "--status", "interrupted", "--json")
    assert [x["state"] for x in json.loads(r.stdout)["runs"]] == ["interrupted"]


def test_two_runs_at_once_are_both_recorded(server_lab, tmp_path):
    path = tmp_path / "history.sqlite"
    env = {**server_lab.env, "FLEETCTL_HISTORY": str(path)}
    procs = [subprocess.Popen([sys.executable, "-m", "fleetctl.cli", "inspect", h, "--json"], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for h in ("lab-01", "lab-02")]
    errs = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errs
    assert not any("warning" in e for e in errs), errs
    runs = Store.open(path).runs()
    assert sorted((r.hosts[0].host, r.state, r.exit_code) for r in runs) == [
        ("lab-01", RunState.FINISHED, 0), ("lab-02", RunState.FINISHED, 0)]
    started = sorted(r.started_at for r in runs)
    assert started[1] < min(r.ended_at for r in runs)  # they did overlap


def test_a_become_password_and_a_servers_api_key_are_nowhere_in_the_file(server_lab, tmp_path):
    path = tmp_path / "history.sqlite"
    pw = labmod.become_password(server_lab.lab_id, server_lab.state_dir)
    key = f"sk-{secrets.token_hex(8)}"
    inv = become_inventory(server_lab, tmp_path / "become.yaml",
                           **{"lab-04": {"ansible_user": labmod.become_users(server_lab.lab_id)["sudo"]},
                              "lab-03": {"ansible_become": False}})
    argv = [PYTHON, SERVER, "--host", "127.0.0.1", "--port", str(PORT), "--model-path", "/models/keyed",
            "--api-key", key]
    r = server_lab.ssh("lab-03", f"mkdir -p {HOME}/fleetctl-standin && chmod 755 {HOME} {HOME}/fleetctl-standin && "
                                 f"printf %s {shlex.quote(WRAPPER)} > {SERVER} && "
                                 f"{{ setsid nohup {shlex.join(argv)} > {HOME}/log 2>&1 < /dev/null & echo $!; }}")
    assert r.returncode == 0, r.stderr
    pid = int(r.stdout.split()[-1])
    try:
        r = fleetctl(server_lab, path, "inspect", "lab-03:lab-04", "-i", inv, "-K", "--json", stdin=pw + "\n")
        assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-2000:])
        assert [s["pid"] for s in json.loads(r.stdout)["hosts"][0]["facts"]["servers"]].count(pid) == 1
    finally:
        r = server_lab.ssh("lab-03", f"kill {pid}; while kill -0 {pid} 2>/dev/null; do sleep 0.1; done; rm -rf {HOME}")
        assert r.returncode == 0, r.stderr
    data = stored_bytes(path)
    assert b"<redacted>" in data  # the bytes read are the record's: the search below can fail
    assert pw.encode() not in data and key.encode() not in data
    [inspected] = Store.open(path).runs()
    assert [h.status for h in inspected.hosts] == ["ok", "ok"]  # lab-04 through sudo with the password
    assert [a for x in inspected.hosts[0].doc["facts"]["servers"] if x["pid"] == pid
            for a in x["argv"]][-2:] == ["--api-key", "<redacted>"]  # what was looked for is there, its value not


def test_a_vaulted_handler_command_and_the_vault_password_are_nowhere_in_the_file(server_lab, tmp_path):
    """lab-02's restart command is a `!vault` value carrying a marker; apply --check puts the
    rendered command in its plan's handlers: stored and shown as <redacted>, the marker and the
    vault password nowhere (the file, its -wal, each blob, `history show --json`)."""
    import yaml
    from ansible.parsing.vault import VaultLib, VaultSecret

    path, pw, mark = tmp_path / "history.sqlite", f"vaultpw-{secrets.token_hex(6)}", f"VAULTSECRET-{secrets.token_hex(6)}"
    (tmp_path / "pw").write_text(pw + "\n")
    tree = yaml.safe_load(server_lab.inventory.read_text())
    lab02 = tree["all"]["children"]["lab"]["hosts"]["lab-02"]
    command = f"{lab02['fleetctl_restart_cmd']} {mark}"
    lab02["fleetctl_restart_cmd"] = "VAULTED"
    cipher = VaultLib([("default", VaultSecret(pw.encode()))]).encrypt(command).decode()
    (tmp_path / "inv.yaml").write_text(yaml.safe_dump(tree, sort_keys=False).replace(
        "VAULTED", "!vault |\n" + "".join(" " * 12 + line + "\n" for line in cipher.splitlines())))
    r = fleetctl(server_lab, path, "apply", "defrag-tier0", "lab-02", "--check", "-i", str(tmp_path / "inv.yaml"),
                 "--vault-password-file", str(tmp_path / "pw"), "--json")
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-2000:])
    assert [h["command"] for h in json.loads(r.stdout)["hosts"][0]["plan"]["handlers"]] == [command]  # it was there
    shown = fleetctl(server_lab, path, "history", "show", "last", "--json")
    assert shown.returncode == 0, shown.stderr
    for data in (stored_bytes(path), shown.stdout.encode()):
        assert b"<redacted>" in data  # the record's bytes: the search below can fail
        assert mark.encode() not in data and pw.encode() not in data
    assert [h["command"] for h in json.loads(shown.stdout)["hosts"][0]["plan"]["handlers"]] == ["<redacted>"]


def test_a_corrupt_file_is_one_warning_and_exit_codes_are_unchanged(server_lab, tmp_path):
    bad = tmp_path / "history.sqlite"
    bad.write_bytes(os.urandom(8192))
    # a pattern that matches nothing is no run: the history is not even opened, so no warning
    for args, rc, warned in ((["status", "lab-04"], 0, 1), (["status", "no-such-host"], 5, 0)):
        plain = fleetctl(server_lab, tmp_path / "unused.sqlite", *args, "--no-history")
        spoilt = fleetctl(server_lab, bad, *args)
        assert (plain.returncode, spoilt.returncode) == (rc, rc), (args, plain.stderr[-2000:], spoilt.stderr[-2000:])
        assert spoilt.stderr.count("warning") == warned, spoilt.stderr
        assert ("this run is not recorded in the history" in spoilt.stderr) == bool(warned)
        assert "warning" not in plain.stderr
    assert not (tmp_path / "unused.sqlite").exists()  # --no-history: not even created
