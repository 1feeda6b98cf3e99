"""Smoke decode probe (remote side, stdlib only, Python 3.8+): does the host still decode?

Runs on the host itself, because the inference port is usually not reachable from the
operator's machine. The control side names servers as the facts probe identified them; which
socket of theirs is decoded, if any, is decided here by targets.py (only a server's own
listening socket, on loopback or an address of this host: review N6), again while one is not
listening yet. For each target it waits for `GET /health` to answer 200 (503 means "still
starting", connection refused means "not up yet"), then decodes a fixed prompt given as
`input_ids` greedily `repeat` times through `POST /generate` and checks the answer. Optionally
it runs an offline smoke command instead / as well. A target of node rank 1 and above (a
non-zero-rank node of a multi-node server, targets.py) gets the health wait only: SGLang runs no
tokenizer there, and its port is `launch_dummy_health_check_server`'s, which answers `/health`,
`/health_generate` (and `/ping` from 0.5.10) with 200 and nothing else (0.4.6.post5 and 0.5.2
srt/utils.py, 0.5.10 and 0.5.23 srt/utils/common.py; started by entrypoints/engine.py for
`node_rank >= 1`); its decode is rank 0's.

Request and response shapes are SGLang's own: `GenerateReqInput` (sglang/srt/managers/
io_struct.py), `SamplingParams` (sglang/srt/sampling/sampling_params.py), the out dict and
meta_info built by `TokenizerManager` (sglang/srt/managers/tokenizer_manager.py:
`completion_tokens`, `finish_reason` = `FINISH_LENGTH.to_json()` = {"type": "length",
"length": N}, `e2e_latency` in seconds), routes in sglang/srt/entrypoints/http_server.py
(`/health` answers 503 while the server status is Starting; `/model_info` since 0.5,
`/get_model_info` in older releases).

PD disaggregation (facts/pd.py): a PD worker (`--disaggregation-mode prefill|decode`) answers a
plain /generate with HTTP 400 (no bootstrap room), so it is never decoded itself. A PD router
identified on this host is decoded like any server, and the workers it sends to are checked by
their own `GET /health_generate` (which SGLang runs with a fake bootstrap room on a PD worker:
0.5.10 entrypoints/http_server.py:477-514, 0.5.23 entrypoints/http_server.py:722-765), said
"ROLE worker: decoded through the PD router on :PORT"; a worker no router here sends to gets the
same check, said "ROLE worker: health_generate only" (PD_ALONE). The inventory's
fleetctl_pd_router (http://ADDRESS:PORT, an address of this host: targets.connect_address) names
the router in front of the workers where none is identified here: it is decoded (PD_NAMED), and
the workers are said to be decoded through it.
"""

import json
import os
import signal
import statistics
import subprocess
import time
import urllib.error
import urllib.request

from .. import redact
from ..facts import listeners, pd, procs, targets, topology

# A fixed 12-token prompt; every id is < 512 so it is valid for any real vocabulary and the stand-in's.
DEFAULT_INPUT_IDS = [1, 306, 263, 450, 338, 310, 278, 322, 411, 393, 372, 471]
TAIL_LINES = 20
# /generate's answer from a port that serves no such route (FastAPI's 404, which SGLang's dummy
# health server gives), and what the error adds when /server_info did not answer either
NOT_FOUND = '/generate answered HTTP 404: {"detail": "Not Found"}'
DUMMY_HINT = ("; the port answers /health but neither /generate nor /server_info, as SGLang's dummy health server of a "
              "non-zero-rank node does: a --node-rank its command line does not give (a --config file?)")
MAX_BODY = 16 << 20  # bytes of one HTTP answer read at most
# The servers are on this host: never through the environment's http_proxy (review L9).
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))
# How long a server that exited is given for a successor (a supervisor's restart: systemd's
# RestartSec= is 100 ms by default, Docker's restart policy backs off from 100 ms) before the wait
# for it ends, instead of running to the health deadline (a handler may ask for 600 s).
EXIT_GRACE_S = 15.0
EXITED = "the server exited before it became healthy"
# The inventory's fleetctl_sglang_api_key (main sets it from params; it is never returned):
# sent as `Authorization: Bearer`, as SGLang's --api-key checks it (sglang/srt/utils.py add_api_key_middleware).
API_KEY = None


