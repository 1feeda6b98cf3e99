"""Validation under load, the pure parts: profile sizing, the client's argv and environment (no
key in argv), each release's result line read back (recorded from real client runs against the
lab's stand-in: tests/golden/load-results/), the client run's deadline, the settings, and the
load gate's breach rules at their boundaries (tolerances, repeat noise)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import zipfile
from pathlib import Path

import pytest

from fleetctl.engine import load as gate
from fleetctl.engine.gates.load import compare_load
from fleetctl.engine.load import LoadOptions, load_options
from fleetctl.engine.validate import load_problems
from fleetctl.probes import runas
from fleetctl.probes.traffic import load
from fleetctl.vocab import GateStatus
from fleetctl.wheels import ensure_wheel
from oracles import release_file
from helpers.proc import alive_pids

RESULTS = Path(__file__).resolve().parent.parent / "golden" / "load-results"
RELEASES = ("0.4.6.post5", "0.5.2", "0.5.10", "0.5.23")
CLIENT_FILE = {"0.4.6.post5": "sglang/bench_serving.py", "0.5.2": "sglang/bench_serving.py",
               "0.5.10": "sglang/bench_serving.py", "0.5.23": "sglang/benchmark/serving.py"}


# ---- the workload -----------------------------------------------------------------------------

def test_profiles_and_what_the_operator_gives():
    w = load.workload("smoke")
    assert (w["concurrency"], w["num_prompts"], w["input_len"], w["output_len"]) == (2, 8, 64, 32)
    assert (w["range_ratio"], w["seed"], w["warmup"], w["request_rate"]) == (0.5, 42, 2, "inf")
    assert w["pool_tokens"] is None and w["demand_tokens"] == round(2 * (64 + 32) * 0.75)
    w = load.workload("steady", {"concurrency": 3, "num_prompts": None, "input_len": 10, "output_len": 4})
    assert (w["concurrency"], w["num_prompts"], w["input_len"], w["output_len"], w["warmup"]) == (3, 256, 10, 4, 3)
    for bad in (0, -1, True, "4", 2.0):
        with pytest.raises(ValueError, match="concurrency must be a positive whole number"):
            load.workload("smoke", {"concurrency": bad})
    with pytest.raises(ValueError, match="unknown load profile 'heavy'"):
        load.workload("heavy")
    with pytest.raises(ValueError, match="unknown workload setting 'rate'"):
        load.workload("smoke", {"rate": 2})


def test_pressure_is_sized_from_the_kv_pool():
    # (1024 + 256) x 0.75 = 960 tokens per request; 1.2 x 4096 / 960 = 5.12 -> 6 in flight
    w = load.workload("pressure", None, {"max_total_num_tokens": 4096})
    assert (w["concurrency"], w["num_prompts"], w["pool_tokens"], w["demand_tokens"]) == (6, 24, 4096, 5760)
    assert w["demand_tokens"] >= 1.2 * 4096 > (w["concurrency"] - 1) * 960  # the least concurrency that reaches it
    w = load.workload("pressure", None, {"max_total_num_tokens": 4000})  # 1.2 x 4000 / 960 = 5.0 exactly
    assert w["concurrency"] == 5
    w = load.workload("pressure", {"input_len": 32, "output_len": 8}, {"max_total_num_tokens": 4096})
    assert w["concurrency"] == 164 and w["num_prompts"] == 4 * 164  # 1.2 x 4096 / 30
    assert load.workload("pressure", None, {"max_total_num_tokens": 10 ** 9})["concurrency"] == load.MAX_CONCURRENCY
    w = load.workload("pressure", {"concurrency": 3}, {})  # given: no pool needed
    assert (w["concurrency"], w["num_prompts"], w["pool_tokens"]) == (3, 12, None)
    for info in ({}, {"max_total_num_tokens": None}, {"max_total_num_tokens": 0}, {"max_total_num_tokens": True}):
        with pytest.raises(ValueError, match="sized from /server_info max_total_num_tokens"):
            load.workload("pressure", None, info)


# ---- the client, its argv and its environment ----------------------------------------------------

def _layout(tmp_path: Path, version: str) -> str:
    """The release's sglang/ tree as empty files (its names only), in tmp_path/VERSION."""
    root = tmp_path / version
    with zipfile.ZipFile(ensure_wheel(version)) as z:
        for n in z.namelist():
            if n.startswith("sglang/") and (n.endswith(".py") or n.endswith(".so")):
                p = root / n
                p.parent.mkdir(parents=True, exist_ok=True)
                p.touch()
    return str(root / "sglang")


