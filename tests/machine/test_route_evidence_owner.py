"""The route check reads a process's routing evidence where the hook writes it (issue 48; review
round 4): under the process's effective uid (R4-6: a server whose real and effective uids differ,
started by `setpriv --euid`, as a setuid launcher leaves it). Needs root (another uid's files)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from fleetctl.probes import runas
from fleetctl.probes.traffic import routecheck

NOBODY = 65534


@pytest.fixture
def public():
    top = Path(tempfile.mkdtemp(prefix="fc-evidence-", dir="/tmp"))
    top.chmod(0o755)
    (top / "route-evidence").mkdir(mode=0o755)
    yield top / "route-evidence"
    subprocess.run(["rm", "-rf", str(top)], check=True)


def _record(ev: Path, pid: int, uid: int) -> None:
    d = ev / str(uid)
    d.mkdir(mode=0o755)
    os.chown(d, uid, uid)
    f = d / f"{pid}.json"
    f.write_text(json.dumps({"pid": pid, "uid": uid, "start_time": routecheck.start_time(pid),
                             "boot_id": routecheck.boot_id(), "build": "/b",
                             "module": "/b/m.so", "captured": [], "eager_routed": 1, "fallbacks": {},
                             "written": time.time(), "trigger": "eager"}))
    os.chown(f, uid, uid)
    f.chmod(stat.S_IRUSR | stat.S_IWUSR | stat.S_IRGRP | stat.S_IROTH)


def test_a_server_whose_effective_uid_is_not_its_real_one_is_read_under_its_effective_uid(public):
    server = subprocess.Popen(["setpriv", f"--euid={NOBODY}", "sleep", "60"])
    try:
        deadline = time.monotonic() + 10
        while (runas.ids_of(server.pid) or (None,))[0] != NOBODY:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        _record(public, server.pid, NOBODY)
        got = routecheck.read_evidence(str(public), server.pid)
        assert (got["state"], got["uid"], got["why"]) == ("fresh", NOBODY, None), got
    finally:
        server.kill()
        server.wait()