def _request(url, body=None, timeout=60.0):
    """One HTTP exchange, never through a proxy, the answer read up to MAX_BODY bytes. Returns
    (status, parsed JSON or None). Raises OSError when no answer or one over MAX_BODY."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if API_KEY:
        headers["Authorization"] = "Bearer " + API_KEY
    req = urllib.request.Request(url, data=data, headers=headers)
    try:
        with _OPENER.open(req, timeout=timeout) as r:
            status, raw = r.status, r.read(MAX_BODY + 1)
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read(MAX_BODY + 1)
    if len(raw) > MAX_BODY:
        raise OSError("answer over %d MiB from %s" % (MAX_BODY >> 20, url))
    try:
        return status, json.loads(raw) if raw else None
    except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
        return status, None


def wait_healthy(base, deadline_s, request_timeout=60.0, exited=None):
    """Poll GET base/health until 200, backing off 0.1 s doubling to 2 s, for deadline_s seconds.
    `exited`: None, or a callable asked after each poll that is not 200, answering None while the
    server can still become healthy and why not once it cannot (watch(): its process exited and
    none took its place), which ends the wait at once.

    Returns (healthy: bool, waited seconds, None when healthy else the error as text: "health
    deadline exceeded after N s: last answer ..." or EXITED + ": ...").
    """
    t0 = time.monotonic()
    delay, last = 0.1, "no answer yet"
    while True:
        left = deadline_s - (time.monotonic() - t0)
        try:
            status, _ = _request(base + "/health", timeout=max(0.1, min(request_timeout, left)))
            if status == 200:
                return True, time.monotonic() - t0, None
            last = "HTTP 503 (still starting)" if status == 503 else "HTTP %d" % status
        except OSError as e:  # refused, reset, timeout: not up (yet)
            last = "no answer (%s)" % (getattr(e, "reason", None) or e)
        gone = exited() if exited else None
        if gone:
            return False, time.monotonic() - t0, "%s: %s (last answer %s)" % (EXITED, gone, last)
        left = deadline_s - (time.monotonic() - t0)
        if left <= 0:
            return False, time.monotonic() - t0, "health deadline exceeded after %.0f s: last answer %s" % (
                deadline_s, last)
        time.sleep(min(delay, left))
        delay = min(delay * 2, 2.0)


def watch(selectors, port, host, server_user, target):
    """wait_healthy's `exited` for `target` ({pid, port, ...}: targets.pick of `selectors`, `port`,
    `host`, `server_user`): None while its process runs, or once it has exited while a server that
    succeeds it (targets.live: a supervisor's restart) claims its port, listening or not yet
    (target["pid"] becomes the successor's once it listens); once none has for EXIT_GRACE_S
    seconds, why.
    A target of no identified process (pid None: the inventory's router) is never said gone."""
    since = []

    def exited():
        if target["pid"] is None or targets.alive(target["pid"]):
            return None
        picked = targets.pick(selectors, port, host, server_user)
        nxt = [t for t in picked["targets"] if t["port"] == target["port"]]
        if nxt or any(p["port"] == target["port"] and not p["exited"] for p in picked["pending"]):
            target["pid"] = nxt[0]["pid"] if nxt else target["pid"]  # one not listening yet: followed once it does
            since.clear()
            return None
        since[:] = since or [time.monotonic()]
        if time.monotonic() - since[0] < EXIT_GRACE_S:
            return None
        return "pid %d exited and no server took its place in %g s" % (target["pid"], EXIT_GRACE_S)
    return exited


def check_generate(status, out, n):
    """Problems with one /generate answer for max_new_tokens=n, ignore_eos (empty list if fine)."""
    if status != 200 or not isinstance(out, dict):
        return ["/generate answered HTTP %s: %s" % (status, json.dumps(out)[:300])]
    meta = out.get("meta_info") or {}
    ids = out.get("output_ids")
    problems = []
    if not isinstance(ids, list) or len(ids) != n:
        problems.append("expected %d output_ids, got %s" % (n, len(ids) if isinstance(ids, list) else ids))
    if meta.get("completion_tokens") != n:
        problems.append("meta_info.completion_tokens is %r, expected %d" % (meta.get("completion_tokens"), n))
    finish = meta.get("finish_reason")
    if not isinstance(finish, dict) or finish.get("type") != "length":
        problems.append("finish_reason is %r, expected type 'length'" % (finish,))
    return problems


def _server_facts(base, timeout):
    """model_path from /model_info (or /get_model_info before 0.5), version, stand_in flag and
    server_args (its parallel layout as the server resolved it: topology.server_info) from
    /server_info (or /get_server_info); missing facts are None."""
    facts = {"model_path": None, "version": None, "stand_in": False, "server_args": None}
    for paths, keys in ((("/model_info", "/get_model_info"), ("model_path",)),
                        (("/server_info", "/get_server_info"), ("version", "stand_in"))):
        for path in paths:
            try:
                status, body = _request(base + path, timeout=timeout)
            except OSError:
                continue
            if status == 200 and isinstance(body, dict):
                facts.update({k: body[k] for k in keys if k in body})
                if "stand_in" in keys:
                    facts["server_args"] = topology.server_info(body)
                break
    return facts


def choose(selectors, port, host, deadline_s, server_user=None):
    """targets.pick(selectors, port, host, server_user), asked again (0.1 s doubling to 2 s) while
    a server is pending (not listening yet), for at most deadline_s seconds; but not past
    EXIT_GRACE_S seconds while every pending one waits only for servers that exited and none took
    their place (targets.select's "exited"). Returns (its last answer, seconds spent)."""
    t0 = time.monotonic()
    delay, gone_since = 0.1, None
    while True:
        picked = targets.pick(selectors, port, host, server_user)
        now = time.monotonic()
        left = deadline_s - (now - t0)
        gone = bool(picked["pending"]) and all(p["exited"] for p in picked["pending"])
        gone_since = (gone_since or now) if gone else None
        if not picked["pending"] or left <= 0 or (gone and now - gone_since >= EXIT_GRACE_S):
            return picked, now - t0
        time.sleep(min(delay, left))
        delay = min(delay * 2, 2.0)


def pending_error(p, health_timeout, waited):
    """The error of choose()'s pending entry `p` ({pid, reason, exited}) once the wait of `waited`
    seconds ended: EXITED when it waits for servers that exited, else the health deadline."""
    if p["exited"]:
        return "%s: %s (waited %.0f s)" % (EXITED, p["reason"], waited)
    return "health deadline exceeded after %.0f s: %s" % (health_timeout, p["reason"])


PD_ALONE = "%s worker: health_generate only"
PD_ROUTED = "%s worker: decoded through the PD router on :%d"
PD_ROUTER = "decoded through the PD router on :%d"


PD_NAMED = "decoded through the PD router %s (fleetctl_pd_router)"


def named_router(url, local):
    """(host, port, None) to reach the inventory's fleetctl_pd_router `url` ("http://ADDRESS:PORT"),
    or (None, None, why) when ADDRESS is not one of this host's (targets.connect_address)."""
    hp = pd.url_port(url)
    if hp is None:
        return None, None, "fleetctl_pd_router %s is not http://ADDRESS:PORT" % url
    address, why = targets.connect_address(hp[0].strip("[]"), local)
    if address is None:
        return None, None, "fleetctl_pd_router %s %s" % (url, why)
    return address, hp[1], None


def pd_role(pid):
    """The PD part of process `pid` (pd.role of its /proc/PID/cmdline; None: not disaggregated or unreadable)."""
    argv = procs.cmdline(pid) or []
    _, kind, target, args = procs.python_program(argv) if argv else (None, None, None, [])
    return pd.role(target if kind == "m" else None, args)


def pd_plan(picked, local=(), named=None):
    """{pid: {"role", "via"}} for the PD servers among targets `picked` (targets.pick's
    "targets"): a router's via is PD_ROUTER; a worker's PD_ROUTED when a router among them sends
    to its port (pd.routed), else "ROLE worker: " + PD_NAMED when the inventory names one (`named`:
    its URL), else PD_ALONE."""
    roles = {t["pid"]: pd_role(t["pid"]) for t in picked}
    routers = {t["port"]: pd.routed(roles[t["pid"]], local) for t in picked
               if roles[t["pid"]] and roles[t["pid"]]["role"] == "router"}
    plan = {}
    for t in picked:
        r = roles[t["pid"]]
        if not r:
            continue
        if r["role"] == "router":
            plan[t["pid"]] = {"role": "router", "via": PD_ROUTER % t["port"]}
            continue
        front = next((port for port, sends in sorted(routers.items()) if t["port"] in sends), None)
        via = PD_ROUTED % (r["role"], front) if front is not None else (
            "%s worker: %s" % (r["role"], PD_NAMED % named) if named else PD_ALONE % r["role"])
        plan[t["pid"]] = {"role": r["role"], "via": via}
    return plan


def pd_health(base, res, timeout):
    """A PD worker's check, in place on smoke_server result `res`: GET base/health_generate
    answered 200 (ok), else its status in error."""
    try:
        status, _ = _request(base + "/health_generate", timeout=timeout)
    except OSError as e:
        status = "no answer (%s)" % (getattr(e, "reason", None) or e)
    res["ok"] = status == 200
    res["error"] = None if res["ok"] else "/health_generate answered %s" % (
        "HTTP %d" % status if isinstance(status, int) else status)


def _result(host, port, node_rank=0):
    """A smoke_server result before anything is known (see there)."""
    return {"host": host, "port": int(port), "node_rank": node_rank, "health_only": node_rank >= 1,
            "model_path": None, "version": None, "stand_in": False, "server_args": None,
            "health_wait_s": None, "ok": False, "error": None, "output_ids": None,
            "ids_consistent": None, "latency_s": None, "e2e_latency_s": None, "tokens_per_s": None,
            "runs": []}


def smoke_server(host, port, health_timeout=600.0, repeat=3, max_new_tokens=16,
                 input_ids=None, request_timeout=60.0, warmup=1, node_rank=0, pd_part=None, exited=None):
    """Health wait + `repeat` greedy decodes against one SGLang server at host:port; for
    `node_rank` 1 and above (a non-zero-rank node: the module docstring) the health wait only;
    for a PD worker (`pd_part`: pd_plan's {role, via}, role not "router") the health wait and its
    /health_generate (pd_health). A PD server's result carries `pd_part` as "pd". `exited`:
    wait_healthy's (watch()).

    Times in seconds. Returns {host, port, node_rank, health_only (no decode: node_rank >= 1),
    model_path, version, stand_in, server_args (topology.server_info of its /server_info, None
    when it does not answer), health_wait_s, ok, error, output_ids (first run), ids_consistent
    (all runs equal), latency_s (median client time), e2e_latency_s (median server
    meta_info.e2e_latency), tokens_per_s, runs: [{output_ids, latency_s, e2e_latency_s,
    problems}]}. `warmup` untimed decodes go first. Never raises for server faults; they land in error.
    """
    base = "http://%s:%d" % (host if ":" not in host else "[%s]" % host, int(port))
    res = _result(host, port, node_rank)
    if pd_part:
        res["pd"] = pd_part
    worker = bool(pd_part) and pd_part["role"] != "router"
    res["health_only"] = res["health_only"] or worker
    healthy, waited, why = wait_healthy(base, health_timeout, request_timeout, exited)
    res["health_wait_s"] = round(waited, 3)
    if not healthy:
        res["error"] = why
        return res
    if worker:
        pd_health(base, res, request_timeout)
        return res
    if res["health_only"]:
        res["ok"] = True
        return res
    res.update(_server_facts(base, request_timeout))
    body = {"input_ids": list(input_ids or DEFAULT_INPUT_IDS),
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}}
    for _ in range(warmup):  # untimed: the first decodes after a (re)start pay one-off costs
        try:
            _request(base + "/generate", body, timeout=request_timeout)
        except OSError:
            pass  # the timed runs below report the problem
    for _ in range(repeat):
        t0 = time.perf_counter()
        try:
            status, out = _request(base + "/generate", body, timeout=request_timeout)
        except OSError as e:
            status, out = None, {"error": str(getattr(e, "reason", None) or e)}
        run = {"latency_s": time.perf_counter() - t0, "problems": check_generate(status, out, max_new_tokens)}
        if isinstance(out, dict):
            run["output_ids"] = out.get("output_ids")
            run["e2e_latency_s"] = (out.get("meta_info") or {}).get("e2e_latency")
        res["runs"].append(run)
    problems = [p for r in res["runs"] for p in r["problems"]]
    if problems:
        res["error"] = "; ".join(sorted(set(problems), key=problems.index))
        if res["server_args"] is None and any(r["problems"][:1] == [NOT_FOUND] for r in res["runs"]):
            res["error"] += DUMMY_HINT
        return res
    runs = res["runs"]
    res["output_ids"] = runs[0]["output_ids"]
    res["ids_consistent"] = all(r["output_ids"] == runs[0]["output_ids"] for r in runs)
    res["latency_s"] = statistics.median(r["latency_s"] for r in runs)
    e2e = [r["e2e_latency_s"] for r in runs if isinstance(r.get("e2e_latency_s"), (int, float))]
    res["e2e_latency_s"] = statistics.median(e2e) if len(e2e) == len(runs) else None
    res["tokens_per_s"] = max_new_tokens / (res["e2e_latency_s"] or res["latency_s"])
    res["ok"] = True
    return res


def offline_check(cmd, timeout=600.0):
    """Run the shell command `cmd` in its own process group under a deadline (seconds).

    stdin is /dev/null (the probe's own stdin is the SSH channel), stdout+stderr are captured.
    On timeout the whole group gets SIGKILL. Returns {cmd, ok (exit 0), returncode, timed_out,
    duration_s, tail: last 20 output lines}; secrets in cmd and tail redacted (redact.py).
    """
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, shell=True, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, start_new_session=True)
    timed_out = False
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            out, _ = p.communicate(timeout=5)
        except subprocess.TimeoutExpired:  # a grandchild left the group and holds the pipe
            out = b""
    lines = [redact.text(line) for line in out.decode("utf-8", errors="replace").splitlines()[-TAIL_LINES:]]
    return {"cmd": redact.text(cmd), "ok": p.returncode == 0 and not timed_out, "returncode": p.returncode,
            "timed_out": timed_out, "duration_s": round(time.monotonic() - t0, 3),
            "tail": lines[-TAIL_LINES:]}


def main(params):
    """Probe entry point. params (all optional):
    servers: the servers to decode, as the control side names them (targets.live: [{pid, python,
    port, host}] as the facts probe identified them, or [{"pid": None}] for every
    server identified here); port, host: the inventory's fleetctl_sglang_port and _host, which
    select among their sockets (targets.select); health_timeout (600 s, the wait for a server to
    listen and answer /health); repeat (3); max_new_tokens (16); input_ids (fixed prompt);
    request_timeout (60 s, per HTTP request); pd_router: the inventory's fleetctl_pd_router (the
    module docstring; decoded when no PD router is identified here); offline_cmd: a shell command string (from the
    playbook or inventory); offline_timeout (600 s); api_key: the servers' API key (sent as a
    bearer token to the targets only, never returned).
    Returns {"servers": [smoke_server result + pid, ...; a non-zero-rank node's: health only; a PD
    worker's: its /health_generate (pd_plan, "pd": {role, via}); a
    server that never listened: ok false, the reason in error], "refused": [{pid, host, port, reason}] (targets.select: nothing was
    sent to them), "offline": offline_check result or None}; server errors have their secrets
    redacted (redact.py).
    """
    global API_KEY
    API_KEY = params.get("api_key")
    health_timeout = float(params.get("health_timeout", 600))
    picked, waited = choose(params.get("servers") or [], params.get("port"), params.get("host"), health_timeout,
                            params.get("server_user"))
    servers, local, named = [], listeners.local_addresses(), params.get("pd_router")
    plan = pd_plan(picked["targets"], local, named)
    routers = [t for t in picked["targets"] if (plan.get(t["pid"]) or {}).get("role") == "router"]
    if named and not routers:  # the inventory's router, where none is identified here
        address, port, why = named_router(named, local)
        if why:
            picked["refused"].append({"pid": None, "host": None, "port": None, "reason": why})
        else:
            picked["targets"].append({"pid": None, "host": address, "port": port, "node_rank": 0})
            plan[None] = {"role": "router", "via": PD_NAMED % named}
    for t in picked["targets"]:
        servers.append(smoke_server(t["host"], t["port"], health_timeout=max(0.0, health_timeout - waited),
                                    repeat=int(params.get("repeat", 3)),
                                    max_new_tokens=int(params.get("max_new_tokens", 16)),
                                    input_ids=params.get("input_ids"),
                                    request_timeout=float(params.get("request_timeout", 60)),
                                    warmup=int(params.get("warmup", 1)), node_rank=t["node_rank"],
                                    pd_part=plan.get(t["pid"]),
                                    exited=watch(params.get("servers") or [], params.get("port"), params.get("host"),
                                                 params.get("server_user"), t)))
        servers[-1]["pid"] = t["pid"]
    for p in picked["pending"]:
        servers.append(dict(_result(p["host"], p["port"]), pid=p["pid"], health_wait_s=round(waited, 3),
                            error=pending_error(p, health_timeout, waited)))
    for s in servers:
        s["error"] = redact.text(s["error"])
    offline = None
    if params.get("offline_cmd"):
        offline = offline_check(params["offline_cmd"], float(params.get("offline_timeout", 600)))
    return {"servers": servers, "refused": picked["refused"], "offline": offline}
