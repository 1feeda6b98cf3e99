"""SGLang's own benchmark clients on the lab hosts, from each host's installed release and under
its interpreter (/opt/sglang/venv/bin/python, as root over the lab's ssh), against the host's
stand-in server: the streamed /generate, /v1/models, /flush_cache and /server_info the clients
use, the stand-in's tokenizer, and the behaviours `fleetctl lab fault HOST contention MS` and
`fail-every N` set on the running server (`behave` clears them).

What runs where (scripts/setup.sh installs the clients' modules): the Python client
`sglang.bench_serving` of 0.4.6.post5 and 0.5.2, the Rust client `sglang.benchmark.rust_client`
of 0.5.23; the Python clients of 0.5.10 and 0.5.23 import torchvision, which cannot be had on
this CPU-only machine (tests/unit/test_standin_stream.py shows where). One client run per
release feeds the per-release checks and the contention baseline."""

from __future__ import annotations

import json
import shlex
import time

import pytest

from fleetctl import lab as labmod

PROMPTS, CONCURRENCY = 16, 4
TOKENIZER = "/opt/fleetctl-standin/tokenizer"
# release -> the client module that runs there
CLIENTS = {"0.4.6.post5": "sglang.bench_serving", "0.5.2": "sglang.bench_serving",
           "0.5.23": "sglang.benchmark.rust_client"}
CONTENTION_MS = 5
MARK = "@@fleetctl-result@@"


def host_of(lab, release):
    return next(h["name"] for h in lab.status if h["release"] == release)


def client_argv(module, prompts=PROMPTS, concurrency=CONCURRENCY):
    """The client's command line: a closed loop of random-ids prompts against the host's stand-in."""
    argv = ["/opt/sglang/venv/bin/python", "-m", module, "--backend", "sglang", "--host", "127.0.0.1",
            "--port", "30000", "--model", "fleetctl-standin/tiny", "--tokenizer", TOKENIZER,
            "--dataset-name", "random-ids", "--num-prompts", str(prompts), "--random-input-len", "64",
            "--random-output-len", "16", "--random-range-ratio", "0.5", "--max-concurrency", str(concurrency),
            "--request-rate", "inf", "--seed", "1", "--warmup-requests", "1", "--flush-cache",
            "--disable-tqdm", "--output-file", "result.jsonl"]
    if module.endswith("rust_client"):
        argv.append("--tokenize-prompt")  # token ids, not text: prompt lengths exact
    return argv


def run_client(lab, host, module, **kw) -> dict:
    """Run the client on `host` in a fresh temp dir (its cwd and HOME: the result file and any
    cache land there, removed after), offline, in a clean environment, under a deadline.
    Returns {rc, out (its output's tail), result (the JSON result line or None), wall_s,
    counters_before/after (the stand-in's /server_info request counters)}."""
    script = (f"T=$(mktemp -d) && cd \"$T\" && env -i PATH=/usr/bin:/bin HOME=\"$T\" HF_HUB_OFFLINE=1 "
              f"TRANSFORMERS_OFFLINE=1 timeout 240 {shlex.join(client_argv(module, **kw))} >out 2>&1; "
              f"echo \"rc=$?\"; tail -c 4000 out; echo {MARK}; cat result.jsonl 2>/dev/null; "
              "cd / && rm -rf \"$T\"")
    before = server_info(lab, host)["stand_in_counters"]
    t0 = time.monotonic()
    r = lab.ssh(host, script, timeout=300)
    wall = time.monotonic() - t0
    assert r.returncode == 0, r.stderr
    head, _, tail = r.stdout.partition(MARK + "\n")
    rc_line, _, out = head.partition("\n")
    print(f"{host} {module}: {wall:.1f} s wall")  # the figures for tests/TIMINGS.md
    return {"rc": int(rc_line.removeprefix("rc=")), "out": out, "wall_s": wall,
            "result": json.loads(tail.splitlines()[0]) if tail.strip() else None,
            "counters_before": before, "counters_after": server_info(lab, host)["stand_in_counters"]}


def server_info(lab, host) -> dict:
    """GET /server_info of the host's stand-in, asked on the host."""
    probe = "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:30000/server_info').read().decode())"
    r = lab.ssh(host, f"python3 -c {shlex.quote(probe)}")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def lone_e2e(lab, host) -> float:
    """Median server-side e2e_latency (s) of 3 lone 16-token greedy decodes, not streamed (the
    smoke probe's request), asked on the host."""
    probe = ("import json, statistics, urllib.request\n"
             "body = json.dumps({'input_ids': [1, 306, 263, 450], 'sampling_params': "
             "{'max_new_tokens': 16, 'temperature': 0, 'ignore_eos': True}}).encode()\n"
             "print(statistics.median(json.load(urllib.request.urlopen(urllib.request.Request("
             "'http://127.0.0.1:30000/generate', body, {'Content-Type': 'application/json'})))"
             "['meta_info']['e2e_latency'] for _ in range(3)))")
    r = lab.ssh(host, f"python3 -c {shlex.quote(probe)}")
    assert r.returncode == 0, r.stderr
    return float(r.stdout)


def fault(lab, host, *args):
    """`fleetctl lab fault HOST ARGS...` as an operator types it."""
    r = lab.cli("lab", "fault", host, *args, "--lab-id", str(lab.lab_id))
    assert r.returncode == 0, r.stdout + r.stderr
    return r


