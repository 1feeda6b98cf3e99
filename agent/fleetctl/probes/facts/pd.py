"""Remote probe helper: a server's part in SGLang's prefill/decode disaggregation (PD), read from its argv.

Stdlib only (Python 3.8+). Which flags say it, as the releases define them:
- a worker: `--disaggregation-mode {null,prefill,decode}` (default "null": not disaggregated) and
  `--disaggregation-bootstrap-port N` (default 8998, "Bootstrap server port on the prefill
  server"): 0.5.10 sglang/srt/server_args.py:695,697 (fields) and :5743,5757 (flags); 0.5.23
  sglang/srt/arg_groups/fields/disagg.py:55-58 and :81-83 (the fields the flags are made from).
- a PD router: `python -m sglang_router.launch_router --pd-disaggregation --prefill URL [BOOTSTRAP_PORT]
  --decode URL` (sglang_router, a package of its own: the launch line of SGLang's PD docs), and
  the older `python -m sglang.srt.disaggregation.mini_lb --prefill URL... --decode URL...
  [--prefill-bootstrap-ports N...]` (in neither the 0.5.10 nor the 0.5.23 wheel: its module is
  gone from sglang/srt/disaggregation/ there, but launch lines of older installs still name it).
A PD worker refuses a plain /generate (no bootstrap_room: 0.5.10 managers/scheduler.py:1780-1788,
0.5.23 managers/scheduler.py:3048-3056, HTTP 400) and checks its health with a fake room
(/health_generate: 0.5.10 entrypoints/http_server.py:477-514, 0.5.23 entrypoints/http_server.py:722-765).
"""

from . import topology
from .. import redact

DEFAULT_BOOTSTRAP_PORT = 8998  # ServerArgs.disaggregation_bootstrap_port (0.5.10 server_args.py:697)
ROUTER_MODULES = ("sglang_router.launch_router", "sglang.srt.disaggregation.mini_lb")
LOOPBACK = ("127.0.0.1", "localhost", "0.0.0.0", "::1", "::", "[::1]", "[::]")
MAX_PEERS = 64  # URLs kept of one router's command line


def _values(argv, name):
    """Each `name`'s values in argv, in order: the words after it up to the next option."""
    out = []
    for i, a in enumerate(argv):
        if a == name:
            j = i + 1
            while j < len(argv) and not argv[j].startswith("--"):
                out.append(argv[j])
                j += 1
        elif a.startswith(name + "="):
            out.append(a[len(name) + 1:])
    return out


def _port(word):
    return int(word) if word.isdigit() and 0 < int(word) < 65536 else None


def url_port(url):
    """(host, port) of an http URL `url` ("http://127.0.0.1:31100"; port 80 when none is given),
    None when it is none such."""
    rest = url.split("://", 1)[1] if "://" in url else url
    hostport = rest.split("/", 1)[0].rsplit("@", 1)[-1]
    host, sep, port = hostport.rpartition(":")
    if not sep or "]" in port:
        return (hostport, 80) if hostport else None
    p = _port(port)
    return (host, p) if p else None


def _router(argv):
    """prefill [{url, bootstrap_port}] and decode [url] of a PD router's argv (see the module docstring)."""
    prefill, decode = [], []
    for w in _values(argv, "--prefill"):
        if _port(w) is not None or w == "none":
            if prefill:
                prefill[-1]["bootstrap_port"] = _port(w)
        else:
            prefill.append({"url": w, "bootstrap_port": DEFAULT_BOOTSTRAP_PORT})
    ports = _values(argv, "--prefill-bootstrap-ports")  # mini_lb's, one per --prefill URL
    for p, w in zip(prefill, ports):
        p["bootstrap_port"] = _port(w)
    decode = _values(argv, "--decode")
    return ([dict(p, url=redact.text(p["url"])) for p in prefill[:MAX_PEERS]],
            [redact.text(u) for u in decode[:MAX_PEERS]])


def role(module, argv):
    """The PD part of a server whose program is `module` (`-m MODULE`, else None) with argv
    `argv`: None (not disaggregated), {"role": "prefill", "bootstrap_port": N}, {"role":
    "decode", "bootstrap_port": None}, or {"role": "router", "prefill": [{url, bootstrap_port}],
    "decode": [url]} (URLs redacted: redact.text)."""
    if module in ROUTER_MODULES:
        if module == ROUTER_MODULES[0] and "--pd-disaggregation" not in argv:
            return None
        prefill, decode = _router(argv)
        return {"role": "router", "prefill": prefill, "decode": decode}
    mode = topology.option(argv, "--disaggregation-mode")
    if mode not in ("prefill", "decode"):
        return None
    port = _port(topology.option(argv, "--disaggregation-bootstrap-port") or "") or DEFAULT_BOOTSTRAP_PORT
    return {"role": mode, "bootstrap_port": port if mode == "prefill" else None}


def local_port(url, local=()):
    """The port of `url` when it names this host (loopback, a wildcard or one of `local`), else None."""
    hp = url_port(url)
    if hp is None or (hp[0] not in LOOPBACK and hp[0].strip("[]") not in local):
        return None
    return hp[1]


def routed(router, local=()):
    """{port: "prefill"|"decode"} of the workers on this host that PD router `router` (role()'s
    router dict) sends to."""
    out = {}
    for p in router.get("prefill") or []:
        port = local_port(p["url"], local)
        if port:
            out[port] = "prefill"
    for u in router.get("decode") or []:
        port = local_port(u, local)
        if port:
            out[port] = "decode"
    return out
