"""SGLang prefill/decode disaggregation (issue 49, case turn4/01): a server's PD part read from its
command line (probes/facts/pd.py) for launch lines of both releases and of SGLang's PD docs, checked
against the 0.5.10 and 0.5.23 sources; the lab's PD stand-ins (a prefill and a decode worker, the
PD router in front of them) run for real on loopback and answer as the releases do."""

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
import zipfile

import pytest

from fleetctl.lab import standin
from fleetctl.lab.standin import server as standin_server
from fleetctl.probes.facts import pd, procs
from fleetctl.probes.traffic import load, smoke
from fleetctl.probes.traffic.smoke import DEFAULT_INPUT_IDS, check_generate, wait_healthy
from fleetctl.report.terminal import pd_words
from fleetctl.wheels import ensure_wheel
from helpers.proc import free_port

VENV = "/opt/llm/venv/bin/python"
# the case's node pd-a (0.5.23), and the 0.5.10 spelling `--flag=value`
PREFILL = [VENV, "-m", "sglang.launch_server", "--model-path", "/models/m", "--tp", "2", "--port", "31100",
           "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", "9100"]
DECODE = [VENV, "-m", "sglang.launch_server", "--model-path", "/models/m", "--tp", "2", "--base-gpu-id", "2",
          "--port", "31200", "--disaggregation-mode=decode"]
ROUTER = ["python", "-m", "sglang_router.launch_router", "--pd-disaggregation", "--prefill",
          "http://127.0.0.1:31100", "9100", "--decode", "http://127.0.0.1:31200", "--host", "127.0.0.1",
          "--port", "8100"]
MINI_LB = ["python3", "-m", "sglang.srt.disaggregation.mini_lb", "--prefill", "http://10.213.250.5:30000",
           "http://127.0.0.1:30001", "--decode", "http://localhost:30002", "--prefill-bootstrap-ports", "8998", "9000"]


def role(argv):
    """pd.role of a whole command line, as procs.server_fields reads it."""
    _, kind, target, args = procs.python_program(argv)
    return pd.role(target if kind == "m" else None, args)


def test_roles_of_recorded_launch_lines():
    assert role(PREFILL) == {"role": "prefill", "bootstrap_port": 9100}
    assert role(PREFILL[:-2]) == {"role": "prefill", "bootstrap_port": 8998}  # ServerArgs' default
    assert role(DECODE) == {"role": "decode", "bootstrap_port": None}
    assert role(PREFILL[:-4]) is None and role(DECODE[:-1] + ["--disaggregation-mode", "null"]) is None
    assert role(ROUTER) == {"role": "router", "prefill": [{"url": "http://127.0.0.1:31100", "bootstrap_port": 9100}],
                            "decode": ["http://127.0.0.1:31200"]}
    assert role(MINI_LB)["prefill"] == [{"url": "http://10.213.250.5:30000", "bootstrap_port": 8998},
                                        {"url": "http://127.0.0.1:30001", "bootstrap_port": 9000}]
    # a router that is not a PD router is no PD server, and no server
    assert role(ROUTER[:3] + ["--worker-urls", "http://127.0.0.1:30000"]) is None
    assert procs.server_kind(ROUTER) == procs.server_kind(MINI_LB) == "pd-router"
    assert procs.server_kind(ROUTER[:3] + ["--worker-urls", "http://x:1"]) is None
    # secrets in a peer URL do not leave the host
    assert "hunter2" not in json.dumps(role(ROUTER[:5] + ["http://u:hunter2@127.0.0.1:31100"] + ROUTER[6:]))
    # which workers here a router sends to: loopback and this host's own addresses only
    assert pd.routed(role(MINI_LB), local={"10.213.250.5"}) == {30000: "prefill", 30001: "prefill", 30002: "decode"}
    assert pd.routed(role(MINI_LB)) == {30001: "prefill", 30002: "decode"}


