"""A server's parallel layout read from its command line, and the GPUs SGLang puts its schedulers
on (probes/facts/topology.py), for command lines of the shapes SGLang's docs and real deployments use:
DP attention, pipeline parallelism, multi-node tensor parallelism. Each command line and its expected
layout and GPUs is a recorded case (tests/unit/probes/topology/, test_fact_fixtures.py); here its
GPUs are also computed by SGLang's own rank arithmetic executed from the release wheels
(`_calculate_rank_ranges` of 0.5.10's entrypoints/engine.py, `compute_local_gpu_id` of 0.5.23's
weight_cache/protocol.py, and the data parallel offset `launch_dp_schedulers` adds, evaluated from
each release's data_parallel_controller.py). The facts probe's reading of running processes
(procs.find_servers) is checked on real processes with those command lines; the gate of a
non-zero-rank node (engine/gates/smoke.gate) on smoke results of its shapes, and how the apply table
says it."""

from __future__ import annotations

import ast
import io
import os
import subprocess
import sys
import time
from functools import lru_cache
from types import SimpleNamespace
from typing import Tuple

import pytest
from rich.console import Console

from fleetctl.report.terminal import render_apply
from fleetctl.engine.context import HostResult
from fleetctl.engine.gates.smoke import gate, gate_note
from fleetctl.engine.validate import RANK0_ABSENT, SmokeOptions, smoke_problems
from fleetctl.inventory import Host
from fleetctl.probes.facts import procs, topology
from fleetctl.vocab import HostStatus
from oracles import release_file
from helpers.probe_cases import case, cases

ENGINE = "sglang/srt/entrypoints/engine.py"
PROTOCOL = "sglang/srt/weight_cache/protocol.py"
DPC = "sglang/srt/managers/data_parallel_controller.py"
ADDR = "192.0.2.1:5000"


@lru_cache(maxsize=None)
def _tree(version: str, rel: str) -> ast.Module:
    return ast.parse(release_file(version, rel))


@lru_cache(maxsize=None)
def _function(version: str, rel: str, name: str):
    """Function `name` of a release file, executed alone (these take plain ints)."""
    node = next(n for n in _tree(version, rel).body if isinstance(n, ast.FunctionDef) and n.name == name)
    space = {"Tuple": Tuple}
    exec(compile(ast.Module([node], []), f"{version}/{rel}", "exec"), space)
    return space[name]


def _dp_offset(version: str, layout: dict) -> int:
    """What `launch_dp_schedulers` of release `version` adds to base_gpu_id per DP replica,
    evaluated from its own expression with this layout."""
    fn = next(n for n in ast.walk(_tree(version, DPC)) if isinstance(n, ast.FunctionDef) and n.name == "launch_dp_schedulers")
    step = next(n for n in ast.walk(fn) if isinstance(n, ast.AugAssign) and getattr(n.target, "id", "") == "base_gpu_id")
    args = SimpleNamespace(**layout)
    return eval(compile(ast.Expression(step.value), version, "eval"),
                {"server_args": args, "get_parallel": lambda: args, "get_device": lambda: args})


def sglang_ordinals(layout: dict, version: str = "0.5.23") -> list[int]:
    """The device ordinals SGLang's own code gives this node's schedulers (see the module docstring)."""
    ranges = _function("0.5.10", ENGINE, "_calculate_rank_ranges")
    gpu_id = _function("0.5.23", PROTOCOL, "compute_local_gpu_id")
    pp_ranks, tp_ranks, pp_per_node, tp_per_node = ranges(layout["nnodes"], layout["pp_size"], layout["tp_size"],
                                                          layout["node_rank"])
    replicas = 1 if layout["enable_dp_attention"] else layout["dp_size"]
    out = []
    for dp_rank in range(replicas):
        for pp_rank in pp_ranks:
            for tp_rank in tp_ranks:
                out.append(dp_rank * _dp_offset(version, layout)
                           + gpu_id(pp_rank, tp_rank, pp_per_node, tp_per_node, layout["base_gpu_id"], layout["gpu_id_step"]))
    return list(dict.fromkeys(out))


def layout_of(name: str) -> dict:
    """The layout of the recorded topology case `name` (tests/unit/probes/topology/)."""
    return topology.read(case("topology", name)["argv"])


