"""The change engine (changes.py) on a `local` host, without sshd; the one vocabulary and config
table; the playbook sandbox; where playbooks and kernels are found; the module layering."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from fleetctl import config, inventory
from fleetctl.lab import standin
from fleetctl.engine.changes import Change, ChangeOptions, change_job, change_probe, execute
from fleetctl.engine.ledger import recover_job, rollback_job
from fleetctl.connection import Settings
from fleetctl.connection import BecomeFailed, LockBusy, OutputTooLarge, RemoteTimeout, Unreachable
from fleetctl.errors import EXIT_INTERRUPTED, EXIT_OK, EXIT_OPTIONS, EXIT_PARSE, HostError, HostFailed, ParseError, ProbeFailed
from fleetctl.engine.context import HostResult
from fleetctl.engine.fleet import Fleet, exit_code, parse_serial
from fleetctl.paths import find_playbook, project_dir, shipped_dir
from fleetctl.engine.playbooks.model import load_playbook
from fleetctl.probes.change import ledger as ledger_probe
from fleetctl.probes.facts import procs as procs_probe
from fleetctl.probes.traffic import smoke as smoke_probe
from fleetctl.engine.gates.smoke import SmokeGate
from fleetctl.engine.validate import SmokeOptions
from fleetctl.vocab import ChangeState, GateStatus, HostStatus, PlanStatus
from helpers import ledger as ledger_of
from helpers.lab import local_host

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "agent" / "fleetctl"


# ------------------------------------------------------------------ one vocabulary, one table

def test_the_words_are_the_ones_json_always_had():
    assert [s.value for s in HostStatus] == ["ok", "changed", "skipped", "failed", "unreachable", "not attempted"]
    assert json.dumps([HostStatus.NOT_ATTEMPTED, GateStatus.SKIPPED]) == '["not attempted", "skipped"]'
    assert [s.value for s in GateStatus] == ["passed", "failed", "skipped"]  # words; a skipped gate's reason beside
    assert f"{HostStatus.CHANGED}={1}" == "changed=1" and str(ChangeState.ROLLED_BACK) == "rolled-back"
    assert {PlanStatus(p).host_status for p in ("change", "ok", "skipped", "failed")} == \
        {HostStatus.CHANGED, HostStatus.OK, HostStatus.SKIPPED, HostStatus.FAILED}


def test_control_side_words_and_numbers_equal_the_probes_own():
    """The probes are stdlib-only and run on the host, so they keep their own constants."""
    assert tuple(s.value for s in ChangeState) == ledger_probe.STATES
    assert config.STATE_DIR == ledger_probe.STATE_DIR
    assert config.DEFAULT_SGLANG_PORT == procs_probe.DEFAULT_PORT


def test_port_and_inventory_var_names_are_spelled_once_on_the_control_side():
    own = [p for p in PKG.rglob("*.py") if "probes" not in p.parts and "lab" not in p.parts]
    port = [p.name for p in own if re.search(r"\b30000\b", p.read_text())]
    assert port == ["config.py"]
    for var in config.HOST_VARS:
        code = [p.name for p in own
                if re.search(rf"[\"']{var.name}[\"']", p.read_text()) and p.name != "config.py"]
        assert code == [], f"{var.name} spelled as a string in {code}"


def test_host_properties_read_the_table(tmp_path):
    path = tmp_path / "hosts.yaml"
    path.write_text("all:\n  hosts:\n    a:\n      fleetctl_sglang_port: 30001\n      fleetctl_restart_cmd: r\n"
                    "      fleetctl_latency_slack: 0.5\n    b: {}\n")
    a, b = inventory.load(path).select("a:b")
    assert (a.sglang_port, a.sglang_host, a.restart_cmd, a.latency_slack, a.smoke_cmd) == (30001, "127.0.0.1", "r",
                                                                                           0.5, None)
    assert (b.sglang_port, b.restart_cmd, b.latency_slack) == (None, None, 0.0)


# ------------------------------------------------------------------ results and exit codes

def test_control_signals_are_result_fields_and_json_keeps_its_keys():
    r = HostResult("h", "a", HostStatus.NOT_ATTEMPTED, "stopped", data={"batch": 1}, interrupted=True)
    assert r.to_json() == {"host": "h", "address": "a", "status": "not attempted", "error": "stopped",
                           "elapsed_s": 0.0, "batch": 1, "interrupted": True}
    assert "parse_error" not in r.to_json()
    assert exit_code([r]) == EXIT_INTERRUPTED
    assert exit_code([HostResult("h", "a", HostStatus.FAILED, "x", parse_error=True)]) == EXIT_PARSE
    assert exit_code([HostResult("h", "a", HostStatus.OK, data={"interrupted": True})]) == EXIT_OK


# ------------------------------------------------------------------ the engine on a local host

def sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def write_change(path: Path, new: str, cid: str, facts: dict, **kw) -> Change:
    old = path.read_bytes()
    return Change(cid, "test", [{"path": str(path), "pre_sha256": sha(old), "post_sha256": sha(new.encode()),
                                 "new_text": new}], facts, str(path.parent), **kw)


def run_one(host, job):
    with Fleet(Settings(), forks=1, timeout=60) as fleet:
        return fleet.run([host], job)[0]


def test_a_change_that_passes_its_checks_is_applied_and_its_handler_runs(tmp_path):
    target, marker, state = tmp_path / "mod.py", tmp_path / "restarted", tmp_path / "state"
    target.write_text("X = 1\n")
    host = local_host(tmp_path)
    opts = ChangeOptions(smoke=SmokeOptions(), state_dir=str(state))
    handlers = [{"name": "restart sglang", "command": f"echo ran >> {marker}"}]

    def work(ctx, rec):
        res = HostResult(ctx.host.name, ctx.conn.address, HostStatus.OK)
        return execute(ctx, res, write_change(target, "X = 2\n", "c-ok", {}, handlers=handlers), opts)

    r = run_one(host, change_job(str(state), work))
    assert (r.status, r.error, r.data["change_id"]) == (HostStatus.CHANGED, None, "c-ok")
    assert r.data["validation"] == {"status": "skipped", "reason": "no server"}
    assert target.read_text() == "X = 2\n" and marker.read_text() == "ran\n"
    assert ledger_of.in_dir(state)["c-ok"] == ChangeState.APPLIED


def test_a_change_whose_checks_fail_is_rolled_back_byte_identical(tmp_path):
    target, state = tmp_path / "mod.py", tmp_path / "state"
    original = b"X = 1  # \xc3\xa9\r\n"
    target.write_bytes(original)
    host = local_host(tmp_path)
    opts = ChangeOptions(state_dir=str(state))

    def work(ctx, rec):
        res = HostResult(ctx.host.name, ctx.conn.address, HostStatus.OK)
        change = write_change(target, "X = (\n", "c-bad", {}, checks=lambda: ["mod.py:1: does not parse"])
        return execute(ctx, res, change, opts)

    r = run_one(host, change_job(str(state), work))
    assert r.status == HostStatus.FAILED and r.error == "rolled back: mod.py:1: does not parse"
    assert r.data["rolled_back"] is True and target.read_bytes() == original
    assert ledger_of.in_dir(state)["c-bad"] == ChangeState.ROLLED_BACK


def test_a_pending_change_is_recovered_first_and_the_restart_handler_runs(tmp_path):
    """A run killed after the write leaves "pending"; the next change job undoes it (rollback
    --last here) before anything else, and restarts SGLang with fleetctl_restart_cmd."""
    target, marker, state = tmp_path / "mod.py", tmp_path / "restarted", tmp_path / "state"
    target.write_text("X = 1\n")
    host = local_host(tmp_path, fleetctl_restart_cmd=f"echo ran >> {marker}")
    change = write_change(target, "X = 2\n", "c-killed", {})

    def killed(ctx):
        change_probe(ctx, "apply", str(state), change_id=change.change_id, playbook="test", operator="t",
                     files=change.files, root=change.root, commit=False)
        return ctx.result(HostStatus.OK)

    run_one(host, killed)
    assert target.read_text() == "X = 2\n" and ledger_of.in_dir(state)["c-killed"] == ChangeState.PENDING
    r = run_one(host, rollback_job(None, False, str(state)))
    assert (r.status, r.data["change_id"]) == (HostStatus.CHANGED, "c-killed")
    assert target.read_text() == "X = 1\n" and marker.read_text() == "ran\n"
    assert ledger_of.in_dir(state)["c-killed"] == ChangeState.ROLLED_BACK


def test_change_jobs_tell_the_fan_out_what_stopping_them_leaves_behind(tmp_path):
    job = change_job(str(tmp_path), lambda ctx, rec: None)
    assert "pending" in job.stopped_note
    fleet_src = (PKG / "engine" / "fleet.py").read_text()
    assert "ledger" not in fleet_src and "parse_error\"]" not in fleet_src


# ------------------------------------------------------------------ the playbook sandbox

ESCAPES = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.system('touch PWNED') }}",
    "{{ lipsum.__globals__['os'].system('touch PWNED') }}",
    "{% set l = [] %}{{ l.append(1) }}",
]


@pytest.mark.parametrize("template", ESCAPES)
def test_a_template_cannot_run_code_on_the_control_machine(tmp_path, monkeypatch, template):
    monkeypatch.chdir(tmp_path)
    src = (ROOT / "playbooks" / "defrag-tier0.yaml").read_text()
    shutil.copytree(ROOT / "playbooks" / "templates", tmp_path / "templates")
    (tmp_path / "templates" / "defrag-tier0" / "value.py.j2").write_text("True\n" + template + "\n")
    (tmp_path / "pb.yaml").write_text(src)
    pb = load_playbook(tmp_path / "pb.yaml")
    with pytest.raises(ParseError) as e:
        pb.tasks[0].value.render({"finding": {}, "facts": {}, "findings": {}, "host": "h"})
    assert e.value.exit_code == EXIT_PARSE
    assert re.match(rf"{re.escape(str(tmp_path))}/templates/defrag-tier0/value\.py\.j2:2: ", str(e.value))
    assert not (tmp_path / "PWNED").exists()


# ------------------------------------------------------------------ playbooks and kernels

def test_shipped_playbooks_and_kernels_are_found_not_the_current_directory(tmp_path, monkeypatch):
    (tmp_path / "playbooks").mkdir()
    (tmp_path / "playbooks" / "defrag-tier0.yaml").write_text("not: a playbook\n")
    (tmp_path / "kernels").mkdir()
    monkeypatch.chdir(tmp_path)
    assert find_playbook("defrag-tier0") == shipped_dir("playbooks") / "defrag-tier0.yaml"
    assert (project_dir("kernels") / "verify_attention" / "kernel.yaml").is_file()
    assert find_playbook("defrag-tier0", tmp_path / "playbooks") == tmp_path / "playbooks" / "defrag-tier0.yaml"
    with pytest.raises(ParseError, match="--kernels-dir"):
        project_dir("kernels", tmp_path / "missing")


def test_after_a_rollback_that_restarts_the_server_its_health_is_checked(tmp_path):
    """Review L13: the rollback's restart handler runs, then the health wait; a server that does
    not come back is reported in the reason and in data["after_rollback"]."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = standin.start_local(port, {}, tmp_path)
    try:
        assert smoke_probe.wait_healthy(f"http://127.0.0.1:{port}", 120)[0]
        target, state, marker = tmp_path / "mod.py", tmp_path / "state", tmp_path / "restarted-once"
        target.write_text("X = 1\n")
        host = local_host(tmp_path, fleetctl_sglang_port=port)
        # the first run (after the write) restarts nothing; the rollback's run stops the server
        handler = {"name": "restart sglang",
                   "command": f"if [ -e {marker} ]; then kill {server.pid}; fi; touch {marker}"}
        opts = ChangeOptions(smoke=SmokeOptions(health_timeout=2, repeat=1), state_dir=str(state))

        def work(ctx, rec):
            res = HostResult(ctx.host.name, ctx.conn.address, HostStatus.OK)
            change = write_change(target, "X = 2\n", "c-l13", {"servers": [{"pid": server.pid, "port": port}]},
                                  handlers=[handler],
                                  checks=lambda: ["a check failed"])
            change.gates = [SmokeGate()]
            return execute(ctx, res, change, opts)

        with Fleet(Settings(), forks=1, timeout=300) as fleet:  # the baseline keeps the 120 s rollback reserve
            r = fleet.run([host], change_job(str(state), work))[0]
    finally:
        server.kill()
        server.wait(10)
    assert r.status == HostStatus.FAILED and r.data.get("rolled_back") is True, r.error
    assert r.error.startswith("rolled back: a check failed; after the rollback the server is not healthy: "
                              f"127.0.0.1:{port}: the server exited before it became healthy: nothing listens on "
                              f"127.0.0.1:{port} yet (servers: pid {server.pid} (exited))"), r.error
    [after] = r.data["after_rollback"]
    assert (after["port"], after["ok"]) == (port, False)
    assert target.read_text() == "X = 1\n"


