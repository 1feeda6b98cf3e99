"""The lab stand-in's SGLang diagnostic instruments (agent/fleetctl/lab/standin/instruments.py, the
MoE model and kernel regions of engine.py, the routes of server.py), for issue 56's `fleetctl
diagnose`: the facts they are built on read from the four releases' wheels (routes and answers,
ProfileReqInput fields, trace and dump file names and layouts, the dump directory's variable, the
recorder modes, the kernel names); a real torch profiler trace of the tiny MoE model whose kernel
regions are those names, over the passes num_steps says; expert counts that add up to tokens x
top-k, dumped loadable with torch.load(weights_only=True); the faults (a hot expert dominates its
layer, slow attention raises attention's share); and over HTTP: the routes' answers, 0.4.6.post5's
start that waits for its steps, and the server dying where SGLang's would (a recorder route
without a recorder mode, a dump it cannot write)."""

from __future__ import annotations

import ast
import gzip
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import zipfile

import pytest

from fleetctl.lab import standin
from fleetctl.probes.traffic.smoke import wait_healthy
from fleetctl.wheels import ensure_wheel
from helpers.lab import load_standin
from helpers.proc import free_port

RELEASES = ("0.4.6.post5", "0.5.2", "0.5.10", "0.5.23")
PROFILER = {"0.4.6.post5": "sglang/srt/managers/scheduler.py",
            "0.5.2": "sglang/srt/managers/scheduler_profiler_mixin.py",
            "0.5.10": "sglang/srt/managers/scheduler_profiler_mixin.py",
            "0.5.23": "sglang/srt/managers/scheduler_components/profiler_manager.py"}
RECORDER = {v: "sglang/srt/eplb/expert_distribution.py" for v in RELEASES}
RECORDER["0.4.6.post5"] = "sglang/srt/managers/expert_distribution.py"
MODES = {v: "sglang/srt/server_args.py" for v in RELEASES}
MODES["0.5.23"] = "sglang/srt/arg_groups/fields/exec_.py"
INTERNAL = {v: "sglang/srt/managers/scheduler.py" for v in RELEASES}
INTERNAL["0.5.23"] = "sglang/srt/managers/scheduler_components/internal_state.py"
KERNEL_DIRS = ("sglang/srt/layers/", "sglang/srt/distributed/", "sglang/srt/speculative/", "sglang/kernels/")
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(autouse=True)
def real_sys_intern(monkeypatch):
    """ansible-core's module_utils (imported by the vault tests at collection) replace sys.intern
    with a patch object, which torch._dynamo (loaded at the profiler's first start, in process
    here) refuses as a polyfill target: the real one while these tests run."""
    real = getattr(type(sys.intern), "unpatched_implementation", None)
    if real is not None:
        monkeypatch.setattr(sys, "intern", real)


@pytest.fixture(scope="module")
def wheels():
    """{release: {path: text}} of each release's files the instruments' facts come from, and
    "kernels": the text of every .py under KERNEL_DIRS."""
    out = {}
    for v in RELEASES:
        files = {"sglang/srt/entrypoints/http_server.py", "sglang/srt/managers/io_struct.py", PROFILER[v],
                 RECORDER[v], MODES[v], INTERNAL[v]}
        with zipfile.ZipFile(ensure_wheel(v)) as z:
            out[v] = {f: z.read(f).decode() for f in files}
            out[v]["kernels"] = "\n".join(z.read(n).decode(errors="replace") for n in z.namelist()
                                          if n.endswith(".py") and n.startswith(KERNEL_DIRS))
    return out


@pytest.fixture(scope="module")
def mods():
    """(engine, instruments, server) modules of the stand-in, imported by path as a host runs them."""
    return load_standin(standin.ENGINE), load_standin(standin.INSTRUMENTS), load_standin(standin.SERVER)


def key(v):
    return tuple(int(x) for x in re.match(r"(\d+)\.(\d+)\.(\d+)", v).groups())


def class_fields(text, name):
    """The annotated field names of class `name` in module source `text`."""
    cls = next(n for n in ast.walk(ast.parse(text)) if isinstance(n, ast.ClassDef) and n.name == name)
    return {s.target.id for s in cls.body if isinstance(s, ast.AnnAssign)}


