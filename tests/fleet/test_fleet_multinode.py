"""A multi-node SGLang server over real sshd (issue 32, case 11): three lab hosts whose stand-in
servers are restarted with the command lines of multi-node deployments:

- lab-03: rank 0 of a two-node TP 16 server (`--node-rank 0 --nnodes 2 --dist-init-addr
  LAB-03:5000`), a normal stand-in that decodes;
- lab-04: rank 1 of the same server, under CUDA_VISIBLE_DEVICES=8..15; like SGLang's dummy
  health server on a non-zero-rank node, it serves only /health (404 on /generate);
- lab-02: rank 1 of another two-node server (DP attention, `--dist-init-addr LAB-01:5000`)
  whose rank 0 is in no run here.

One inspect shows each server's layout and GPUs; validate checks the rank 1 nodes' /health; one
apply of defrag-tier0 patches all three (before: both rank 1 nodes refused by their baseline
smoke, "/generate answered HTTP 404"), lab-04's gate taken on lab-03's decode (lab-04 applied after
lab-03), lab-02's gate its /health alone, said as such. The servers are the lab's stand-ins (no
GPU, no model here): fleetctl/lab/standin/server.py."""

from __future__ import annotations

import io
import json

import pytest
import yaml
from rich.console import Console

from fleetctl.report.terminal import render_inspect
from fleetctl.engine.context import HostResult
from fleetctl.engine.validate import RANK0_ABSENT
from fleetctl.vocab import HostStatus

RESTART = "/opt/fleetctl-standin/restart.sh"
PIDFILE = "/opt/fleetctl-standin/server.pid"
HOSTS = ("lab-02", "lab-03", "lab-04")
VISIBLE = ",".join(str(n) for n in range(8, 16))


def layouts(lab) -> dict[str, str]:
    """{host: the restart command that starts its stand-in as its node of the layout}."""
    rank0 = f"{lab.address('lab-03')}:5000"
    return {
        "lab-02": f"{RESTART} --tp 16 --dp 16 --enable-dp-attention --nnodes 2 --node-rank 1 "
                  f"--dist-init-addr {lab.address('lab-01')}:5000",
        "lab-03": f"{RESTART} --tp 16 --nnodes 2 --node-rank 0 --dist-init-addr {rank0}",
        "lab-04": f"CUDA_VISIBLE_DEVICES={VISIBLE} {RESTART} --tp 16 --nnodes 2 --node-rank 1 --dist-init-addr {rank0}",
    }


def restart(lab, commands: dict[str, str]) -> None:
    """Run each host's restart command (all at once), then wait until each answers /health."""
    procs = {h: lab.ssh(h, cmd) for h, cmd in commands.items()}
    assert all(p.returncode == 0 for p in procs.values()), {h: p.stderr for h, p in procs.items()}
    for h in commands:
        assert lab.server_healthy(h, timeout=90), h


@pytest.fixture
def multinode(server_lab, tmp_path):
    """The three hosts restarted as nodes of the layouts, and an inventory of them whose restart
    handler restarts each as the same node; after the test, every change rolled back with the
    lab's own inventory (its handler restarts the stand-ins as the lab started them) and any
    stand-in still started as a node restarted plainly."""
    cmds = layouts(server_lab)
    restart(server_lab, cmds)
    lab_hosts = yaml.safe_load(server_lab.inventory.read_text())["all"]["children"]["lab"]["hosts"]
    inv = tmp_path / "multinode.yml"
    inv.write_text(yaml.safe_dump({"all": {"hosts": {h: {**lab_hosts[h], "fleetctl_restart_cmd": cmds[h]}
                                                     for h in HOSTS}}}))
    try:
        yield str(inv)
    finally:
        server_lab.cli_json("rollback", "--last", ",".join(HOSTS), "--yes", rc=0)
        still = {h: RESTART for h in HOSTS
                 if server_lab.ssh(h, f"grep -aq -- --node-rank /proc/$(cat {PIDFILE})/cmdline").returncode == 0}
        if still:
            restart(server_lab, still)