def test_recover_command_undoes_a_pending_change_and_applies_nothing(tmp_path):
    """`fleetctl recover HOSTS` (issue 13): a killed run's pending change is undone, the restart
    handler runs, nothing is applied; a second recover finds nothing."""
    target, marker, state = tmp_path / "mod.py", tmp_path / "restarted", tmp_path / "state"
    target.write_text("X = 1\n")
    host = local_host(tmp_path, fleetctl_restart_cmd=f"echo ran >> {marker}")
    change = write_change(target, "X = 2\n", "c-pending", {})
    run_one(host, lambda ctx: ctx.result(HostStatus.OK, data=change_probe(
        ctx, "apply", str(state), change_id=change.change_id, playbook="t", operator="t", files=change.files,
        root=change.root, commit=False)))
    r = run_one(host, recover_job(str(state)))
    assert (r.status, [c["change_id"] for c in r.data["recovered"]]) == (HostStatus.CHANGED, ["c-pending"])
    assert target.read_text() == "X = 1\n" and marker.read_text() == "ran\n"
    assert ledger_of.in_dir(state)["c-pending"] == ChangeState.ROLLED_BACK
    again = run_one(host, recover_job(str(state)))
    assert (again.status, again.data["recovered"]) == (HostStatus.OK, [])
    assert marker.read_text() == "ran\n"  # nothing pending: no restart