def test_routes_fields_and_files_are_the_releases(wheels, mods):
    _, ins, server = mods
    for v in RELEASES:
        r, src = key(v), wheels[v]
        http = src["sglang/srt/entrypoints/http_server.py"]
        for path, text in server.INSTRUMENT_ROUTES.items():
            at = http.index('@app.api_route("%s", methods=["GET", "POST"])' % path)
            content = http.index("content=", at)  # the route's first Response
            assert http[content:].startswith('content="%s"' % text.replace("\n", "\\n")), (v, path)
        io = src["sglang/srt/managers/io_struct.py"]
        if r < (0, 5, 23):
            assert class_fields(io, "ProfileReqInput") == ins.profile_fields(r), v
        else:  # the HTTP body is ProfileReq itself; req_type is set by the tokenizer
            assert class_fields(io, "ProfileReq") - {"req_type"} == ins.profile_fields(r)
        prof = src[PROFILER[v]]
        assert 'os.getenv("SGLANG_TORCH_PROFILER_DIR", "/tmp")' in prof, v
        assert '".trace.json.gz"' in prof, v
        if r < (0, 5, 10):
            assert 'f"-TP-{self.tp_rank}"' in prof and "forward_ct + num_steps\n" in prof, v
        else:
            assert 'filename_parts = [self.profile_id, f"TP-' in prof and 'f"EP-' in prof, v
            assert 'stage_suffix = f"-{stage.name}"' in prof and 'self.profile_prefix + "-"' in prof, v
        if r == (0, 5, 2):
            assert 'stage_suffix = f"-{stage.__str__()}"' in prof
        if r >= (0, 5, 23):
            assert "self.get_forward_ct() + num_steps + 1" in prof
        rec = src[RECORDER[v]]
        assert 'f"expert_distribution_recorder_{time.time()}.pt"' in rec, v
        assert "logical_count=logical_count_of_buffered_step" in rec and "if self._rank == 0:" in rec, v
        assert ("average_utilization_rate_over_window=" in rec) == (r >= (0, 5, 2)), v
        assert "SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR" in rec and "torch.save(data, str(path_output))" in rec, v
        modes = re.search(r"expert_distribution_recorder_mode: (?:A\[\s*)?Optional\[\s*Literal\[([^\]]*)\]",
                          src[MODES[v]])
        # the modes the release takes and has an accumulator for (uncommented in _Accumulator.get_class)
        accumulated = set(re.findall(r'^\s+"(\w+)": _\w+Accumulator,', rec, re.M))
        assert set(ins.recorder_modes(r)) <= set(re.findall(r'"(\w+)"', modes.group(1))) & accumulated, v
        if r >= (0, 5, 2):
            assert 'f"expert_distribution_recorder_{time.time()}_{self._rank}.pt"' in rec
            for k in ("records=self._records", "last_physical_to_logical_map=", "forward_pass_id=forward_pass_id",
                      "rank=self._rank", "gatherer_key=gatherer_key"):
                assert k in rec, (v, k)
        else:  # 0.4.6.post5: "stat" only
            assert '# "per_pass": _DetailAccumulator' in rec
        assert 'avg_spec_accept_length"]' in src[INTERNAL[v]], v
    assert ins.recorder_modes((0, 4, 6)) == ("stat",) and ins.recorder_modes((0, 5, 23)) == ("stat", "per_pass")
    env = wheels["0.5.23"]["sglang/srt/managers/io_struct.py"]
    assert "class ProfileReq(BaseReq, kw_only=True):" in env


def test_kernel_names_are_in_every_release(wheels, mods):
    engine = mods[0]
    names = {n for group in engine.KERNELS.values() for n in group}
    assert len(names) == 10
    for v in RELEASES:
        for n in names:
            bare = n.split("::")[-1]
            assert re.search(r"\b%s\b" % re.escape(bare), wheels[v]["kernels"]), (v, n)