def test_each_release_gets_its_own_client_in_order(tmp_path):
    found = {v: [c["module"] for c in load.clients(_layout(tmp_path, v))] for v in RELEASES}
    assert found == {"0.4.6.post5": ["sglang.bench_serving"], "0.5.2": ["sglang.bench_serving"],
                     "0.5.10": ["sglang.bench_serving"],
                     "0.5.23": ["sglang.benchmark.serving", "sglang.benchmark.rust_client"]}
    pkg = str(tmp_path / "0.5.23" / "sglang")
    assert [c["module"] for c in load.clients(pkg, "rust")] == ["sglang.benchmark.rust_client"]
    assert [c["module"] for c in load.clients(pkg, "python")] == ["sglang.benchmark.serving"]
    assert load.clients(str(tmp_path / "0.5.10" / "sglang"), "rust") == []
    os.unlink(os.path.join(pkg, "srt", "rust_extensions", "_bench.cpython-311-x86_64-linux-gnu.so"))
    assert [c["module"] for c in load.clients(pkg)] == ["sglang.benchmark.serving"]  # no extension: no Rust client


@pytest.mark.parametrize("version", RELEASES)
def test_the_argv_uses_only_what_the_release_declares_and_never_a_key(version):
    have = load.flags(release_file(version, CLIENT_FILE[version]))
    assert {"--backend", "--dataset-name", "--flush-cache", "--warmup-requests", "--output-details"} <= have
    w = load.workload("smoke", {"num_prompts": 4})
    client = {"module": "sglang.bench_serving", "path": "x", "rust": False}
    argv = load.client_argv("/opt/v/bin/python", "/opt/site", "/opt/site/sglang", client, have, w, "127.0.0.1", 30000,
                            "m", "/opt/tok", "/tmp/d/result.jsonl", version)
    assert argv[:8] == ["/opt/v/bin/python", "-I", "-c", load.RUNNER, "/opt/site", "/opt/site/sglang",
                        "sglang.bench_serving", "--backend"]
    opts = dict(zip(argv[7::], argv[8::]))
    assert (opts["--dataset-name"], opts["--num-prompts"], opts["--random-range-ratio"], opts["--max-concurrency"],
            opts["--request-rate"], opts["--seed"], opts["--output-file"]) == (
        "random-ids", "4", "0.5", "2", "inf", "42", "/tmp/d/result.jsonl")
    assert "--flush-cache" in argv and "--disable-tqdm" in argv
    assert ("--ready-check-timeout-sec" in argv) == (version in ("0.5.10", "0.5.23"))
    assert ("--tokenize-prompt" in argv) == (version in ("0.5.10", "0.5.23"))  # 0.5.2's is broken, 0.4.6 has none
    assert not any("key" in a.lower() or "sk-" in a for a in argv)
    with pytest.raises(ValueError, match="lacks --flush-cache"):
        load.client_argv("p", "l", "l/sglang", client, have - {"--flush-cache"}, w, "h", 1, "m", "t", "o", version)


def test_the_rust_client_and_a_container_deadline():
    w = load.workload("smoke")
    client = {"module": "sglang.benchmark.rust_client", "path": "x", "rust": True}
    argv = load.client_argv("/py", "/l", "/l/sglang", client, load.RUST_FLAGS, w, "::1", 30001, "m", "t", "o", "0.5.23",
                            ("/usr/bin/timeout", "-k", "5", "300"))
    assert argv[:5] == ["/usr/bin/timeout", "-k", "5", "300", "/py"]
    assert argv[argv.index("--host") + 1] == "::1" and "--tokenize-prompt" in argv


