"""fleetctl STAND-IN for `python -m sglang_router.launch_router --pd-disaggregation` (not SGLang's router).

Run with the stand-in's directory on PYTHONPATH (`PYTHONPATH=/opt/fleetctl-standin python -m
sglang_router.launch_router --pd-disaggregation --prefill http://127.0.0.1:31100 9100 --decode
http://127.0.0.1:31200 --host 127.0.0.1 --port 8100`: the launch line of SGLang's PD docs). A
`/generate` gets what a PD router adds (`bootstrap_host`: the prefill worker's host,
`bootstrap_port`: its bootstrap port, 8998 when the --prefill gives none, `bootstrap_room`: a
random 63-bit id; GenerateReqInput's fields, 0.5.23 io_struct.py:291-293) and goes to the prefill
and the decode worker at once; the decode worker's answer is the router's. `GET /health` answers
200 when every worker's /health does; other GETs are the decode worker's. Stdlib only.
"""

import argparse
import json
import os
import random
import sys
import threading
import urllib.error
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

DEFAULT_BOOTSTRAP_PORT = 8998  # ServerArgs.disaggregation_bootstrap_port (0.5.10 server_args.py:697)
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def parse(argv=None):
    """The router's arguments: prefill [(url, bootstrap port)], decode [url], host, port."""
    p = argparse.ArgumentParser(description="fleetctl stand-in for sglang_router.launch_router (not SGLang)")
    p.add_argument("--pd-disaggregation", action="store_true", required=True)
    p.add_argument("--prefill", nargs="+", action="append", required=True, metavar=("URL", "BOOTSTRAP_PORT"))
    p.add_argument("--decode", action="append", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    a = p.parse_args(argv)
    a.prefill = [(x[0], int(x[1]) if len(x) > 1 and x[1] != "none" else DEFAULT_BOOTSTRAP_PORT) for x in a.prefill]
    return a


def _call(url, body=None, method="GET"):
    """(status, bytes) of one exchange with a worker; (502, error JSON) when it does not answer."""
    req = urllib.request.Request(url, data=body, method=method, headers={"Content-Type": "application/json"})
    try:
        with _OPENER.open(req, timeout=600) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except OSError as e:
        return 502, json.dumps({"error": {"message": "worker %s: %s" % (url, e)}}).encode()


def main(argv=None):
    a = parse(argv)

    class Route(BaseHTTPRequestHandler):
        def answer(self, status, data):
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path.split("?")[0] in ("/health", "/health_generate"):
                bad = [u for u in [u for u, _ in a.prefill] + a.decode if _call(u + "/health")[0] != 200]
                return self.answer(503 if bad else 200, b"")
            self.answer(*_call(a.decode[0] + self.path))

        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if self.path.split("?")[0] != "/generate":
                return self.answer(*_call(a.decode[0] + self.path, body, "POST"))
            try:
                req = json.loads(body or b"{}")
            except ValueError:
                return self.answer(400, b'{"error": {"message": "request body is not JSON"}}')
            url, bootstrap = random.choice(a.prefill)
            req.update(bootstrap_host=urllib.parse.urlsplit(url).hostname, bootstrap_port=bootstrap,
                       bootstrap_room=random.getrandbits(63))
            data = json.dumps(req).encode()
            prefill = threading.Thread(target=_call, args=(url + "/generate", data, "POST"))
            prefill.start()
            out = _call(random.choice(a.decode) + "/generate", data, "POST")
            prefill.join()
            self.answer(*out)

        def log_message(self, *_):
            pass

    print("fleetctl stand-in PD router (not SGLang) pid %d on %s:%d, prefill %s, decode %s"
          % (os.getpid(), a.host, a.port, a.prefill, a.decode), file=sys.stderr, flush=True)
    ThreadingHTTPServer((a.host, a.port), Route).serve_forever()


if __name__ == "__main__":
    main()