def profile(engine, ins, release, req, run, out_dir, ep_size=1, behavior=None, **engine_kw):
    """Start `release`'s profiler (ranks of Engine(**engine_kw)'s tp_size over `ep_size`) with
    request `req` (output_dir out_dir) on a fresh Engine, run run(engine); {file name: trace}."""
    e = engine.Engine(0, behavior or {}, **engine_kw)
    e.profiler = prof = ins.Profiler(release, e.tp_size, ep_size)
    body = prof.parse(dict(req, output_dir=str(out_dir), with_stack=False))
    assert e.on_scheduler(lambda: prof.start(body, e.forward_ct)) == (True, "Succeeded")
    run(e)
    return {p.name: json.load(gzip.open(p)) for p in out_dir.iterdir()}


def regions(trace):
    """{name: [durations in us]} of a trace's record_function regions (user annotations)."""
    out = {}
    for ev in trace["traceEvents"]:
        if ev.get("cat") == "user_annotation" and ev.get("ph") == "X":
            out.setdefault(ev["name"], []).append(ev["dur"])
    return out


def test_a_real_trace_of_named_kernels_over_num_steps(mods, tmp_path):
    engine, ins, _ = mods
    names = {n for group in engine.KERNELS.values() for n in group}
    # 0.5.23: num_steps 3 = the prefill and two decode passes (3 new tokens need 3 passes)
    traces = profile(engine, ins, (0, 5, 23), {"num_steps": 3, "profile_id": "p1"},
                     lambda e: e.generate(list(b"hello"), dict(GREEDY, max_new_tokens=6)), tmp_path, moe=True)
    assert list(traces) == ["p1-TP-0.trace.json.gz"]
    t = traces["p1-TP-0.trace.json.gz"]
    assert "schemaVersion" in t and any(ev.get("name") == "aten::linear" for ev in t["traceEvents"])
    got = regions(t)
    assert set(got) <= names
    assert {"topk_softmax", "fused_moe_kernel", "silu_and_mul", "moe_align_block_size"} <= set(got)
    # one prefill (extend attention) and two decode passes, 2 layers each; two fused_moe per layer
    assert len(got["_fwd_kernel"]) == 2 and len(got["_fwd_grouped_kernel_stage1"]) == 4
    assert len(got["_fwd_kernel_stage2"]) == 4 and len(got["fused_moe_kernel"]) == 12
    assert "sglang::outplace_all_reduce" not in got  # one rank: no all-reduce


def test_release_names_stages_and_steps(mods, tmp_path):
    engine, ins, _ = mods
    # 0.5.10, TP 2 over EP 2, a prefix: one trace per rank; num_steps 3 = 2 passes before 0.5.23
    traces = profile(engine, ins, (0, 5, 10), {"num_steps": 3, "profile_prefix": "pre"},
                     lambda e: e.generate(list(b"hi"), dict(GREEDY, max_new_tokens=5)), tmp_path / "a",
                     ep_size=2, moe=True, tp_size=2)
    pid = next(iter(traces)).split("-")[1]
    assert sorted(traces) == ["pre-%s-TP-0-EP-0.trace.json.gz" % pid, "pre-%s-TP-1-EP-1.trace.json.gz" % pid]
    got = regions(traces["pre-%s-TP-0-EP-0.trace.json.gz" % pid])
    assert len(got["_fwd_kernel"]) + len(got["_fwd_grouped_kernel_stage1"]) == 2 * 2
    assert len(got["sglang::outplace_all_reduce"]) == 2 * 2 * 2  # after attention and MoE, 2 layers, 2 passes
    # by stage: one trace per stage, 1 prefill and 2 decode passes
    traces = profile(engine, ins, (0, 5, 10), {"num_steps": 2, "profile_by_stage": True},
                     lambda e: e.generate(list(b"hi"), dict(GREEDY, max_new_tokens=6)), tmp_path / "b")
    ext = next(n for n in traces if n.endswith("-TP-0-EXTEND.trace.json.gz"))
    dec = next(n for n in traces if n.endswith("-TP-0-DECODE.trace.json.gz"))
    assert len(traces) == 2 and len(regions(traces[ext])["_fwd_kernel"]) == 2
    assert len(regions(traces[dec])["_fwd_grouped_kernel_stage1"]) == 2 * 2
    # 0.5.2 names a stage by str() of its IntEnum
    traces = profile(engine, ins, (0, 5, 2), {"num_steps": 1, "profile_by_stage": True},
                     lambda e: e.generate(list(b"hi"), dict(GREEDY, max_new_tokens=3)), tmp_path / "c")
    assert sorted(n.split("-TP-0")[1] for n in traces) == ["-%s.trace.json.gz" % str(m) for m in ins.ForwardMode]