@pytest.fixture(scope="module")
def runs(server_lab):
    """One client run per release that has one, on well-behaved stand-ins: {release: run_client's dict}."""
    return {release: run_client(server_lab, host_of(server_lab, release), module)
            for release, module in CLIENTS.items()}


@pytest.mark.parametrize("release", list(CLIENTS))
def test_real_client_completes_a_closed_loop(server_lab, runs, release):
    run = runs[release]
    assert run["rc"] == 0, run["out"]
    res = run["result"]
    assert res is not None, run["out"]
    # SGLang's own result keys, the same names in every release
    assert res["completed"] == PROMPTS and res["max_concurrency"] == CONCURRENCY
    assert res["output_throughput"] > 0 and res["request_throughput"] > 0 and res["total_output_tokens"] > 0
    for key in ("median_ttft_ms", "p99_ttft_ms", "mean_itl_ms", "p99_itl_ms", "p99_e2e_latency_ms"):
        assert res[key] > 0, key
    assert res["p99_ttft_ms"] >= res["median_ttft_ms"]
    # the stand-in saw every request: one warm-up + the prompts, one flush after the warm-up
    before, after = run["counters_before"], run["counters_after"]
    assert after["generate"] - before["generate"] == PROMPTS + 1
    assert after["flush_cache"] - before["flush_cache"] == 1


def test_contention_shows_under_concurrency_only(server_lab, runs):
    release = "0.5.2"
    host = host_of(server_lab, release)
    before = lone_e2e(server_lab, host)
    server_lab.behaved.add(host)
    try:
        fault(server_lab, host, "contention", str(CONTENTION_MS))
        assert server_info(server_lab, host)["stand_in_behavior"] == {"contention_ms": CONTENTION_MS}
        during = lone_e2e(server_lab, host)
        busy = run_client(server_lab, host, CLIENTS[release], concurrency=8)["result"]
        fault(server_lab, host, "behave")
        assert server_info(server_lab, host)["stand_in_behavior"] == {}
        server_lab.behaved.discard(host)
    finally:
        if host in server_lab.behaved:
            fault(server_lab, host, "behave")
            server_lab.behaved.discard(host)
    base = runs[release]["result"]
    print("contention", {k: (round(base[k], 2), round(busy[k], 2)) for k in
                         ("median_itl_ms", "p99_itl_ms", "p99_ttft_ms", "output_throughput")}, (before, during))
    # a request alone (the smoke's decode) waits for nobody: within half of what a single other
    # request in flight would add to its 16 steps
    assert during < before + 16 * CONTENTION_MS / 1000 / 2, (before, during)
    # at concurrency 8 each decode step waits CONTENTION_MS for each of 7 others in flight (the
    # closed loop keeps 8 in flight until the last 8 drain)
    assert busy["completed"] == PROMPTS
    assert busy["median_itl_ms"] >= 7 * CONTENTION_MS * 0.8 > base["median_itl_ms"]
    assert busy["p99_itl_ms"] > base["p99_itl_ms"] + 3 * CONTENTION_MS
    assert busy["p99_ttft_ms"] > base["p99_ttft_ms"]
    assert busy["output_throughput"] < base["output_throughput"]


def test_fail_every_fails_requests_while_the_client_exits_0(server_lab):
    release = "0.5.2"
    host = host_of(server_lab, release)
    server_lab.behaved.add(host)
    try:
        fault(server_lab, host, "fail-every", "4")
        run = run_client(server_lab, host, CLIENTS[release])
        # a decode that does not stream (the smoke's) is not counted and never fails
        r = server_lab.cli_json("validate", host)[0]
        fault(server_lab, host, "behave")
        server_lab.behaved.discard(host)
    finally:
        if host in server_lab.behaved:
            fault(server_lab, host, "behave")
            server_lab.behaved.discard(host)
    # streamed requests 4, 8, 12, 16 failed (the first is the warm-up): 4 of the 16 prompts
    assert run["rc"] == 0 and run["result"]["completed"] == PROMPTS - 4, run["out"]
    assert run["counters_after"]["generate"] - run["counters_before"]["generate"] == PROMPTS + 1
    assert r.returncode == 0


def test_behaviour_at_restart_and_refusals(server_lab):
    host = host_of(server_lab, "0.4.6.post5")
    server_lab.behaved.add(host)
    try:
        fault(server_lab, host, "fail-every", "3", "--at-restart")
        assert server_info(server_lab, host)["stand_in_behavior"] == {}  # the running server: unchanged
        r = server_lab.ssh(host, "/opt/fleetctl-standin/restart.sh")
        assert r.returncode == 0, r.stderr
        assert server_lab.server_healthy(host, timeout=120)
        assert server_info(server_lab, host)["stand_in_behavior"] == {"fail_every": 3}
        fault(server_lab, host, "behave")
        assert server_info(server_lab, host)["stand_in_behavior"] == {}
        server_lab.behaved.discard(host)
    finally:
        if host in server_lab.behaved:
            fault(server_lab, host, "behave")
            server_lab.behaved.discard(host)
    for args, says in ((("contention", "fast"), "whole number"), (("fail-every", "1.5"), "whole number"),
                       (("behave", "3"), "no argument"), (("down", "--at-restart"), "--at-restart")):
        r = server_lab.cli("lab", "fault", host, *args, "--lab-id", str(server_lab.lab_id))
        assert r.returncode != 0 and says in r.stdout + r.stderr, (args, r.stdout, r.stderr)
    status = {h["name"]: h for h in labmod.lab_status(server_lab.lab_id, server_lab.state_dir)}
    assert "fail_every" not in status[host]["faults"]