def test_multi_node_servers_are_shown_validated_and_patched(server_lab, multinode):
    inv = multinode
    addr0 = f"{server_lab.address('lab-03')}:5000"

    # inspect: each node's layout and the GPUs its schedulers take (TP 16 over 2 nodes: 8 each)
    _, doc, hosts = server_lab.cli_json("inspect", ",".join(HOSTS), "-i", inv, rc=0)
    server = {h: hosts[h]["facts"]["servers"][0] for h in HOSTS}
    keys = ("node_rank", "nnodes", "dist_init_addr", "tp_size", "dp_size", "enable_dp_attention",
            "cuda_visible_devices", "gpu_ids")
    assert {h: {k: server[h][k] for k in keys} for h in HOSTS} == {
        "lab-02": {"node_rank": 1, "nnodes": 2, "dist_init_addr": f"{server_lab.address('lab-01')}:5000", "tp_size": 16,
                   "dp_size": 16, "enable_dp_attention": True, "cuda_visible_devices": None,
                   "gpu_ids": [str(n) for n in range(8)]},
        "lab-03": {"node_rank": 0, "nnodes": 2, "dist_init_addr": addr0, "tp_size": 16, "dp_size": 1,
                   "enable_dp_attention": False, "cuda_visible_devices": None, "gpu_ids": [str(n) for n in range(8)]},
        "lab-04": {"node_rank": 1, "nnodes": 2, "dist_init_addr": addr0, "tp_size": 16, "dp_size": 1,
                   "enable_dp_attention": False, "cuda_visible_devices": VISIBLE,
                   "gpu_ids": [str(n) for n in range(8, 16)]},
    }
    shown = Console(file=io.StringIO(), width=2000)
    render_inspect([HostResult(e["host"], e["address"], HostStatus(e["status"]), data=e) for e in doc["hosts"]], shown)
    table = shown.file.getvalue()
    assert f"tp=16 node 1/2 of {addr0} gpus {VISIBLE}" in table
    assert "tp=16 dp=16 (attention) node 1/2 of" in table and f"tp=16 node 0/2 of {addr0} gpus 0,1,2,3,4,5,6,7" in table

    # validate: a rank 1 node's /health, never a /generate its dummy health server does not serve
    _, _, checked = server_lab.cli_json("validate", "lab-02,lab-04", "-i", inv, "--repeat", "1", rc=0)
    for h in ("lab-02", "lab-04"):
        (s,) = checked[h]["servers"]
        assert (checked[h]["status"], s["ok"], s["health_only"], s["node_rank"], s["output_ids"], s["error"]) == (
            "ok", True, True, 1, None, None), checked[h]

    # apply: all three patched; lab-04 gated on lab-03's decode, lab-02 on its /health alone
    _, doc, applied = server_lab.cli_json("apply", "defrag-tier0", ",".join(HOSTS), "-i", inv, "--yes",
                                          "--repeat", "1", rc=0)
    assert {h: applied[h]["status"] for h in HOSTS} == dict.fromkeys(HOSTS, "changed")
    assert {h: applied[h]["validation"]["status"] for h in HOSTS} == dict.fromkeys(HOSTS, "passed")
    v2, v3, v4 = (applied[h]["validation"] for h in HOSTS)
    assert v2["gate"] == RANK0_ABSENT == "rank 0 not in this run: /health only"
    assert [(c["name"], c["target"], c["passed"]) for c in v2["checks"]] == [("health", "127.0.0.1:30000", True)]
    assert "node rank 1: /health answered 200 (rank 0 not in this run: /health only)" == v2["checks"][0]["detail"]
    assert "gate" not in v3 and [c["name"] for c in v3["checks"]] == ["tokens", "latency"]
    assert v4["gate"] == f"decoded through rank 0 on lab-03 ({addr0})"
    assert [(c["name"], c["target"], c["passed"]) for c in v4["checks"]] == [
        ("health", "127.0.0.1:30000", True),
        ("tokens", "lab-03 127.0.0.1:30000 (rank 0)", True),
        ("latency", "lab-03 127.0.0.1:30000 (rank 0)", True)]
    assert v4["checks"][1]["detail"] == v3["checks"][0]["detail"] == "16 greedy tokens identical"
    # lab-04 went after lab-03: lab-03's server, restarted by its own change's handler, decoded
    # lab-03's gate and then lab-04's baseline and gate (a warmup and one timed decode each): 6
    info = server_lab.ssh("lab-03", "/opt/sglang/venv/bin/python -c 'import urllib.request as u; "
                                    "print(u.urlopen(\"http://127.0.0.1:30000/server_info\").read().decode())'")
    assert json.loads(info.stdout)["stand_in_counters"]["generate"] == 6, info