def record(engine, ins, mode, prompt, new_tokens, tp_size=1, buffer_size=None, behavior=None):
    """Record one greedy request on a MoE Engine; (engine, recorder, passes)."""
    e = engine.Engine(0, behavior or {}, moe=True, tp_size=tp_size)
    e.recorder = rec = ins.ExpertRecorder((0, 5, 23), mode, buffer_size, engine.LAYERS, engine.EXPERTS, tp_size)
    e.on_scheduler(rec.start)
    before = e.forward_ct
    e.generate(prompt, dict(GREEDY, max_new_tokens=new_tokens))
    e.on_scheduler(rec.stop)
    return e, rec, e.forward_ct - before


def test_expert_counts_and_dumps(mods, tmp_path, monkeypatch):
    import torch
    engine, ins, _ = mods
    monkeypatch.setenv("SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR", str(tmp_path / "made"))
    prompt, new = list(b"expert counts"), 6
    tokens = len(prompt) + new - 1  # the prefill's tokens and one per decode pass
    e, rec, passes = record(engine, ins, "stat", prompt, new)
    [path] = e.on_scheduler(rec.dump)
    assert re.fullmatch(r"expert_distribution_recorder_\d+\.\d+\.pt", os.path.basename(path))
    d = torch.load(path, weights_only=True)
    assert set(d) == {"rank", "logical_count", "average_utilization_rate_over_window"} and d["rank"] == 0
    lc = d["logical_count"]
    assert lc.dtype == torch.int32 and lc.shape == (1000, engine.LAYERS, engine.EXPERTS)
    assert lc.sum(dim=(0, 2)).tolist() == [tokens * engine.TOPK] * engine.LAYERS
    assert int((lc.sum(dim=(1, 2)) > 0).sum()) == passes == new
    assert rec.passes == [] and rec.ring is None  # a dump resets the record
    # TP 2: each rank routed every token, the ranks' counts summed; an unbounded buffer: the passes only
    e, rec, _ = record(engine, ins, "stat", prompt, new, tp_size=2, buffer_size=-1)
    lc = torch.load(e.on_scheduler(rec.dump)[0], weights_only=True)["logical_count"]
    assert lc.shape[0] == new and int(lc.sum()) == 2 * tokens * engine.TOPK * engine.LAYERS
    # per_pass: a file per rank, a record per pass
    e, rec, passes = record(engine, ins, "per_pass", prompt, new, tp_size=2)
    paths = e.on_scheduler(rec.dump)
    assert [p.rsplit("_", 1)[1] for p in paths] == ["0.pt", "1.pt"]
    d = torch.load(paths[1], weights_only=True)
    assert d["last_physical_to_logical_map"].tolist() == [list(range(engine.EXPERTS))] * engine.LAYERS
    assert len(d["records"]) == passes and {r["rank"] for r in d["records"]} == {1}
    assert set(d["records"][0]) == {"forward_pass_id", "rank", "gatherer_key", "global_physical_count"}
    assert sum(int(r["global_physical_count"].sum()) for r in d["records"]) == tokens * engine.TOPK * engine.LAYERS
    # 0.4.6.post5's stat dump has no utilization key
    old = ins.ExpertRecorder((0, 4, 6), "stat", None, engine.LAYERS, engine.EXPERTS)
    old.start()
    assert set(torch.load(old.dump(str(tmp_path / "old"))[0], weights_only=True)) == {"rank", "logical_count"}


def test_a_hot_expert_dominates_its_layer(mods):
    engine, ins, _ = mods
    prompt = list(b"which expert takes the tokens")
    tokens = len(prompt) + 3

    def per_pass(behavior):
        return [c for _, c in record(engine, ins, "per_pass", prompt, 4, behavior=behavior)[1].passes]

    healthy_passes, hot_passes = per_pass({}), per_pass({"hot_expert": {"layer": 1, "expert": 5}})
    healthy, hot = sum(healthy_passes), sum(hot_passes)
    assert int(hot[1, 5]) == tokens  # in every token's top-2
    assert int(hot[1].argmax()) == 5 and int(hot[1, 5]) > 2 * max(int(hot[1, i]) for i in range(8) if i != 5)
    assert int(healthy[1, 5]) < 0.35 * tokens
    assert hot_passes[0][0].tolist() == healthy_passes[0][0].tolist()  # the prefill's layer 0: before the fault

    # SGLang's balancedness (mean / max of the per-rank sums, EP 2: experts 0-3 and 4-7) drops
    def balancedness(c):
        per_rank = c.reshape(engine.LAYERS, 2, -1).sum(-1).float()
        return (per_rank.mean(-1) / per_rank.max(-1).values).tolist()
    assert balancedness(hot)[1] < balancedness(healthy)[1] - 0.1


