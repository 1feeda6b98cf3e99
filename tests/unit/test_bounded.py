"""probes/bounded.py with real child processes: a host tool that answers, ignores SIGTERM, hangs,
or leaves a child holding its output; each call returns within its limit and a short grace,
whatever the tool does, and kills what it started. A child that SIGKILL cannot end (state D) is
made for real in tests/machine/test_stuck_tool.py (a cgroup freezer needs root)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from fleetctl.probes import bounded
from fleetctl.probes.facts import containers, gpus, units

SLACK_S = 1.5  # a loaded CI machine's scheduling, on top of the limit and bounded.GRACE_S


@pytest.fixture(autouse=True)
def no_host_deadline():
    bounded.start(None)
    yield
    bounded.start(None)


def timed(fn, *args, **kw):
    t0 = time.monotonic()
    out = fn(*args, **kw)
    return out, time.monotonic() - t0


def gone(pid: int) -> bool:
    return bounded.state(pid) in (None, "Z")


def test_a_tool_that_answers_gives_its_output_and_status():
    r = bounded.run(["sh", "-c", "echo out; echo err >&2; exit 3"], 5)
    assert (r.stdout, r.stderr, r.returncode, r.error, r.state) == ("out\n", "err\n", 3, None, None)


def test_a_tool_that_is_not_there_raises_file_not_found():
    with pytest.raises(FileNotFoundError):
        bounded.run(["/nonexistent/nvidia-smi"], 5)


@pytest.mark.parametrize("script", [
    "trap '' TERM; while :; do sleep 1; done",  # ignores SIGTERM
    "sleep 30",  # hangs
    "sleep 30 & sleep 30; wait",  # and a child of its own that holds the output pipe
    "setsid sleep 4 & sleep 30",  # and one that left its process group, holding the pipe past the kill
])
def test_a_tool_that_does_not_answer_is_killed_at_its_limit(tmp_path: Path, script: str):
    pidfile = tmp_path / "pids"
    r, took = timed(bounded.run, ["sh", "-c", f"echo $$ > {pidfile}; {script}"], 1, name="tool")
    assert took < 1 + bounded.GRACE_S + SLACK_S, took
    assert r.returncode is None and r.state is None
    assert r.error == "tool did not answer within 1 s: killed"
    assert gone(int(pidfile.read_text())) and gone(r.pid)


def test_the_host_deadline_shortens_a_tools_limit_never_below_the_minimum():
    bounded.start(bounded.RESERVE_S + 2)
    assert 1 < bounded.limit(20) <= 2
    assert bounded.limit(0.5) == 0.5
    bounded.start(bounded.RESERVE_S - 10)
    assert bounded.limit(20) == bounded.MIN_S
    r, took = timed(bounded.run, ["sleep", "30"], 20)
    assert took < bounded.MIN_S + bounded.GRACE_S + SLACK_S and "within 1 s" in r.error


def test_the_state_of_a_process_is_read_from_proc_stat():
    assert bounded.state(os.getpid()) == "R"
    assert bounded.state(2 ** 22 + 1) is None  # above pid_max's most: no such process
    assert bounded.describe("nvidia-smi", 42, "D") == "nvidia-smi (pid 42, state D: uninterruptible sleep)"


# STAND-IN host tool (systemctl, docker, nvidia-smi): never answers, ignoring SIGTERM, with a
# child of its own holding stdout
HANGING_TOOL = """#!/bin/sh
trap '' TERM
sleep 60 &
wait
"""


def hanging(tmp_path: Path, name: str, monkeypatch) -> Path:
    """A hanging stand-in `name` first on PATH; its path."""
    tool = tmp_path / "bin" / name
    tool.parent.mkdir(exist_ok=True)
    tool.write_text(HANGING_TOOL)
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tool.parent}{os.pathsep}{os.environ['PATH']}")
    return tool


def test_a_hanging_systemctl_leaves_the_unit_files_read_within_the_host_deadline(tmp_path: Path, monkeypatch):
    (tmp_path / "units").mkdir()
    (tmp_path / "units" / "sglang.service").write_text(
        "[Service]\nExecStart=/opt/sglang/venv/bin/python -m sglang.launch_server --port 30000\n")
    from_files = units.services(search=(str(tmp_path / "units"),), systemctl=False)
    assert [u["unit"] for u in from_files] == ["sglang.service"]
    bounded.start(bounded.RESERVE_S + 1)
    found, took = timed(units.services, search=(str(tmp_path / "units"),),
                        systemctl=str(hanging(tmp_path, "systemctl", monkeypatch)))
    assert took < 1 + bounded.GRACE_S + SLACK_S, took
    assert found == from_files
    assert [e.split(" did not answer")[0] for e in bounded.errors()] == ["systemctl"]


def test_a_hanging_runtime_inspect_gives_no_fields_within_the_host_deadline(tmp_path: Path, monkeypatch):
    hanging(tmp_path, "docker", monkeypatch)
    bounded.start(bounded.RESERVE_S + 1)
    found, took = timed(containers.inspect, "docker", "0" * 64)
    assert took < 1 + bounded.GRACE_S + SLACK_S, took
    assert found == {} and bounded.errors() == ["docker did not answer within 1 s: killed"]


def test_a_hanging_nvidia_smi_is_a_reason_within_the_host_deadline(tmp_path: Path, monkeypatch):
    hanging(tmp_path, "nvidia-smi", monkeypatch)
    bounded.start(bounded.RESERVE_S + 2)  # the GPU query gets what is left: 2 s, not its 20
    (rows, errors, reason), took = timed(gpus.gpu_facts)
    assert took < 2 + bounded.GRACE_S + SLACK_S, took
    assert (rows, errors) == ([], [])
    assert reason.startswith("nvidia-smi did not answer within ") and reason.endswith(" s: killed"), reason
    assert bounded.errors() == [reason]
