"""`fleetctl diagnose` on the server lab: one host's stand-in restarted as the MoE model (8 experts
over 4 EP ranks, the expert recorder in stat mode), each verdict produced for real by the
stand-in's faults (engine.py: hot_expert, slow_attention_ms) under traffic, the allocator replay
for the defrag verdict, and a killed run: the server is left profiling and recording nothing.

The figures are checked against what the JSON carries (SGLang's balancedness recomputed from the
per-GPU counts, the hot GPU from the expert's place); tests/unit/test_diagnose.py checks the
trace and dump readers against independent computations on real profiler traces and dumps.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from contextlib import contextmanager

import pytest

HOST = "lab-02"  # 0.5.2: SGLang's Python benchmark client runs in the lab there (--load)
MOE = ("--model-path fleetctl-standin/tiny-moe --tp-size 4 --ep-size 4 --expert-distribution-recorder-mode stat")
EXPERTS, EP = 8, 4
LOG = "/opt/fleetctl-standin/server.log"
# a client that keeps 3 decodes in flight on the host (stdlib: the lab venv's python)
TRAFFIC = r"""
import json, threading, urllib.request
def loop():
    body = json.dumps({"text": "tell me about the sea", "sampling_params": {"max_new_tokens": 48, "temperature": 0}}).encode()
    while True:
        try:
            urllib.request.urlopen(urllib.request.Request("http://127.0.0.1:30000/generate", body,
                                   {"Content-Type": "application/json"}), timeout=60).read()
        except Exception:
            pass
for _ in range(3):
    threading.Thread(target=loop, daemon=True).start()