def test_the_engine_names_no_cli_flag_and_the_cli_names_its_own(tmp_path):
    """Bad numbers are the engine's ValueError; the CLI says which flag (exit 5)."""
    with pytest.raises(ValueError, match="'0%' is not a positive number"):
        parse_serial("1,0%", 10)
    with pytest.raises(ValueError, match="forks 0"):
        Fleet(Settings(), forks=0)
    inv = tmp_path / "hosts.yaml"
    inv.write_text("all:\n  hosts:\n    here:\n      ansible_connection: local\n")
    for argv, said in ((["apply", "defrag-tier0", "all", "--check", "--serial", "0%"],
                        "--serial: '0%' is not a positive number or a percentage in (0, 100]"),
                       (["inspect", "all", "--forks", "0"], "--forks must be at least 1"),
                       (["status", "all", "--run-timeout", "0"], "--run-timeout must be positive")):
        r = subprocess.run([sys.executable, "-m", "fleetctl.cli", *argv, "-i", str(inv)], capture_output=True,
                           text=True, timeout=60)
        assert (r.returncode, said in " ".join(r.stderr.split())) == (EXIT_OPTIONS, True), (argv, r.stderr)


@pytest.mark.parametrize("error,status,said", [
    (HostFailed("refused"), HostStatus.FAILED, "refused"),
    (ProbeFailed("probe failed on the host: X"), HostStatus.FAILED, "probe failed on the host: X"),
    (LockBusy("another fleetctl run"), HostStatus.FAILED, "another fleetctl run"),
    (BecomeFailed("sudo refused"), HostStatus.FAILED, "sudo refused"),
    (OutputTooLarge("output over 64 MiB"), HostStatus.FAILED, "output over 64 MiB"),
    (RemoteTimeout("host deadline reached"), HostStatus.FAILED, "deadline (60 s) passed: host deadline reached"),
    (Unreachable("connection lost"), HostStatus.UNREACHABLE, "connection lost"),
    (ParseError("playbook.yaml:3: bad"), HostStatus.FAILED, "playbook.yaml:3: bad"),
], ids=lambda v: type(v).__name__ if isinstance(v, Exception) else None)
def test_every_per_host_error_is_a_host_error_and_fails_only_its_host(tmp_path, error, status, said):
    """errors.HostError roots every per-host failure (Unreachable its own branch): the fan-out
    reports it on its host, with the error's own text, and goes on with the other host."""
    def job(ctx):
        if ctx.host.name == "bad":
            raise error
        return ctx.result(HostStatus.OK)

    path = tmp_path / "hosts.yaml"
    path.write_text("all:\n  hosts:\n    bad:\n      ansible_connection: local\n    good:\n      ansible_connection: local\n")
    with Fleet(Settings(), forks=2, timeout=60) as fleet:
        bad, good = fleet.run(inventory.load(path).select("all"), job)
    assert (bad.status, bad.error, good.status) == (status, said, HostStatus.OK)
    assert bad.parse_error is (True if isinstance(error, ParseError) else None)
    assert isinstance(error, HostError) != isinstance(error, ParseError)