def test_peers_and_inspect_words():
    servers = [{"pid": 1, "port": 31100, "pd": role(PREFILL)}, {"pid": 2, "port": 31200, "pd": role(DECODE)},
               {"pid": 3, "port": 8100, "pd": role(ROUTER)}, {"pid": 4, "port": 30000, "pd": None}]
    procs.pd_peers(servers)
    assert servers[2]["pd"]["workers"] == [{"pid": 1, "port": 31100, "role": "prefill"},
                                           {"pid": 2, "port": 31200, "role": "decode"}]
    assert servers[0]["pd"]["routers"] == servers[1]["pd"]["routers"] == [{"pid": 3, "port": 8100}]
    assert pd_words(servers[0]["pd"]) == " PD prefill (bootstrap :9100) behind router :8100"
    assert pd_words(servers[2]["pd"]) == " PD router -> prefill http://127.0.0.1:31100, decode http://127.0.0.1:31200"
    assert pd_words({"role": "decode", "bootstrap_port": None, "routers": []}) == " PD decode (no router here)"


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """{(release, path): text} of the release files the PD facts come from."""
    out = {}
    for v, files in (("0.5.10", ["sglang/srt/server_args.py", "sglang/srt/managers/scheduler.py",
                                 "sglang/srt/entrypoints/http_server.py", "sglang/srt/disaggregation/utils.py"]),
                     ("0.5.23", ["sglang/srt/arg_groups/fields/disagg.py", "sglang/srt/managers/scheduler.py",
                                 "sglang/srt/entrypoints/http_server.py", "sglang/srt/disaggregation/utils.py"])):
        with zipfile.ZipFile(ensure_wheel(v)) as z:
            out.update({(v, f): z.read(f).decode() for f in files})
    return out


def test_flags_and_refusal_are_the_releases(sources):
    s10 = sources[("0.5.10", "sglang/srt/server_args.py")]
    assert '"--disaggregation-mode"' in s10 and '"--disaggregation-bootstrap-port"' in s10
    assert 'disaggregation_mode: Literal["null", "prefill", "decode"] = "null"' in s10
    assert "disaggregation_bootstrap_port: int = %d" % pd.DEFAULT_BOOTSTRAP_PORT in s10
    d23 = sources[("0.5.23", "sglang/srt/arg_groups/fields/disagg.py")]
    assert "    disaggregation_mode: A[" in d23 and "] = %d" % pd.DEFAULT_BOOTSTRAP_PORT in d23
    for v in ("0.5.10", "0.5.23"):
        sched = sources[(v, "sglang/srt/managers/scheduler.py")]
        assert ('f"Invalid request: Disaggregated request received without "\n' in sched
                and 'f"bootstrap room id. {req.rid=}"' in sched), v
        http = sources[(v, "sglang/srt/entrypoints/http_server.py")]
        assert "gri.bootstrap_host = FAKE_BOOTSTRAP_HOST" in http and "gri.bootstrap_room = 0" in http, v
        assert 'FAKE_BOOTSTRAP_HOST = "2.2.2.2"' in sources[(v, "sglang/srt/disaggregation/utils.py")]
    assert '{"error": {"message": str(e)}}, status_code=HTTPStatus.BAD_REQUEST' in \
        sources[("0.5.10", "sglang/srt/entrypoints/http_server.py")]
    # the stand-in's message is the release's f-string, {req.rid=} rendered as Python renders it
    assert standin_server.PD_NO_ROOM % ("r1",) == "Invalid request: Disaggregated request received without " \
        "bootstrap room id. req.rid='r1'"


