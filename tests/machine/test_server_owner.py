"""A server is identified by its owner as well as its socket (issue 48; review round 4, R4-4,
turn 3's N6): as root, a process of uid 65534 with a server's argv that really listens on its
own loopback port (a STAND-IN `sglang.launch_server`: an HTTP server logging the headers it
gets) is refused by the target rule: it gets no request and no API key, neither as a server of
its own nor as the successor of a restarting root server."""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from fleetctl.probes.facts import procs
from fleetctl.probes.traffic import smoke
from helpers.proc import free_port

NOBODY = 65534
KEY = "sk-PROD-N6-TEST"
FAKE = '''import http.server, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
class H(http.server.BaseHTTPRequestHandler):
    def _log(self):
        with open(LOG, "a") as f:
            f.write("%s %s %s\\n" % (self.command, self.path, self.headers.get("Authorization")))
    def do_GET(self):
        self._log(); self.send_response(200); self.end_headers(); self.wfile.write(b"{}")
    do_POST = do_GET
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
'''


@pytest.fixture
def fake():
    """The stand-in, run as nobody from a directory of nobody's: (pid, port, log path)."""
    top = Path(tempfile.mkdtemp(prefix="fc-n6-", dir="/tmp"))
    top.chmod(0o755)
    (top / "sglang").mkdir()
    (top / "sglang" / "__init__.py").write_text("")
    log = top / "requests.log"
    (top / "sglang" / "launch_server.py").write_text(f"LOG = {str(log)!r}\n" + FAKE)
    subprocess.run(["chown", "-R", f"{NOBODY}:{NOBODY}", str(top)], check=True)
    port = free_port()
    p = subprocess.Popen(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "/usr/bin/python3",
                          "-m", "sglang.launch_server", "--host", "127.0.0.1", "--port", str(port), "--model-path", "m"],
                         cwd=top)
    try:
        deadline = time.monotonic() + 20
        while not any(s["pid"] == p.pid for s in procs.find_servers()[0]) or not _listening(port):
            assert time.monotonic() < deadline and p.poll() is None
            time.sleep(0.1)
        yield p.pid, port, log
    finally:
        p.kill()
        p.wait()
        subprocess.run(["rm", "-rf", str(top)], check=True)


def _listening(port: int) -> bool:
    import socket
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_a_server_shaped_process_of_another_uid_gets_no_request_and_no_key(fake):
    pid, port, log = fake
    [found] = [s for s in procs.find_servers()[0] if s["pid"] == pid]
    assert (found["uid"], found["python"]) == (NOBODY, "/usr/bin/python3")  # identified by its argv and socket...
    r = smoke.main({"servers": [{"pid": pid, "python": "/usr/bin/python3", "port": port, "host": "127.0.0.1"}],
                    "api_key": KEY, "repeat": 1, "warmup": 0, "health_timeout": 5})
    assert r["servers"] == []
    [refused] = r["refused"]
    assert refused["pid"] == pid and refused["reason"].startswith(f"pid {pid} runs as uid {NOBODY}: not root"), refused
    assert not log.exists()  # ...but sent nothing, the key least of all
    # the inventory's account for the servers makes it one
    r = smoke.main({"servers": [{"pid": pid, "python": "/usr/bin/python3", "port": port, "host": "127.0.0.1"}],
                    "api_key": KEY, "repeat": 1, "warmup": 0, "health_timeout": 5, "server_user": "nobody"})
    assert r["refused"] == [] and [s["pid"] for s in r["servers"]] == [pid]
    assert f"Bearer {KEY}" in log.read_text()


def test_it_is_never_the_successor_of_a_restarting_root_server(fake):
    """A root server (gone: its restart under way) whose interpreter and port the fake claims:
    the successor must have the server's uid and parent, so the fake is not taken for it."""
    pid, port, log = fake
    gone = subprocess.Popen(["true"])
    gone.wait()
    sel = {"pid": gone.pid, "python": "/usr/bin/python3", "port": port, "host": "127.0.0.1", "uid": 0, "ppid": os.getpid()}
    r = smoke.main({"servers": [sel], "api_key": KEY, "repeat": 1, "warmup": 0, "health_timeout": 1})
    [s] = r["servers"]
    assert s["pid"] == gone.pid and not s["ok"] and "no server of the same interpreter" in s["error"]
    assert not log.exists()