def test_slow_attention_raises_attention_share(mods, tmp_path):
    import statistics
    engine, ins, _ = mods
    attention = set(engine.KERNELS["attention_decode"][:1] + engine.KERNELS["attention_extend"])

    def regions_of(behavior, d):
        traces = profile(engine, ins, (0, 5, 23), {"num_steps": 4}, lambda e: e.generate(
            list(b"slow"), dict(GREEDY, max_new_tokens=5)), d, moe=True, behavior=behavior)
        got = regions(next(iter(traces.values())))
        share = sum(sum(v) for n, v in got.items() if n in attention) / sum(sum(v) for v in got.values())
        return [d for n, v in got.items() if n in attention for d in v], share

    healthy, healthy_share = regions_of({}, tmp_path / "h")
    slow, slow_share = regions_of({"slow_attention_ms": 50}, tmp_path / "s")
    assert len(slow) == len(healthy) == 4 * engine.LAYERS  # 1 prefill + 3 decode passes, 2 layers
    assert min(slow) >= 50_000 > 2 * statistics.median(healthy)  # microseconds: the sleep is inside the kernel
    assert slow_share > 0.85 and slow_share > healthy_share + 0.1, (healthy_share, slow_share)


def test_avg_spec_accept_length_is_folded_every_decode_log_interval(mods):
    engine, _, _ = mods
    e = engine.Engine(0, {}, draft_tokens=4, algorithm="STANDALONE")  # its drafts are accepted
    taken = verifies = 0
    while e.spec_total_fwd == 0:
        assert e.avg_spec_accept_length() is None
        _, _, info = e.generate(list(b"hello world, hello world, "), dict(GREEDY, max_new_tokens=24))
        taken += info["spec_num_correct_drafts"] + info["spec_verify_ct"]
        verifies += info["spec_verify_ct"]
    assert e.spec_total_fwd == engine.DECODE_LOG_INTERVAL
    assert e.spec_total_fwd + e.spec_fwd == verifies and e.spec_total_accept + e.spec_accept == taken
    assert 1.0 < e.avg_spec_accept_length() == e.spec_total_accept / engine.DECODE_LOG_INTERVAL <= 4