def _http(port, path, body=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request("http://127.0.0.1:%d%s" % (port, path), data=data,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.fixture(scope="module")
def pd_standins(tmp_path_factory):
    """A stand-in prefill worker, decode worker and PD router on loopback: {role: port}."""
    d = tmp_path_factory.mktemp("pd")
    ports = {"prefill": free_port(), "decode": free_port(), "router": free_port()}
    (d / "behavior.json").write_text("{}")
    base = [sys.executable, str(standin.SERVER), "--behavior", str(d / "behavior.json")]
    cmds = {"prefill": base + ["--port", str(ports["prefill"]), "--disaggregation-mode", "prefill",
                               "--disaggregation-bootstrap-port", "9100"],
            "decode": base + ["--port", str(ports["decode"]), "--disaggregation-mode", "decode"],
            "router": [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation", "--prefill",
                       "http://127.0.0.1:%d" % ports["prefill"], "9100", "--decode",
                       "http://127.0.0.1:%d" % ports["decode"], "--port", str(ports["router"])]}
    env = dict(os.environ, PYTHONPATH=str(standin.SERVER.parent))
    ps = [subprocess.Popen(c, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=open(d / (n + ".log"), "ab"),
                           env=env) for n, c in cmds.items()]
    try:
        for n, port in ports.items():
            assert wait_healthy("http://127.0.0.1:%d" % port, 60)[0], (d / (n + ".log"))
        yield ports, {n: p.pid for n, p in zip(cmds, ps)}
    finally:
        for p in ps:
            p.terminate()
            p.wait(10)


def test_pd_standins_answer_as_the_release(pd_standins):
    pd_standins, _ = pd_standins
    body = {"input_ids": DEFAULT_INPUT_IDS, "rid": "r1",
            "sampling_params": {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}}
    for r in ("prefill", "decode"):
        status, raw = _http(pd_standins[r], "/generate", body)
        assert (status, json.loads(raw)) == (400, {"error": {"message": standin_server.PD_NO_ROOM % ("r1",)}}), r
        status, raw = _http(pd_standins[r], "/generate", dict(body, stream=True))
        events = [e for e in raw.decode().split("\n\n") if e]
        assert status == 200 and events[-1] == "data: [DONE]" and json.loads(events[0][6:])["error"]["message"]
        assert _http(pd_standins[r], "/health_generate")[0] == 200
        info = json.loads(_http(pd_standins[r], "/server_info")[1])
        assert info["disaggregation_mode"] == r
    status, raw = _http(pd_standins["router"], "/generate", body)
    out = json.loads(raw)
    assert status == 200 and check_generate(status, out, 16) == [], out
    # the router's decode is the decode worker's, given a bootstrap room as the router gives one
    room = dict(body, bootstrap_host="127.0.0.1", bootstrap_port=9100, bootstrap_room=7)
    assert out["output_ids"] == json.loads(_http(pd_standins["decode"], "/generate", room)[1])["output_ids"]


def test_smoke_plan_checks_workers_through_their_router(pd_standins):
    ports, pids = pd_standins
    picked = [{"pid": pids[n], "port": ports[n]} for n in ("prefill", "decode", "router")] + [
        {"pid": os.getpid(), "port": 1}]  # no server at all: no PD part
    via = "decoded through the PD router on :%d" % ports["router"]
    assert smoke.pd_plan(picked) == {pids["prefill"]: {"role": "prefill", "via": "prefill worker: " + via},
                                     pids["decode"]: {"role": "decode", "via": "decode worker: " + via},
                                     pids["router"]: {"role": "router", "via": via}}
    assert smoke.pd_plan(picked[1:2]) == {pids["decode"]: {"role": "decode", "via": "decode worker: health_generate only"}}
    res = smoke.smoke_server("127.0.0.1", ports["decode"], 30, repeat=1, pd_part=smoke.pd_plan(picked)[pids["decode"]])
    assert (res["ok"], res["health_only"], res["output_ids"], res["error"]) == (True, True, None, None), res
    assert "PD decode worker answers a plain /generate with HTTP 400" in load.PD_SKIP % ("decode", "x")


def test_the_smoke_gate_takes_a_pd_group_as_one_unit():
    """The router's decode is compared, each worker's /health_generate checked, named by how."""
    from fleetctl.engine.gates.smoke import gate, gate_note
    from fleetctl.engine.validate import SmokeOptions
    from fleetctl.inventory import Host

    via = "decoded through the PD router on :8100"

    def res(worker_ok=True, ids=(1, 2, 3)):
        router = {"host": "127.0.0.1", "port": 8100, "node_rank": 0, "health_only": False, "ok": True, "error": None,
                  "output_ids": list(ids), "e2e_latency_s": 0.1, "latency_s": 0.1, "pd": {"role": "router", "via": via}}
        worker = {"host": "127.0.0.1", "port": 31200, "node_rank": 0, "health_only": True, "ok": worker_ok,
                  "output_ids": None, "error": None if worker_ok else "/health_generate answered HTTP 503",
                  "pd": {"role": "decode", "via": "decode worker: " + via}}
        return {"servers": [worker, router], "refused": [], "offline": None}

    host, opts = Host("pd-a", {}, ()), SmokeOptions(latency_slack_s=0.0)
    v = gate(host, res(), res(), opts)
    assert v.passed and [(c.name, c.target) for c in v.checks] == [
        ("tokens", "127.0.0.1:8100"), ("latency", "127.0.0.1:8100"), ("health", "127.0.0.1:31200")]
    assert v.checks[-1].detail == "decode worker: %s: /health_generate answered 200" % via
    assert gate_note(res()) == "decode worker: %s; %s" % (via, via)
    down = gate(host, res(), res(worker_ok=False), opts)
    assert down.failed and "decode worker: %s: /health_generate answered HTTP 503" % via in down.message
    assert gate(host, res(), res(ids=(1, 2, 4)), opts).failed


def test_the_inventorys_pd_router_is_decoded_and_named(pd_standins, tmp_path):
    """fleetctl_pd_router: a router no process here is identified as is decoded, the workers said
    to be decoded through it; a URL that is no address of the host is refused by name."""
    from fleetctl import inventory
    from fleetctl.errors import InventoryError

    ports, pids = pd_standins
    url = "http://127.0.0.1:%d" % ports["router"]
    sel = [{"pid": pids["decode"], "python": sys.executable, "port": ports["decode"], "host": "127.0.0.1"}]
    out = smoke.main({"servers": sel, "pd_router": url, "repeat": 1, "health_timeout": 30})
    worker, router = out["servers"]
    assert worker["pd"] == {"role": "decode", "via": "decode worker: decoded through the PD router %s "
                                                     "(fleetctl_pd_router)" % url} and worker["ok"]
    assert router["pd"] == {"role": "router", "via": "decoded through the PD router %s (fleetctl_pd_router)" % url}
    assert router["ok"] and len(router["output_ids"]) == 16 and router["pid"] is None
    out = smoke.main({"servers": sel, "pd_router": "http://10.213.250.7:8100", "repeat": 1, "health_timeout": 30})
    assert [s["port"] for s in out["servers"]] == [ports["decode"]]
    assert out["refused"] == [{"pid": None, "host": None, "port": None, "reason": "fleetctl_pd_router "
                               "http://10.213.250.7:8100 is bound to 10.213.250.7, not an address of this host"}]
    inv = tmp_path / "hosts.yml"
    inv.write_text("all:\n  hosts:\n    a: {fleetctl_pd_router: 'http://127.0.0.1:8100/'}\n"
                   "    b: {fleetctl_pd_router: '127.0.0.1:8100'}\n    c: {}\n")
    a, b, c = inventory.load(inv).select("a:b:c")
    assert (a.pd_router, c.pd_router) == ("http://127.0.0.1:8100", None)
    with pytest.raises(InventoryError, match="host b: fleetctl_pd_router '127.0.0.1:8100' is not http://ADDRESS:PORT"):
        b.pd_router
