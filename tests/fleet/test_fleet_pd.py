"""A node serving in prefill/decode disaggregation (issue 49, case turn4/01) over real sshd: lab-04
(SGLang 0.5.23's venv) runs, beside its plain stand-in on :30000, a stand-in prefill worker
(:31100, bootstrap port 9100), a stand-in decode worker (:31200) and the stand-in PD router in
front of them (:8100), as the case's node pd-a launches them. The workers answer a plain
/generate with HTTP 400 as SGLang's do, so before this change validate and apply failed on the
node. Now inspect shows each server's PD role and peers; validate decodes through the router and
checks each worker by its /health_generate, saying so; apply defrag-tier0 passes its gate through
the router; with the router gone, the decode worker's /health_generate is its check, named as such.
The servers are the lab's stand-ins (no GPU, no model here): fleetctl/lab/standin/."""

from __future__ import annotations

import time

import pytest
import yaml

HOST = "lab-04"
PY = "/opt/sglang/venv/bin/python"
STANDIN = "/opt/fleetctl-standin"
WORKERS = {"prefill": (31100, "--disaggregation-mode prefill --disaggregation-bootstrap-port 9100"),
           "decode": (31200, "--disaggregation-mode decode")}
ROUTER = (f"-m sglang_router.launch_router --pd-disaggregation --prefill http://127.0.0.1:31100 9100 "
          f"--decode http://127.0.0.1:31200 --host 127.0.0.1 --port 8100")


def start(lab, name: str, args: str) -> int:
    """Start `PY ARGS` on HOST in its own session, from /, with the stand-in on PYTHONPATH: its pid."""
    r = lab.ssh(HOST, f"cd /; setsid env PYTHONPATH={STANDIN} {PY} {args} > /tmp/pd-{name}.log 2>&1 < /dev/null & "
                      "echo $!")
    assert r.returncode == 0, r.stderr
    return int(r.stdout.split()[-1])


def healthy(lab, port: int, timeout: float = 120) -> None:
    ask = (f"{PY} -c \"import urllib.request; print(urllib.request.urlopen("
           f"'http://127.0.0.1:{port}/health', timeout=5).status)\"")
    deadline = time.monotonic() + timeout
    while lab.ssh(HOST, ask).stdout.strip() != "200":
        assert time.monotonic() < deadline, lab.ssh(HOST, "tail -n 20 /tmp/pd-*.log").stdout
        time.sleep(0.5)


def stop(lab, pid: int) -> None:
    lab.ssh(HOST, f"kill -TERM {pid}; sleep 0.5; kill -KILL {pid} 2>/dev/null; true")


@pytest.fixture
def pd_node(server_lab, tmp_path):
    """HOST running the PD group ({name: pid}), and an inventory of HOST that names no
    fleetctl_sglang_port (every server identified there is checked); after the test the PD
    servers are stopped and any change rolled back."""
    pids = {n: start(server_lab, n, f"{STANDIN}/server.py --behavior {STANDIN}/behavior.json --port {port} {flags}")
            for n, (port, flags) in WORKERS.items()}
    pids["router"] = start(server_lab, "router", ROUTER)
    lab_hosts = yaml.safe_load(server_lab.inventory.read_text())["all"]["children"]["lab"]["hosts"]
    inv = tmp_path / "pd.yml"
    own = {k: v for k, v in lab_hosts[HOST].items() if k not in ("fleetctl_sglang_port", "fleetctl_sglang_host")}
    inv.write_text(yaml.safe_dump({"all": {"hosts": {HOST: own}}}))
    try:
        for port in (31100, 31200, 8100):
            healthy(server_lab, port)
        yield pids, str(inv)
    finally:
        for pid in pids.values():
            stop(server_lab, pid)
        server_lab.cli_json("rollback", "--last", HOST, "--yes")


def test_pd_node_is_shown_validated_through_its_router_and_patched(server_lab, pd_node):
    pids, inv = pd_node
    _, _, hosts = server_lab.cli_json("inspect", HOST, "-i", inv, rc=0)
    by_port = {s["port"]: s for s in hosts[HOST]["facts"]["servers"]}
    assert by_port[31100]["pd"] == {"role": "prefill", "bootstrap_port": 9100,
                                    "routers": [{"pid": pids["router"], "port": 8100}]}
    assert by_port[31200]["pd"] == {"role": "decode", "bootstrap_port": None,
                                    "routers": [{"pid": pids["router"], "port": 8100}]}
    router = by_port[8100]
    assert router["kind"] == "pd-router" and router["pid"] == pids["router"]
    assert router["pd"] == {"role": "router", "prefill": [{"url": "http://127.0.0.1:31100", "bootstrap_port": 9100}],
                            "decode": ["http://127.0.0.1:31200"],
                            "workers": [{"pid": pids["prefill"], "port": 31100, "role": "prefill"},
                                        {"pid": pids["decode"], "port": 31200, "role": "decode"}]}
    assert by_port[30000]["pd"] is None

    # validate: the router decodes (its 16 greedy tokens), each worker answers /health_generate
    _, _, checked = server_lab.cli_json("validate", HOST, "-i", inv, "--repeat", "1", rc=0)
    got = {s["port"]: s for s in checked[HOST]["servers"]}
    assert checked[HOST]["status"] == "ok" and sorted(got) == [8100, 30000, 31100, 31200], checked[HOST]
    assert got[8100]["ok"] and len(got[8100]["output_ids"]) == 16
    assert got[8100]["pd"] == {"role": "router", "via": "decoded through the PD router on :8100"}
    assert got[8100]["output_ids"] == got[30000]["output_ids"]  # the decode worker's greedy tokens
    for port, r in ((31100, "prefill"), (31200, "decode")):
        assert (got[port]["ok"], got[port]["health_only"], got[port]["output_ids"]) == (True, True, None)
        assert got[port]["pd"] == {"role": r, "via": f"{r} worker: decoded through the PD router on :8100"}

    # apply: the baseline and the gate go through the router, the workers by /health_generate
    _, _, applied = server_lab.cli_json("apply", "defrag-tier0", HOST, "-i", inv, "--yes", "--repeat", "1", rc=0)
    v = applied[HOST]["validation"]
    assert applied[HOST]["status"] == "changed" and v["status"] == "passed", applied[HOST]
    assert v["gate"] == ("prefill worker: decoded through the PD router on :8100; "
                         "decode worker: decoded through the PD router on :8100; decoded through the PD router on :8100")
    checks = {(c["name"], c["target"]): c for c in v["checks"]}
    assert checks[("tokens", "127.0.0.1:8100")]["detail"] == "16 greedy tokens identical"
    assert checks[("health", "127.0.0.1:31200")]["detail"] == \
        "decode worker: decoded through the PD router on :8100: /health_generate answered 200"

    # no router on the node: the decode worker is checked by its /health_generate alone, said so
    stop(server_lab, pids["router"])
    _, _, checked = server_lab.cli_json("validate", HOST, "-i", inv, "--repeat", "1", rc=0)
    got = {s["port"]: s for s in checked[HOST]["servers"]}
    assert sorted(got) == [30000, 31100, 31200] and checked[HOST]["status"] == "ok", checked[HOST]
    assert got[31200]["pd"] == {"role": "decode", "via": "decode worker: health_generate only"}
    assert got[31200]["ok"] and got[31200]["output_ids"] is None
