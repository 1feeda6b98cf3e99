"""A fleet run's progress (engine/progress.py, issue 50): each host's phase inside a long step
(connect, gather, restart, the kernel's build and test, gate) is shown, as plain lines
(FLEETCTL_PROGRESS=lines: a log or CI) or under the terminal's bar, from a real Fleet run on
local hosts (ansible_connection: local) and a real `fleetctl inspect` process."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time

import pytest
from rich.console import Console

from fleetctl.connection import Settings
from fleetctl.engine.changes import run_handlers
from fleetctl.engine.fleet import Fleet
from fleetctl.engine.progress import RunProgress
from fleetctl.vocab import HostStatus
from helpers.lab import local_host


def _console() -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, width=200, force_terminal=False, color_system=None), buf


def test_lines_name_each_hosts_phases_and_its_end(tmp_path):
    console, buf = _console()

    def job(ctx):
        ctx.phase("build")
        ctx.phase("test")
        ran = run_handlers(ctx, [{"name": "restart sglang", "command": "true"}])
        ctx.phase("gate")
        return ctx.result(HostStatus.CHANGED, data={"handlers": ran})

    with Fleet(Settings(), progress="lines", console=console) as fleet:
        r = fleet.run([local_host(tmp_path, "gpu-a")], job, label="deploy verify_attention")[0]
    assert r.status == HostStatus.CHANGED
    lines = buf.getvalue().splitlines()
    assert lines[:5] == ["deploy verify_attention: gpu-a: connect", "deploy verify_attention: gpu-a: build",
                         "deploy verify_attention: gpu-a: test",
                         "deploy verify_attention: gpu-a: restart: restart sglang",
                         "deploy verify_attention: gpu-a: gate"]
    assert lines[5].startswith("deploy verify_attention: gpu-a: changed (") and lines[5].endswith("; 1/1 done)")
    assert len(lines) == 6


def test_the_bar_shows_each_host_in_progress_with_its_phase():
    buf = io.StringIO()
    console = Console(file=buf, width=120, force_terminal=True, color_system=None)
    p = RunProgress("apply defrag-tier0", 2, console, "bar")
    p.start()
    try:
        p.phase("lab-01", "connect")
        p.phase("lab-02", "restart: restart sglang")
        p.phase("lab-01", "gate")
        time.sleep(0.5)  # Rich refreshes 10 times a second
        shown = buf.getvalue()
        p.done("lab-02", "changed", 3.0)
    finally:
        p.stop()
    assert "lab-01: gate" in shown and "lab-02: restart: restart sglang" in shown and "0/2" in shown


def test_a_host_text_in_a_phase_line_is_not_markup():
    console, buf = _console()
    p = RunProgress("inspect", 1, console, "lines")
    p.phase("[bold]x", "connect")
    assert buf.getvalue() == "inspect: [bold]x: connect\n"
    with pytest.raises(ValueError):
        RunProgress("inspect", 1, console, "dots")


def test_inspect_prints_its_phases_as_lines_to_a_log(tmp_path):
    inv = tmp_path / "hosts.yaml"
    inv.write_text(f"all:\n  hosts:\n    gpu-host:\n      ansible_connection: local\n"
                   f"      fleetctl_python: {sys.executable}\n")
    env = {**os.environ, "FLEETCTL_PROGRESS": "lines"}
    r = subprocess.run([sys.executable, "-m", "fleetctl.cli", "inspect", "all", "-i", str(inv), "--json",
                        "--no-history"], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.startswith("inspect: gpu-host: ")]
    assert lines[:2] == ["inspect: gpu-host: connect", "inspect: gpu-host: gather"]
    assert lines[2].startswith("inspect: gpu-host: ok (")
    bad = subprocess.run([sys.executable, "-m", "fleetctl.cli", "inspect", "all", "-i", str(inv), "--json",
                          "--no-history"], capture_output=True, text=True, timeout=120,
                         env={**env, "FLEETCTL_PROGRESS": "dots"})
    assert bad.returncode == 5 and "FLEETCTL_PROGRESS='dots'" in bad.stderr