@pytest.mark.parametrize("name", [n for n in cases("topology") if case("topology", n)["fact"]["gpu_ids"]])
def test_each_recorded_layouts_gpus_are_the_ones_sglangs_own_code_gives(name):
    """Every recorded command line of a layout SGLang runs (DP attention, pipeline stages, DP
    replicas, multi-node TP; test_fact_fixtures.py checks what each reads as): the device
    ordinals are the ones SGLang's own rank arithmetic gives its schedulers."""
    layout = layout_of(name)
    assert topology.gpu_ordinals(layout) == sglang_ordinals(layout)


def test_dp_replicas_of_pipeline_stages_overlapped_before_0_5_3():
    # DP x PP: each replica skips tp x pp GPUs (0.5.3 on); 0.5.2 skipped only tp, putting
    # replica 0's stage 1 and replica 1's stage 0 on one GPU (sglang#8963), as its code says
    both = layout_of("dp-2-pp-2")
    assert topology.gpu_ordinals(both) == sglang_ordinals(both, "0.5.10") == [0, 1, 2, 3]
    assert sglang_ordinals(both, "0.5.2") == [0, 1, 2]


def test_the_nodes_of_one_multi_node_deployment_name_it_alike():
    # case 11: rank 1 of a 2-node TP 16 server, and its rank 0 named with the old alias and = form
    rank1, rank0 = layout_of("tp-16-two-nodes-rank-1-short-visible"), layout_of("tp-16-two-nodes-rank-0-old-spelling")
    assert (rank1["node_rank"], rank1["nnodes"], rank1["dist_init_addr"]) == (1, 2, ADDR)
    assert topology.deployment(rank1) == topology.deployment(rank0) == "192.0.2.1:5000/2"
    assert topology.deployment(layout_of("deepseek-v3-dp-attention")) is None


def test_server_info_keeps_only_layout_keys_of_the_right_type():
    info = {"tp_size": 16, "dp_size": 1, "nnodes": 2, "node_rank": 0, "dist_init_addr": ADDR,
            "enable_dp_attention": False, "pp_size": "2", "base_gpu_id": True, "api_key": "s3cret"}
    assert topology.server_info(info) == {"tp_size": 16, "dp_size": 1, "nnodes": 2, "node_rank": 0,
                                          "dist_init_addr": ADDR, "enable_dp_attention": False}
    assert topology.server_info(["not", "an", "object"]) == {}


@pytest.fixture
def running(tmp_path):
    """Start processes that look to /proc as SGLang servers do (`python -m sglang.launch_server
    ARGS`, a stand-in module that sleeps), each with its environment; yields start(args, env)
    -> pid, and stops them after."""
    (tmp_path / "sglang").mkdir()
    (tmp_path / "sglang" / "__init__.py").write_text("")
    (tmp_path / "sglang" / "launch_server.py").write_text("import time\ntime.sleep(60)\n")
    started = []

    def start(args: str, env: dict) -> int:
        p = subprocess.Popen([sys.executable, "-m", "sglang.launch_server", *args.split()], cwd=tmp_path,
                             env={"PATH": os.environ["PATH"], **env})
        started.append(p)
        return p.pid

    yield start
    for p in started:
        p.kill()
        p.wait()


def test_the_facts_probe_reads_each_kind_from_running_servers(running):
    pids = {
        "dp-attention": running("--model-path m --tp 8 --dp 8 --enable-dp-attention", {}),
        "pp": running("--model-path m --pp-size 2 --tp-size 2 --base-gpu-id 2", {"CUDA_VISIBLE_DEVICES": "7,6,5,4,3,2,1,0"}),
        "rank1": running(f"--model-path m --tp 16 --nnodes 2 --node-rank 1 --dist-init-addr {ADDR}", {}),
    }
    deadline = time.monotonic() + 10
    while True:
        found = {s["pid"]: s for s in procs.find_servers()[0] if s["pid"] in pids.values()}
        if len(found) == 3 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    got = {k: found[pid] for k, pid in pids.items()}
    assert got["dp-attention"]["gpu_ids"] == [str(n) for n in range(8)]  # not tp x dp = 64 of them
    assert (got["dp-attention"]["dp_size"], got["dp-attention"]["enable_dp_attention"]) == (8, True)
    # ordinals 2..5 (--base-gpu-id 2, two stages of TP 2) as CUDA_VISIBLE_DEVICES maps them
    assert (got["pp"]["pp_size"], got["pp"]["cuda_visible_devices"], got["pp"]["gpu_ids"]) == (
        2, "7,6,5,4,3,2,1,0", ["5", "4", "3", "2"])
    assert {k: got["rank1"][k] for k in ("node_rank", "nnodes", "dist_init_addr", "tp_size")} == {
        "node_rank": 1, "nnodes": 2, "dist_init_addr": ADDR, "tp_size": 16}
    assert got["rank1"]["gpu_ids"] == [str(n) for n in range(8)]