def call(port, path, body=None, method="POST", timeout=60):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request("http://127.0.0.1:%d%s" % (port, path), data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def serve(tmp_path, release, *args, env=None):
    """A stand-in server speaking `release`, started with `args`; (process, port)."""
    port = free_port()
    (tmp_path / "b.json").write_text("{}")
    p = subprocess.Popen([sys.executable, str(standin.SERVER), "--port", str(port), "--behavior",
                          str(tmp_path / "b.json"), *args], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=open(tmp_path / "server.log", "ab"),
                         env=dict(os.environ, FLEETCTL_STANDIN_SGLANG=release, **(env or {})))
    assert wait_healthy("http://127.0.0.1:%d" % port, 60)[0], (tmp_path / "server.log").read_text()
    return p, port


def test_routes_over_http_and_the_server_dying_where_sglang_does(tmp_path):
    bad = tmp_path / "a-file"
    bad.write_text("")
    p, port = serve(tmp_path, "0.5.23", "--model-path", "fleetctl-standin/tiny-moe",
                    "--expert-distribution-recorder-mode", "stat",
                    env={"SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR": str(bad / "sub")})
    try:
        info = json.loads(call(port, "/server_info", method="GET")[1])
        assert info["expert_distribution_recorder_mode"] == "stat" and info["ep_size"] == 1
        assert info["expert_distribution_recorder_buffer_size"] == 1000
        assert info["internal_states"][0]["memory_usage"]["token_capacity"] == info["max_total_num_tokens"]
        assert call(port, "/stop_profile") == (500, "Internal Server Error")  # none running
        assert call(port, "/start_profile", {"num_steps": "x"})[0] == 400
        assert call(port, "/start_profile", {"activities": ["MEM"]})[0] == 400
        assert call(port, "/start_expert_distribution_record", method="GET") == \
            (200, "Start recording the expert distribution.\n")
        gen = {"input_ids": [1, 2], "sampling_params": dict(GREEDY, max_new_tokens=2)}
        assert call(port, "/generate", gen)[0] == 200
        assert call(port, "/stop_expert_distribution_record") == (200, "Stop recording the expert distribution.\n")
        # the dump directory cannot be made: SGLang's scheduler raises, the server exits unanswered
        with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
            call(port, "/dump_expert_distribution_record", timeout=30)
        assert p.wait(timeout=30) == 1
        assert "Scheduler hit an exception" in (tmp_path / "server.log").read_text()
    finally:
        p.kill()
        p.wait()


def test_old_release_start_waits_for_its_steps(mods, tmp_path, monkeypatch):
    """0.4.6.post5 answers a start with num_steps only once the profile has stopped (in process: a
    StandIn's instrument(), as the HTTP handler calls it); and its recorder, no mode set, raises
    what ends SGLang's scheduler."""
    server = mods[2]
    monkeypatch.setenv("FLEETCTL_STANDIN_SGLANG", "0.4.6.post5")
    st = server.StandIn(server.parse_args(["--behavior", str(tmp_path / "none.json")]), {})
    st.load()
    st.engine.crash_types = ()  # raised here, not the process ended
    assert st.args.release == (0, 4, 6)
    body = {"output_dir": str(tmp_path / "prof"), "with_stack": False}
    with pytest.raises(server.SchedulerCrash):  # 0.4.6.post5 does not make output_dir: the export fails
        st.instrument("/start_profile", body), st.instrument("/stop_profile", None)
    (tmp_path / "prof").mkdir()
    assert st.instrument("/start_profile", body) == (200, "Start profiling.\n")  # no num_steps: at once
    assert st.instrument("/stop_profile", None) == (200, "Stop profiling. This will take some time.\n")
    [trace] = os.listdir(tmp_path / "prof")
    assert re.fullmatch(r"\d+\.\d+-TP-0\.trace\.json\.gz", trace)
    answer = []
    t = threading.Thread(target=lambda: answer.append(st.instrument("/start_profile", dict(body, num_steps=2))))
    t.start()
    time.sleep(0.5)
    assert not answer and t.is_alive()  # with num_steps: answered once the profile has stopped
    st.engine.generate([1, 2], dict(GREEDY, max_new_tokens=3))
    t.join(60)
    assert answer == [(200, "Start profiling.\n")] and len(os.listdir(tmp_path / "prof")) == 2
    with pytest.raises(server.SchedulerCrash, match="Please set ServerArgs.expert_distribution_recorder_mode"):
        st.instrument("/start_expert_distribution_record", None)


def test_the_lab_faults_write_behaviours_the_server_takes(mods, tmp_path):
    from fleetctl.errors import UsageError
    from fleetctl.lab import faults
    server = mods[2]
    assert {k for k, _ in faults.BEHAVIOURS.values() if k} <= server.BEHAVIOR_KEYS
    what = faults.BEHAVIOURS["hot-expert"][1]
    hot = faults._hot_expert("hot-expert", "1:7", what)
    assert hot == {"layer": 1, "expert": 7} and faults._hot_expert("hot-expert", "off", what) is None
    for bad in ("2:0", "0:8", "1", "a:b", None):
        with pytest.raises(UsageError):
            faults._hot_expert("hot-expert", bad, what)
    f = tmp_path / "behavior.json"
    f.write_text(json.dumps({"hot_expert": hot, "slow_attention_ms": 5}))
    assert server.load_behavior(str(f))["hot_expert"] == hot
    for bad in ({"layer": 2, "expert": 0}, {"layer": 0}, {"layer": "0", "expert": 1}):
        f.write_text(json.dumps({"hot_expert": bad}))
        with pytest.raises(ValueError):
            server.load_behavior(str(f))