def test_the_environment_is_built_from_nothing_with_the_key_only_there():
    server_env = {"HOME": "/home/svc", "http_proxy": "http://proxy:3128", "HTTPS_PROXY": "http://p",
                  "API_KEY": "sk-other", "HF_HUB_CACHE": "/data/hub", "PYTHONPATH": "/evil", "LD_PRELOAD": "/x.so"}
    env = load.client_env("/tmp/fleetctl-load-x", server_env, "sk-SECRET")
    assert env["OPENAI_API_KEY"] == "sk-SECRET" and "API_KEY" not in env
    assert (env["HOME"], env["TMPDIR"], env["HF_HUB_OFFLINE"], env["TRANSFORMERS_OFFLINE"]) == (
        "/tmp/fleetctl-load-x", "/tmp/fleetctl-load-x", "1", "1")
    assert env["HF_HUB_CACHE"] == "/data/hub" and env["HF_HOME"] == "/home/svc/.cache/huggingface"
    assert not {k for k in env if "proxy" in k.lower()} - {"NO_PROXY", "no_proxy"}
    assert "PYTHONPATH" not in env and "LD_PRELOAD" not in env
    assert "OPENAI_API_KEY" not in load.client_env("/t", {}, None)


def _fake_install(root: Path, body: str) -> str:
    pkg = root / "sglang"
    (pkg / "benchmark").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "benchmark" / "__init__.py").write_text("")
    (pkg / "benchmark" / "serving.py").write_text(body)
    return str(pkg)