# ---- the gate of a non-zero-rank node (engine/gates/smoke.gate), on smoke results of their shapes

def decoded(ids=(5, 6, 7), e2e=0.01, host="127.0.0.1"):
    """A decoded server's smoke result (probes/smoke.smoke_server), the fields the gate reads."""
    return {"host": host, "port": 30000, "node_rank": 0, "health_only": False, "ok": True, "error": None,
            "output_ids": list(ids), "e2e_latency_s": e2e, "latency_s": e2e, "server_args": None}


def health_only(ok=True):
    return {"host": "127.0.0.1", "port": 30000, "node_rank": 1, "health_only": True, "ok": ok, "output_ids": None,
            "error": None if ok else "health deadline exceeded after 60 s: last answer HTTP 503 (still starting)"}


def rank0(*servers, error=None):
    return {"host": "lab-03", "deployment": f"{ADDR}/2", "ports": [30000], "error": error,
            "servers": list(servers), "refused": [], "offline": None}


def test_a_rank_1_nodes_gate_is_rank_0s_decode_or_its_health_said_as_such():
    host, opts = Host("rank1", {}, ()), SmokeOptions(latency_slack_s=0.0)
    alone = {"servers": [health_only()], "refused": [], "offline": None}
    v = gate(host, alone, alone, opts)
    assert (v.status, [(c.name, c.passed) for c in v.checks]) == ("passed", [("health", True)])
    assert gate_note(alone) == RANK0_ABSENT and RANK0_ABSENT in v.checks[0].detail
    down = gate(host, alone, {"servers": [health_only(ok=False)], "refused": [], "offline": None}, opts)
    assert down.failed and "node rank 1: health deadline exceeded" in down.message

    base = dict(alone, rank0=[rank0(decoded())])
    assert gate_note(base) == f"decoded through rank 0 on lab-03 ({ADDR})"
    assert gate(host, base, dict(alone, rank0=[rank0(decoded())]), opts).passed
    drift = gate(host, base, dict(alone, rank0=[rank0(decoded(ids=(5, 6, 8)))]), opts)
    assert drift.failed and "lab-03 127.0.0.1:30000 (rank 0) tokens FAILED: output_ids differ" in drift.message
    gone = gate(host, base, dict(alone, rank0=[rank0(error="unreachable: connection refused")]), opts)
    assert gone.failed and f"rank 0 on lab-03 ({ADDR}) rank0 FAILED: could not be smoke-tested after the change: " \
                           "unreachable: connection refused" == gone.message
    # a baseline whose rank 0 is not rank 0 of this deployment by its own /server_info refuses the host
    imposter = dict(decoded(), server_args={"node_rank": 0, "nnodes": 2, "dist_init_addr": "192.0.2.9:5000"})
    assert smoke_problems(dict(alone, rank0=[rank0(imposter)])) == [
        f"rank 0 on lab-03 ({ADDR}): 127.0.0.1:30000 says on /server_info it is node_rank 0 of 192.0.2.9:5000 (nnodes 2)"]


def test_the_apply_table_says_how_a_rank_1_node_was_gated():
    console = Console(file=io.StringIO(), width=300)
    data = {"plan": {"edits": [1], "left_alone": []}, "validation": {"status": "passed", "gate": RANK0_ABSENT}}
    render_apply([HostResult("rank1", "10.213.66.12", HostStatus.CHANGED, data=data)], console, diff=False, check=False)
    assert "passed; gate: rank 0 not in this run: /health only" in console.file.getvalue()
