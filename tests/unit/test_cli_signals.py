"""SIGTERM's exit code (cli/signals.py): 143 for a run that a SIGTERM interrupted, the code that
the --json document (cli/fleet.py _finish), the history and the exit status all take from it."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest


@pytest.mark.parametrize("signame, interrupted", [("SIGTERM", 143), ("SIGINT", 130)])
def test_an_interrupted_run_exits_143_after_sigterm_130_after_ctrl_c_other_codes_stand(signame, interrupted):
    script = textwrap.dedent(f"""
        import os, signal
        from fleetctl.cli import signals
        from fleetctl.errors import EXIT_INTERRUPTED
        signals.install()
        signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's, where a shell's `&` ignored SIGINT
        try:
            os.kill(os.getpid(), signal.{signame})
            signal.pause()
        except KeyboardInterrupt:
            pass
        print(signals.exit_code(EXIT_INTERRUPTED), signals.exit_code(2), signals.exit_code(0))
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(interrupted), "2", "0"]
