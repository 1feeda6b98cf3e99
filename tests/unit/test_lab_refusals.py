"""The lab's refusals that need no lab: without root it says so and does nothing (the lab itself
is tests/fleet/test_lab.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_lab_refuses_without_root():
    # `fleetctl lab status` as a user that is not root (os.geteuid says so, whoever runs the test)
    code = ("import os, sys; os.geteuid = lambda: 1000; "
            "from fleetctl.cli import main; sys.argv = ['fleetctl', 'lab', 'status', '--lab-id', '9']; main()")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=str(ROOT / "agent")))
    assert r.returncode != 0
    assert "needs root" in r.stderr
