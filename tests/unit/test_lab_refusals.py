"""The lab's refusals that need no lab: without root it says so and does nothing (the lab itself
is tests/fleet/test_lab.py)."""

from __future__ import annotations

import os

from fleetctl import lab as labmod


def test_lab_refuses_without_root(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert labmod.main(["--lab-id", "9", "status"]) != 0
    assert "needs root" in capsys.readouterr().err
