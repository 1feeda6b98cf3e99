"""The lab's SGLang stand-in server (see server.py, the HTTP half, and engine.py, the model half;
it is not SGLang and says so everywhere).

This package only locates the files: the lab copies the whole directory to
/opt/fleetctl-standin/ on each host and runs `restart.sh` there; tests start `server.py`
directly with `start_local` (tests/helpers/lab.py imports it by path). server.py and engine.py never import
fleetctl: server.py, run as a script, imports engine.py from its own directory.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

DIR = Path(__file__).resolve().parent
SERVER = DIR / "server.py"
ENGINE = DIR / "engine.py"
INSTRUMENTS = DIR / "instruments.py"
RESTART = DIR / "restart.sh"
FILES = (SERVER, ENGINE, INSTRUMENTS, RESTART)  # what a host needs, copied into one directory


def start_local(port: int, behavior: dict | None = None, workdir: Path | None = None,
                host: str = "127.0.0.1", python: str = sys.executable) -> subprocess.Popen:
    """Start the stand-in on host:port in the background and return its process (not waited for).

    behavior: the behaviour-file object (server.py docstring), written to workdir/behavior.json;
    the log goes to workdir/server.log (workdir default: the current directory).
    The caller stops it (terminate + wait) and waits for /health itself.
    """
    workdir = Path(workdir or ".")
    bfile = workdir / "behavior.json"
    bfile.write_text(json.dumps(behavior or {}))
    with open(workdir / "server.log", "ab") as logf:
        return subprocess.Popen(
            [python, str(SERVER), "--host", host, "--port", str(port), "--behavior", str(bfile)],
            stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT)

