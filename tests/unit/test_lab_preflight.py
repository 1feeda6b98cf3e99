"""`lab up`'s preflight and kept logs (review newcomer-turn4.md, item 8): an interpreter the lab's
hosts cannot start is refused before anything is built, and a failed `up` keeps its hosts' logs
where its error says they are."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from fleetctl.lab import lifecycle
from fleetctl.lab.base import LabError

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("path", ["/tmp/venv/bin/python", "/opt/sglang/venv/bin/python3", "/tmp"])
def test_an_interpreter_under_a_hosts_private_dir_is_named(path):
    why = lifecycle.hidden_interpreter(path)
    assert why and path.split("/")[1] in why and "outside" in why


def test_an_interpreter_elsewhere_passes():
    assert lifecycle.hidden_interpreter("/usr/bin/python3") is None
    assert lifecycle.hidden_interpreter("/tmpfoo/bin/python") is None  # a prefix, not the dir


def test_a_link_into_the_temp_dir_is_followed_for_the_check(tmp_path):
    # tmp_path may itself be under /tmp: make the link elsewhere, pointing into /tmp
    target_dir = Path(tempfile.mkdtemp(dir="/tmp"))
    link_dir = Path(tempfile.mkdtemp(dir="/var/tmp"))
    try:
        (target_dir / "python").write_text("")
        (link_dir / "python").symlink_to(target_dir / "python")
        assert "/tmp" in (lifecycle.hidden_interpreter(str(link_dir / "python")) or "")
    finally:
        shutil.rmtree(target_dir)
        shutil.rmtree(link_dir)


def test_lab_up_refuses_such_an_interpreter_before_anything_else():
    # a venv-like bin/python under /tmp (a link to this interpreter: sys.executable is the path run)
    venv = Path(tempfile.mkdtemp(dir="/tmp"))
    try:
        (venv / "bin").mkdir()
        (venv / "bin" / "python").symlink_to(os.path.realpath(sys.executable))
        r = subprocess.run([str(venv / "bin" / "python"), "-m", "fleetctl.cli", "lab", "up", "--lab-id", "9"],
                           capture_output=True, text=True, timeout=120,
                           env=dict(os.environ, PYTHONPATH=str(ROOT / "agent")))
    finally:
        shutil.rmtree(venv)
    assert r.returncode != 0
    assert f"fleetctl runs under {venv}/bin/python, inside /tmp" in r.stderr
    assert "needs root" not in r.stderr and "Traceback" not in r.stderr


def test_a_failed_up_keeps_its_hosts_logs(tmp_path):
    sd = tmp_path / "lab"
    (sd / "hosts" / "lab-01").mkdir(parents=True)
    (sd / "hosts" / "lab-01" / "init.log").write_text("sh: 1: exec: python: not found\n")
    (sd / "hosts" / "lab-01" / "sshd.log").write_text("sshd: fatal\n")
    (sd / "hosts" / "lab-01" / "venv.txt").write_text("not a log\n")
    (sd / "hosts" / "lab-02").mkdir()
    (sd / "hosts" / "lab-02" / "init.log").symlink_to("/etc/shadow")  # never followed
    kept = lifecycle.keep_logs(sd)
    assert kept == sd / "failed-up"
    assert sorted(p.relative_to(kept).as_posix() for p in kept.rglob("*") if p.is_file()) == [
        "lab-01/init.log", "lab-01/sshd.log"]
    assert (kept / "lab-01" / "init.log").read_text() == "sh: 1: exec: python: not found\n"
    shutil.rmtree(sd / "hosts")
    assert lifecycle.keep_logs(sd) is None and not kept.exists()


def test_a_failed_up_names_the_kept_log(monkeypatch):
    # a state dir outside the hosts' private dirs (pytest's tmp_path is under /tmp: refused)
    top = Path(tempfile.mkdtemp(dir="/var/tmp"))
    sd = top / "lab"

    def failing_up(n, releases, with_server, lab_id, sd_, *rest):
        (sd_ / "hosts" / "lab-01").mkdir(parents=True)
        (sd_ / "hosts" / "lab-01" / "sshd.log").write_text("bind: Address already in use\n")
        raise LabError(f"sshd did not start in the lab host, see {sd_ / 'hosts' / 'lab-01' / 'sshd.log'}")

    downs = []
    monkeypatch.setattr(lifecycle, "require_root", lambda: None)
    monkeypatch.setattr(lifecycle, "ensure_wheel", lambda r: None)
    monkeypatch.setattr(lifecycle, "lab_down", lambda lab_id, sd_, kh: (downs.append(sd_),
                                                                          shutil.rmtree(sd_ / "hosts", True)))
    monkeypatch.setattr(lifecycle, "_up", failing_up)
    try:
        with pytest.raises(LabError) as e:
            lifecycle.lab_up(hosts=1, releases=["0.5.23"], lab_id=9, state_dir=sd, known_hosts=top / "kh")
        log = sd / "failed-up" / "lab-01" / "sshd.log"
        assert f"see {log}" in str(e.value) and f"kept in {sd / 'failed-up'}" in str(e.value)
        assert log.read_text() == "bind: Address already in use\n"
        assert len(downs) == 2  # before the build and after the failure
    finally:
        shutil.rmtree(top)
