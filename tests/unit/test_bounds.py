"""Bounded reads from a host (security review M3, L9): no output stream is held past its cap,
and an HTTP answer is read to 16 MiB at most, never through a proxy."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading

import pytest

from fleetctl.connection import OutputTooLarge
from fleetctl.connection.base import OUTPUT_MAX, OutputBuffer
from fleetctl.probes.traffic import smoke

GIB = 1 << 30


def test_output_buffer_raises_past_its_cap_or_keeps_both_ends():
    b = OutputBuffer(10, "the facts probe")
    b.add(b"0123456789")
    with pytest.raises(OutputTooLarge, match="^output over 0 MiB from the facts probe$"):
        b.add(b"x")
    ends = OutputBuffer(8, "handler", keep_ends=True)
    for chunk in (b"ab", b"cdefgh", b"ijklmnop", b"qr"):
        ends.add(chunk)
    assert ends.value() == b"abcd\n[... 10 bytes of output dropped ...]\nopqr"
    small = OutputBuffer(8, "handler", keep_ends=True)
    small.add(b"abc")
    assert small.value() == b"abc"


PEAK = """
import json, sys, time
from fleetctl.connection import OutputTooLarge, Session, Settings
from fleetctl.connection.local import LocalConnection
from fleetctl.inventory import Host
t0 = time.monotonic()
try:
    LocalConnection(Host("here", {}, ("all",)), Session(Settings())).run(["head", "-c", str(1 << 30), "/dev/zero"], timeout=120)
    err = None
except OutputTooLarge as e:
    err = str(e)
# VmHWM: this process's own peak RSS (proc(5)); ru_maxrss keeps the parent's high-water mark at
# exec (Linux), so it would count the test runner's memory (torch, once a test module imported it)
hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"error": err, "s": time.monotonic() - t0, "peak": hwm * 1024}))
"""


def test_a_gibibyte_of_output_is_cut_at_the_cap_and_never_held():
    p = subprocess.run([sys.executable, "-c", PEAK], capture_output=True, text=True, timeout=300)
    r = json.loads(p.stdout)
    assert r["error"] == "output over 64 MiB from 'head'"
    assert r["peak"] < OUTPUT_MAX + (200 << 20), r
    assert r["s"] < 60


class Huge(http.server.BaseHTTPRequestHandler):
    """/health 200; /generate answers 1 GiB (streamed: only what the client reads is made)."""

    def log_message(self, *a):
        pass

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(GIB))
        self.end_headers()
        zeros = b"0" * (1 << 20)
        try:
            for _ in range(GIB >> 20):
                self.wfile.write(zeros)
        except OSError:
            pass  # the client stopped reading


@pytest.fixture
def huge_server():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Huge)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv.server_address[1]
    srv.shutdown()
    srv.server_close()


def test_smoke_reads_16_mib_at_most_and_never_through_a_proxy(huge_server, monkeypatch):
    with __import__("socket").socket() as s:  # a loopback port nobody listens on: a proxy that refuses
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    for var in ("http_proxy", "HTTP_PROXY"):
        monkeypatch.setenv(var, f"http://127.0.0.1:{dead}")
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    r = smoke.main({"servers": [{"pid": os.getpid(), "port": huge_server}], "repeat": 1, "warmup": 0,
                    "health_timeout": 10, "request_timeout": 30})
    [s] = r["servers"]
    assert s["health_wait_s"] is not None and s["health_wait_s"] < 5  # /health answered: no proxy used
    assert not s["ok"] and s["error"] == (f"/generate answered HTTP None: {{\"error\": \"answer over 16 MiB from "
                                          f"http://127.0.0.1:{huge_server}/generate\"}}")


class Deep(http.server.BaseHTTPRequestHandler):
    """Answers every GET with 100,000 nested JSON arrays: past the parser's depth."""

    def log_message(self, *a):
        pass

    def do_GET(self):
        body = b"[" * 100000
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def test_an_answer_nested_past_the_parsers_depth_is_no_json_and_raises_nothing():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Deep)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        assert smoke._request(f"http://127.0.0.1:{srv.server_address[1]}/server_info", timeout=10) == (200, None)
    finally:
        srv.shutdown()
        srv.server_close()