threading.Event().wait()
"""


def restart(lab, args: str = "") -> None:
    r = lab.ssh(HOST, f"/opt/fleetctl-standin/restart.sh {args} && for i in $(seq 400); do "
                "curl -sf localhost:30000/health >/dev/null && exit 0; sleep 0.2; done; exit 1", timeout=120)
    assert r.returncode == 0, r.stderr




@contextmanager
def traffic(lab):
    assert lab.ssh(HOST, "cat > /opt/fleetctl-standin/traffic.py", input=TRAFFIC).returncode == 0
    r = lab.ssh(HOST, "nohup /opt/sglang/venv/bin/python /opt/fleetctl-standin/traffic.py >/dev/null 2>&1 & echo $!")
    pid = int(r.stdout.strip())
    try:
        yield
    finally:
        lab.ssh(HOST, f"kill {pid}")


@pytest.fixture(scope="module")
def moe(server_lab, tmp_path_factory):
    """The MoE stand-in on HOST; the runs recorded in a history file of their own; the host's
    default stand-in again after."""
    server_lab.set_behavior(HOST, {}, restart=False)
    restart(server_lab, MOE)
    env = {"FLEETCTL_HISTORY": str(tmp_path_factory.mktemp("diag") / "history.sqlite")}
    try:
        yield server_lab, env
    finally:
        server_lab.set_behavior(HOST, {}, restart=True)


def diagnose(lab, env, *args, rc=None):
    _, _, hosts = lab.cli_json("diagnose", HOST, "--seconds", "40", *args, env=env, rc=rc, timeout=400)
    (s,) = hosts[HOST]["servers"]
    return hosts[HOST], s


def left_on_host(lab) -> str:
    """The private directories diagnose left on the host (none: "")."""
    return lab.ssh(HOST, "ls -d /tmp/fleetctl-diagnose-* 2>/dev/null").stdout.strip()


def check_common(s: dict) -> None:
    """What every measured server's entry holds: the trace's shares sum to 1 and come from the
    stand-in's regions; SGLang's balancedness recomputed from each layer's GPU counts; profiling and
    recording stopped; nothing left in /tmp."""
    tr, ex = s["trace"], s["experts"]
    assert tr["source"] == "annotation" and tr["events"] > 0 and tr["device_us"] > 0
    assert sum(tr["shares"].values()) == pytest.approx(1.0)
    assert ex["ep_size"] == EP and ex["experts"] == EXPERTS
    for layer in ex["layers"]:
        g = layer["gpu_counts"]
        assert layer["balancedness"] == pytest.approx((sum(g) / EP + 1e-5) / (max(g) + 1e-5))
    assert set(s["stopped"]) == {"/stop_profile", "/stop_expert_distribution_record"}
    assert s["dump_file"].startswith("expert_distribution_recorder_")


def test_a_healthy_server_gets_none_under_the_load_client(moe):
    lab, env = moe
    h, s = diagnose(lab, env, "--load", "smoke", rc=0)
    check_common(s)
    assert s["verdict"]["verdict"] == "none", s["verdict"]
    assert s["verdict"]["action"].startswith("none of fleetctl's changes")
    assert s["load"] and s["load"]["client"], s["load"]  # the load gate's client drove the profile
    assert s["experts"]["worst"]["balancedness"] >= 0.55
    assert left_on_host(lab) == ""


def diagnose_under_fault(lab, env, kind: str, arg) -> dict:
    """The server's diagnose entry, taken under traffic with the lab's stand-in behaviour `kind`
    `arg` set (the server rereads its behaviour file: no restart), which is cleared after; the
    checks every entry passes (check_common) done."""
    lab.fault(HOST, kind, arg)
    try:
        with traffic(lab):
            h, s = diagnose(lab, env, rc=0)
    finally:
        lab.fault(HOST, "behave")
    check_common(s)
    return s


def test_a_hot_expert_gives_the_moe_verdict_with_its_layer_and_gpu(moe):
    lab, env = moe
    s = diagnose_under_fault(lab, env, "hot-expert", "1:6")
    v = s["verdict"]
    assert v["verdict"] == "moe-imbalance", v
    assert (v["figures"]["worst_layer"], v["figures"]["worst_gpu"]) == (1, 6 // (EXPERTS // EP))
    worst = s["experts"]["worst"]
    assert worst["hot_expert"] == 6 and max(range(EP), key=lambda g: worst["gpu_counts"][g]) == 3
    assert "--enable-eplb" in v["action"] and "layer 1: GPU 3" in v["why"]


def test_slow_attention_gives_the_attention_verdict(moe):
    lab, env = moe
    s = diagnose_under_fault(lab, env, "slow-attention", 30)
    assert s["verdict"]["verdict"] == "attention", s["verdict"]
    assert s["verdict"]["figures"]["attention_share"] >= 0.6


def test_a_fragmenting_allocator_gives_the_defrag_verdict(moe):
    lab, env = moe
    with traffic(lab):
        h, s = diagnose(lab, env, "--allocator-replay", "--pool", "32768", "--concurrency", "16", "--input",
                        "64:1024", "--output", "16:512", "--requests", "80", "--seed", "7", rc=0)
    check_common(s)
    v = s["verdict"]
    assert v["verdict"] == "kv-fragmentation", v
    frag = v["figures"]["fragmentation"]
    assert frag["kind"] == "token" and frag["without_sort"] >= 1.5 * frag["with_sort"]
    assert v["action"] == "fleetctl apply defrag-tier0"


def _probe_pids(lab) -> list[tuple[int, int, int]]:
    """(pid, session id, parent pid) of the processes on the host whose command line is the probe
    start's (the shell that starts it, the probe, and the probe's guard: a fork that leads a session
    of its own)."""
    out = lab.ssh(HOST, "for p in $(pgrep -f 'fleetctl-no-pytho[n]'); do echo $p $(ps -o sid=,ppid= -p $p); done").stdout
    return [tuple(map(int, line.split())) for line in out.splitlines() if len(line.split()) == 3]


def _start_and_wait_for_profile(lab, env) -> subprocess.Popen:
    """A diagnose run (no traffic: the profile waits for steps), once the host has its private
    directory and the server its /start_profile."""
    p = subprocess.Popen([sys.executable, "-m", "fleetctl.cli", "diagnose", HOST, "--seconds", "60", "--json"],
                         env={**lab.env, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(150):
        if left_on_host(lab) and "start_profile" in lab.ssh(HOST, f"tail -5 {LOG}").stdout:
            return p
        time.sleep(0.2)
    p.kill()
    raise AssertionError("diagnose never started a profile")


def test_a_killed_run_leaves_nothing_on(moe):
    lab, env = moe
    # 1. fleetctl and the probe killed (SIGKILL): the guard stops both within a second
    p = _start_and_wait_for_profile(lab, env)
    mark = int(lab.ssh(HOST, f"wc -l < {LOG}").stdout)
    p.send_signal(signal.SIGKILL)
    p.wait()
    procs = _probe_pids(lab)
    pids = {pid for pid, _, _ in procs}
    guard = [(pid, ppid) for pid, sid, ppid in procs if pid == sid and ppid in pids]
    assert len(guard) == 1, procs  # the probe outlives the connection; its guard is its child
    lab.ssh(HOST, f"kill -9 {guard[0][1]}")  # the probe
    for _ in range(25):
        if not left_on_host(lab):
            break
        time.sleep(0.2)
    assert left_on_host(lab) == ""
    after = lab.ssh(HOST, f"tail -n +{mark + 1} {LOG}").stdout
    assert '"POST /stop_profile' in after and '"POST /stop_expert_distribution_record HTTP/1.1" 200' in after
    # nothing is profiling now: a stop finds none in progress (the stand-in answers 500, as SGLang's
    # tokenizer raises)
    code = lab.ssh(HOST, "curl -s -o /dev/null -w '%{http_code}' -X POST localhost:30000/stop_profile").stdout
    assert code == "500"

    # 2. the probe and its guard both killed: the next run stops both first and removes the directory
    p = _start_and_wait_for_profile(lab, env)
    left = left_on_host(lab)
    p.send_signal(signal.SIGKILL)
    p.wait()
    lab.ssh(HOST, "kill -9 " + " ".join(str(pid) for pid, _, _ in _probe_pids(lab)))
    assert left_on_host(lab) == left  # the profile and the record are still on
    with traffic(lab):
        h, s = diagnose(lab, env, rc=0)
    assert s["leftovers"] == [left.rsplit("/", 1)[1]]
    check_common(s)
    assert left_on_host(lab) == ""


def test_history_and_the_html_report_show_the_verdicts(moe, tmp_path):
    """The history the runs above recorded (the module's file, in this file's order): history show
    prints the last one's tables, and the HTML report shows each verdict's group."""
    lab, env = moe
    r = lab.cli("history", "list", env=env)
    assert r.returncode == 0 and "diagnose" in r.stdout, r.stdout
    r = lab.cli("history", "show", "last", env=dict(env, COLUMNS="200"))
    assert r.returncode == 0 and "fleet roll-up" in r.stdout and "none of fleetctl's changes" in r.stdout, r.stdout
    page = tmp_path / "fleet.html"
    r = lab.cli("report", "-o", str(page), env=env)
    assert r.returncode == 0, r.stderr
    html = page.read_text()
    assert "last diagnosis" in html and ":30000 moe-imbalance: layer 1: GPU 3" in html
    for verdict in ("none", "moe-imbalance", "attention", "kv-fragmentation"):
        assert f'data-verdict="{verdict}"' in html, verdict
