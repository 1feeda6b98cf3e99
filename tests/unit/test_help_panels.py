"""The help pages (issue 50): a command's own options and the common ones (-i, -l, -e, --json,
--yes, --check) come first, in the default "Options" panel; the shared connection, gate,
replay, path and history options follow in panels of their own (Typer's rich_help_panel), as
the real `fleetctl CMD --help` prints them."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest


def panels(*command: str) -> list[tuple[str, list[str]]]:
    """(panel title, the long option names in it) of `fleetctl COMMAND --help`, in order."""
    env = {**os.environ, "COLUMNS": "100", "NO_COLOR": "1", "TERM": "dumb"}
    r = subprocess.run([sys.executable, "-m", "fleetctl.cli", *command, "--help"], capture_output=True, text=True,
                       env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    out: list[tuple[str, list[str]]] = []
    for line in r.stdout.splitlines():
        title = re.match(r"^╭─ (.+?) ─", line)
        if title:
            out.append((title.group(1), []))
        elif out:
            out[-1][1].extend(re.findall(r"^│\s+(--[a-z][a-z0-9-]*)", line))
    return out


@pytest.mark.parametrize("command", [("apply",), ("deploy", "kernel"), ("validate",), ("inspect",)])
def test_the_common_options_come_first_and_the_shared_ones_are_grouped(command):
    shown = panels(*command)
    titles = [t for t, _ in shown]
    assert titles[titles.index("Options") - 1] in ("Arguments", "Options") and titles.index("Options") <= 1
    first = dict(shown)["Options"]
    assert first[:2] == ["--inventory", "--limit"] and "--json" in first and "--help" in first
    for held in ("--connect-timeout", "--forks", "--ssh-config", "--history", "--health-timeout"):
        assert held not in first, f"{held} in {command}'s first panel"
    assert "Connection" in titles and titles.index("Connection") > titles.index("Options")
    assert "--connect-timeout" in dict(shown)["Connection"]


def test_apply_help_first_panel_is_short():
    first = dict(panels("apply"))["Options"]
    everything = sum(len(names) for _, names in panels("apply"))
    assert len(first) <= everything // 2, (len(first), everything)
    assert set(dict(panels("apply"))) >= {"Connection", "Smoke gate", "Load gate", "Paths and history"}
