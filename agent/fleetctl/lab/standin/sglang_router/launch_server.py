"""fleetctl STAND-IN for `python -m sglang_router.launch_server` (not SGLang's router).

Run with the stand-in's directory on PYTHONPATH (`PYTHONPATH=/opt/fleetctl-standin python -m
sglang_router.launch_server --dp-size 2 --port 30002`). Laid out as the real launcher
(sglang_router/launch_server.py): `--dp-size` DP workers, each a child process started with
multiprocessing's spawn method, on ports from `--router-dp-worker-base-port` (default 31000)
stepping by 100..1000 to the next free one; it waits for each worker's /health, then routes
requests round-robin to them on `--host`:`--port` (the router takes the server's host and
port). The workers are fleetctl stand-in servers (server.py beside this package). SIGTERM ends
the workers too. Stdlib only, besides what server.py needs.
"""

import argparse
import itertools
import multiprocessing as mp
import os
import random
import signal
import socket
import sys
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free(host, port):
    with socket.socket() as s:
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def worker_ports(host, base, count):
    """`count` free ports from `base`, stepping 100..1000 as sglang_router does."""
    ports, port = [], base
    while len(ports) < count:
        if _free(host, port):
            ports.append(port)
        port += random.randint(100, 1000)
    return ports


def run_worker(argv):
    sys.path.insert(0, HERE)
    import server  # the fleetctl stand-in server
    server.main(argv)


def wait_healthy(host, port, timeout=300.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if urllib.request.urlopen("http://%s:%d/health" % (host, port), timeout=5).status == 200:
                return True
        except OSError:
            pass
        time.sleep(0.2)
    return False


def main():
    p = argparse.ArgumentParser(description="fleetctl stand-in for sglang_router.launch_server (not SGLang)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--dp-size", type=int, default=1)
    p.add_argument("--router-dp-worker-base-port", type=int, default=31000)
    p.add_argument("--model-path", default="fleetctl-standin/tiny")
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    ports = worker_ports(args.host, args.router_dp_worker_base_port, args.dp_size)
    workers = [ctx.Process(target=run_worker, args=(["--host", args.host, "--port", str(port), "--model-path",
                                                     args.model_path],)) for port in ports]
    for w in workers:
        w.start()

    def stop(*_):
        for w in workers:
            w.terminate()
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    if not all(wait_healthy(args.host, port) for port in ports):
        print("fleetctl stand-in router: a worker never became healthy", file=sys.stderr)
        stop()
    urls = itertools.cycle("http://%s:%d" % (args.host, port) for port in ports)

    class Route(BaseHTTPRequestHandler):
        def _forward(self):
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0)) if self.command == "POST" else None
            req = urllib.request.Request(next(urls) + self.path, data=body, method=self.command,
                                         headers={"Content-Type": self.headers.get("Content-Type", "application/json")})
            try:
                with urllib.request.urlopen(req, timeout=600) as r:
                    status, data = r.status, r.read()
            except urllib.error.HTTPError as e:
                status, data = e.code, e.read()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = _forward

        def log_message(self, *a):
            pass

    print("fleetctl stand-in router (not SGLang) pid %d on %s:%d, workers on %s"
          % (os.getpid(), args.host, args.port, ports), file=sys.stderr, flush=True)
    ThreadingHTTPServer((args.host, args.port), Route).serve_forever()


if __name__ == "__main__":
    main()