def test_the_runner_runs_the_servers_install_as_python_m_would(tmp_path):
    body = "import sys\nif __name__ == '__main__':\n    print('ran', sys.argv[1:], __name__)\n"
    pkg = _fake_install(tmp_path / "a", body)
    r = subprocess.run([sys.executable, "-I", "-c", load.RUNNER, str(tmp_path / "a"), pkg, "sglang.benchmark.serving",
                        "--seed", "42"], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == "ran ['--seed', '42'] __main__", r.stderr
    other = _fake_install(tmp_path / "b", body)  # another install's directory: refused by name, nothing run
    r = subprocess.run([sys.executable, "-I", "-c", load.RUNNER, str(tmp_path / "a"), other, "sglang.benchmark.serving"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 3 and "not to the server's install " + other in r.stderr and "ran" not in r.stdout


def test_a_client_that_hangs_is_killed_at_the_deadline_with_its_group(tmp_path):
    script = textwrap.dedent(f"""
        import os, subprocess, sys, time
        kid = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        open({str(tmp_path / 'pids')!r}, "w").write("%d %d" % (os.getpid(), kid.pid))
        print("sk-TAIL api_key=sk-TAIL", flush=True)
        time.sleep(60)
    """)
    t0 = time.monotonic()
    ran = load.run_client([sys.executable, "-c", script], {"PATH": "/usr/bin:/bin"}, str(tmp_path), 2.0,
                          runas.account())
    assert ran["timed_out"] and ran["returncode"] == -9 and 2.0 <= time.monotonic() - t0 < 10
    assert ran["tail"] == ["sk-TAIL api_key=<redacted>"]  # its output, redacted
    pids = [int(p) for p in (tmp_path / "pids").read_text().split()]
    end = time.monotonic() + 5
    while alive_pids(pids) and time.monotonic() < end:
        time.sleep(0.1)
    assert alive_pids(pids) == []
    again = tmp_path / "again"
    again.mkdir()
    ran = load.run_client([sys.executable, "-c", "import sys; print('done'); sys.exit(4)"], {}, str(again), 30,
                          runas.account())
    assert (ran["returncode"], ran["timed_out"], ran["tail"]) == (4, False, ["done"])


def test_a_client_never_outlives_the_probe_that_watches_it(tmp_path):
    """The probe killed mid-run (its SSH session gone, say): the kernel kills the client too
    (PR_SET_PDEATHSIG), though no deadline fired."""
    pidfile = tmp_path / "client.pid"
    client = f"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    probe = (f"from fleetctl.probes import runas; from fleetctl.probes.traffic import load; import sys; "
             f"load.run_client([sys.executable, '-c', {client!r}], {{}}, {str(tmp_path)!r}, 60, runas.account())")
    p = subprocess.Popen([sys.executable, "-c", probe], env={"PYTHONPATH": os.environ["PYTHONPATH"]})
    end = time.monotonic() + 30
    while not pidfile.exists() and time.monotonic() < end:
        time.sleep(0.05)
    pid = int(pidfile.read_text())
    assert alive_pids([pid]) == [pid]
    p.kill()
    p.wait()
    end = time.monotonic() + 5
    while alive_pids([pid]) and time.monotonic() < end:
        time.sleep(0.05)
    assert alive_pids([pid]) == []


# ---- the result line, per release ----------------------------------------------------------------

def recorded(name: str) -> str:
    return (RESULTS / f"{name}.jsonl").read_text()


@pytest.mark.parametrize("name", ("0.4.6.post5", "0.5.2", "0.5.10", "0.5.23-rust"))
def test_each_releases_result_line_reads_back_under_sglangs_names(name):
    text = recorded(name)
    raw = json.loads(text.splitlines()[-1])
    got = load.parse_result(text, raw["completed"])
    m = got["load"]
    for key in ("completed", "request_throughput", "output_throughput", "median_ttft_ms", "p99_ttft_ms",
                "p99_itl_ms", "p99_e2e_latency_ms", "mean_tpot_ms", "total_output_tokens", "duration"):
        assert isinstance(m[key], (int, float)) and m[key] == raw[key], key
    assert m["requested"] == raw["completed"] and m["failed"] == 0
    assert m["output_throughput"] > 0 and m["p99_itl_ms"] >= m["median_itl_ms"] > 0
    assert not set(m) & (load.DETAILS | load.ARGUMENTS | {"server_info"})  # per-request columns and args left out
    assert got["errors"] == []
    if "server_info" in raw:  # 0.5.10 and later copy /server_info into the line
        assert got["server_info"]["version"] == raw["server_info"]["version"]
    else:
        assert got["server_info"] is None
    # completed is counted against the number asked: the client exits 0 when requests fail
    short = load.parse_result(text, raw["completed"] + 3)["load"]
    assert (short["requested"], short["failed"]) == (raw["completed"] + 3, 3)


def test_failed_requests_and_silent_streams_count_and_are_quoted():
    base = json.loads(recorded("0.5.23-rust").splitlines()[-1])
    n = len(base["errors"])
    errors = ["", "Internal Server Error: {\"error\": 500}", "Traceback\n  x\nKeyError: 'text' token=sk-1"]
    doc = dict(base, completed=n - 2, errors=errors + [""] * (n - 3), generated_texts=["a", "", ""] + ["b"] * (n - 3))
    got = load.parse_result("older line\n" + json.dumps(doc) + "\n\n", n)
    assert got["load"]["failed"] == 2  # the two the client counted failed
    doc["generated_texts"][0] = ""  # a "success" with no text: an error event mid-stream (0.5.2+ count it a success)
    got = load.parse_result(json.dumps(doc), n)
    assert got["load"]["failed"] == 3 and got["load"]["completed"] == n - 2
    assert got["errors"] == ['Internal Server Error: {"error": 500}', "KeyError: 'text' token=<redacted>",
                             "1 stream(s) ended without any text (an error event in the stream?)"]
    for bad in ("", "\n\n", "[1]", json.dumps({"duration": 1})):
        with pytest.raises(ValueError):
            load.parse_result(bad, 4)
    nan = load.parse_result(json.dumps(dict(base, std_itl_ms=float("nan"), p99_itl_ms=float("inf"))), n)["load"]
    assert nan["std_itl_ms"] is None and nan["p99_itl_ms"] is None


def test_the_clients_server_info_copy_is_redacted():
    base = json.loads(recorded("0.5.23-rust").splitlines()[-1])
    info = dict(base["server_info"], api_key="sk-IN-SERVER-INFO", admin_api_key="adm",
                served_model_name="x", model_path="https://u:pw@hub/m?sig=abc", tokenizer_path="/tok",
                internal_states=[{"hf_token": "hf_x", "last_gen_throughput": 3.5}])
    got = load.parse_result(json.dumps(dict(base, server_info=info)), base["completed"])["server_info"]
    blob = json.dumps(got)
    assert "sk-IN-SERVER-INFO" not in blob and "adm" not in blob.replace("admin", "") and "hf_x" not in blob
    assert "pw@" not in blob and "abc" not in blob
    assert got["api_key"] == got["admin_api_key"] == got["internal_states"][0]["hf_token"] == "<redacted>"
    assert got["tokenizer_path"] == "/tok" and got["internal_states"][0]["last_gen_throughput"] == 3.5
    assert load.redact_info({"api_key": None}) == {"api_key": None}


# ---- the settings ----------------------------------------------------------------------------------

def test_settings_layer_and_refuse_bad_values():
    o = load_options({"profile": "pressure", "max_throughput_drop": 0.05, "repeat": 2}, {"max_throughput_drop": None,
                                                                                        "itl_slack_ms": 0})
    assert (o.profile, o.max_throughput_drop, o.repeat, o.itl_slack_ms, o.max_itl_rise) == ("pressure", 0.05, 2, 0.0, 0.2)
    assert load_options({"profile": "pressure"}, {"profile": "steady"}).profile == "steady"
    assert load_options().budget_s(3) == 3 * (300 + gate.LOAD_SLACK_S)
    for bad, msg in (({"profile": "x"}, "unknown load profile 'x'"), ({"repeat": 3}, "repeat must be 1 or 2"),
                     ({"concurrency": 0}, "concurrency must be a whole number of at least 1"),
                     ({"max_throughput_drop": 1}, "max_throughput_drop must be at least 0 and below 1"),
                     ({"max_itl_rise": -0.1}, "max_itl_rise must not be negative"),
                     ({"timeout_s": 0}, "timeout_s must be positive"), ({"client": "go"}, "unknown load client 'go'"),
                     ({"speed": 1}, "unknown load setting 'speed'"), ({"itl_slack_ms": "2"}, "must be a number")):
        with pytest.raises(ValueError, match=msg):
            load_options(bad)


# ---- the gate ---------------------------------------------------------------------------------------

def run(**metrics):
    """A run_load result of one server 127.0.0.1:30000 with these metrics (SGLang's names)."""
    m = {"completed": 8, "requested": 8, "failed": 0, "output_throughput": 100.0, "p99_itl_ms": 10.0,
         "p99_ttft_ms": 100.0, "median_ttft_ms": 50.0, **metrics}
    return {"servers": [{"host": "127.0.0.1", "port": 30000, "ok": m["failed"] == 0, "not_run": None,
                         "error": None if m["failed"] == 0 else f"{m['failed']} of 8 requests failed",
                         "errors": ["HTTP 500"] if m["failed"] else [], "load": m}], "refused": []}


def verdict(after, *baselines, **tol):
    result, rows = compare_load(list(baselines) or [run()], after, LoadOptions(**tol))
    return {c.name: c.passed for c in result.checks}, result, rows


@pytest.mark.parametrize("after,passed", [
    (run(), True),
    (run(output_throughput=90.0), True), (run(output_throughput=89.99), False),       # >= 0.90 x baseline
    (run(p99_itl_ms=14.0), True), (run(p99_itl_ms=14.001), False),                    # <= 1.2 x + 2 ms
    (run(p99_ttft_ms=145.0), True), (run(p99_ttft_ms=145.01), False),                 # <= 1.25 x + 20 ms
    (run(output_throughput=500.0, p99_itl_ms=1.0, p99_ttft_ms=1.0), True),            # faster passes
])
def test_each_breach_rule_at_its_boundary(after, passed):
    checks, result, _ = verdict(after)
    assert result.passed is passed and all(checks.values()) is passed
    assert set(checks) == {"load-errors", "load-throughput", "load-itl", "load-ttft"}


def test_any_failed_request_breaches_whatever_the_figures():
    checks, result, _ = verdict(run(failed=1, completed=7, output_throughput=200.0))
    assert result.failed and checks["load-errors"] is False and checks["load-throughput"] is True
    assert "7 of 8 requests completed, 1 failed: HTTP 500" in result.message


def test_tolerances_are_settings():
    assert verdict(run(output_throughput=94.0), max_throughput_drop=0.05)[1].failed
    assert verdict(run(output_throughput=95.0), max_throughput_drop=0.05)[1].passed
    assert verdict(run(p99_itl_ms=12.0), max_itl_rise=0.0, itl_slack_ms=2.0)[1].passed
    assert verdict(run(p99_itl_ms=12.01), max_itl_rise=0.0, itl_slack_ms=2.0)[1].failed
    assert verdict(run(p99_ttft_ms=200.0), max_ttft_rise=1.0, ttft_slack_ms=0)[1].passed
    assert verdict(run(p99_ttft_ms=200.01), max_ttft_rise=1.0, ttft_slack_ms=0)[1].failed
    _, result, rows = verdict(run(p99_itl_ms=20.0))
    assert "p99_itl_ms 20.00 ms vs baseline 10.00 ms (2.00x; at most 1.20x + 2 ms = 14.00 ms)" in result.message
    assert rows[0]["limits"] == {"output_throughput": 90.0, "p99_itl_ms": 14.0, "p99_ttft_ms": 145.0}


def test_two_baselines_widen_each_tolerance_by_their_spread():
    b1, b2 = run(output_throughput=100.0, p99_itl_ms=10.0), run(output_throughput=120.0, p99_itl_ms=10.0)
    # mean 110, spread 20/110 = 18.2%: drop tolerance 10% -> 36.4%, limit 110 x 0.636 = 70.0
    after = run(output_throughput=70.0)
    assert verdict(after, run(output_throughput=110.0))[1].failed  # one baseline: 70 < 99
    checks, result, rows = verdict(after, b1, b2)
    assert checks["load-throughput"] is True and result.passed
    assert rows[0]["baseline"]["output_throughput"] == 110.0 and len(rows[0]["baselines"]) == 2
    assert rows[0]["spread"]["output_throughput"] == pytest.approx(20 / 110)
    assert verdict(run(output_throughput=69.9), b1, b2)[1].failed
    thr = next(c for c in result.checks if c.name == "load-throughput")
    assert "tolerance 10% widened to 36% by the baselines' spread of 18.2%" in thr.detail
    # a spread below the configured tolerance leaves it as set
    checks, result, _ = verdict(run(p99_itl_ms=14.001), b1, b2)
    assert checks["load-itl"] is False


def test_a_gate_that_asked_for_load_fails_closed():
    nr = {"servers": [{"host": "127.0.0.1", "port": 30000, "ok": False, "error": None,
                       "not_run": "no SGLang benchmark client runs here: x", "load": None}], "refused": []}
    checks, result, _ = verdict(nr)
    assert result.failed and checks == {"load-run": False}
    assert "load: not run: no SGLang benchmark client runs here: x" in result.message
    checks, result, _ = verdict(run(), nr)
    assert result.failed and checks == {"load-baseline": False}
    checks, result, _ = verdict({"servers": [], "refused": []})
    assert result.failed and checks == {"load-run": False} and "missing after the change" in result.message
    assert compare_load([{"servers": []}], {"servers": []}, LoadOptions())[0].status == GateStatus.SKIPPED
    gone = run(output_throughput=None)
    assert verdict(gone)[0]["load-throughput"] is False
    assert load_problems(nr) == ["load 127.0.0.1:30000: not run: no SGLang benchmark client runs here: x"]
    assert load_problems(run(failed=2, completed=6)) == ["load 127.0.0.1:30000: 2 of 8 requests failed"]
    assert load_problems({"servers": [], "refused": [{"pid": 3, "host": "0.0.0.0", "port": 1, "reason": "r"}]}) == [
        "no server to load (nothing sent): pid 3 (claims 0.0.0.0:1): r"]


# ---- where the gate is asked for: a playbook's load step, the command line ---------------------------

PLAYBOOK = textwrap.dedent("""\
    name: t
    tasks:
      - name: edit
        edit_expressions:
          findings: need_sort_origins
          when: "not finding.literal"
          value: v.j2
          comment: c.j2
          marker: "fleetctl t:"
    validate:
      - smoke
      - load:
          when: "fleetctl_load_gate | default(false)"
          {settings}
    """)


def playbook(tmp_path: Path, settings: str) -> Path:
    (tmp_path / "v.j2").write_text("True\n")
    (tmp_path / "c.j2").write_text("# fleetctl t:\n")
    (tmp_path / "pb.yaml").write_text(PLAYBOOK.replace("{settings}", settings))
    return tmp_path / "pb.yaml"


def test_a_playbook_declares_the_load_gate_and_its_settings_are_checked_at_load(tmp_path):
    from fleetctl.engine.playbooks.apply import change_load
    from fleetctl.engine.changes import ChangeOptions
    from fleetctl.engine.playbooks.model import load_playbook
    from fleetctl.errors import ParseError

    shipped = load_playbook(Path(__file__).resolve().parents[2] / "playbooks" / "defrag-tier0.yaml")
    (step,) = [v for v in shipped.validate if v.step == "load"]
    assert step.load == {"profile": "pressure"} and step.when({"fleetctl_load_gate": True}) is True
    assert step.when({}) is False  # costs minutes and traffic: the inventory or the command line turns it on
    pb = load_playbook(playbook(tmp_path, "profile: steady\n      max_itl_rise: 0.5\n      repeat: 2"))
    assert [v.load for v in pb.validate] == [None, {"profile": "steady", "max_itl_rise": 0.5, "repeat": 2}]
    # the step applies (its `when` held for the host): its settings, under the command line's
    o = change_load(pb, {"smoke", "load"}, ChangeOptions(load_settings={"repeat": 1, "ttft_slack_ms": 5}))
    assert (o.profile, o.max_itl_rise, o.repeat, o.ttft_slack_ms) == ("steady", 0.5, 1, 5.0)
    assert change_load(pb, {"smoke"}, ChangeOptions()) is None  # it does not apply and --gate load was not given
    o = change_load(pb, {"smoke"}, ChangeOptions(load_gate=True, load_settings={"profile": "smoke"}))
    assert (o.profile, o.max_itl_rise) == ("smoke", 0.5)  # --gate load:smoke over the declared settings
    for settings, line, said in (("profile: heavy", 12, "load: unknown load profile 'heavy'"),
                                 ("repeat: 3", 12, "load: load repeat must be 1 or 2"),
                                 ("max_throughput_drop: 2", 12, "max_throughput_drop must be at least 0 and below 1"),
                                 ("rate: 5", 14, "unknown key 'rate' in load")):
        with pytest.raises(ParseError) as e:
            load_playbook(playbook(tmp_path, settings))
        assert str(e.value).startswith(f"{tmp_path / 'pb.yaml'}:{line}: ") and said in str(e.value), str(e.value)
    (tmp_path / "pb.yaml").write_text(PLAYBOOK.replace("{settings}", "profile: smoke") + "  - load\n")
    with pytest.raises(ParseError, match=r"pb.yaml:15: a second load step: a playbook declares at most one load gate"):
        load_playbook(tmp_path / "pb.yaml")


def test_the_command_line_names_the_load_flag_it_refuses(tmp_path):
    from fleetctl.errors import EXIT_OPTIONS

    inv = tmp_path / "hosts.yaml"
    inv.write_text("all:\n  hosts:\n    here:\n      ansible_connection: local\n")
    for argv, said in ((["validate", "all", "--load", "heavy"], "--load/--gate heavy: unknown load profile 'heavy'"),
                       (["validate", "all", "--load-prompts", "4"], "the --load-* options go with --load PROFILE"),
                       (["validate", "all", "--load", "smoke", "--load-prompts", "0"],
                        "--load-prompts 0: load num_prompts must be a whole number of at least 1"),
                       (["apply", "defrag-tier0", "all", "--gate", "smoke"], "--gate smoke: want load or load:PROFILE"),
                       (["apply", "defrag-tier0", "all", "--gate", "load", "--load-repeat", "3"],
                        "--load-repeat 3: load repeat must be 1 or 2"),
                       (["deploy", "kernel", "verify_attention", "all", "--max-itl-rise", "0.3", "--yes"],
                        "the --load-* and tolerance options go with --gate load")):
        r = subprocess.run([sys.executable, "-m", "fleetctl.cli", *argv, "-i", str(inv)], capture_output=True,
                           text=True, timeout=60)
        assert (r.returncode, said in " ".join(r.stderr.split())) == (EXIT_OPTIONS, True), (argv, r.stderr)
