"""`fleetctl diagnose`'s pure parts: the trace breakdown (a trace the real torch profiler writes
here with record_function regions, and a hand-written GPU-shaped trace with kernel events), each
checked by an independent computation; the kernel-class table against the releases' own
sources; the expert balance against SGLang's formula computed with torch; the dump read back as
hostile data (torch.load weights_only, no links); the verdict rules; the fleet roll-up."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import zipfile

import pytest

from fleetctl.engine.diagnose import group_key, groups, waves
from fleetctl.engine.diagnose import verdict as vd
from fleetctl.probes.diagnose import child, experts, kernels, trace
from fleetctl.wheels import ensure_wheel

torch = pytest.importorskip("torch")

# ---- the trace: the real profiler --------------------------------------------------------------

# (name, class, ms): one decode step's regions, named as the releases name the kernels
STEP = (("_fwd_kernel_stage1", kernels.DECODE, 6), ("fused_moe_kernel", kernels.MOE_EXPERTS, 4),
        ("moe_align_block_size_kernel", kernels.MOE_ROUTING, 1), ("nvjet_tst_128x64", kernels.GEMM, 3),
        ("cross_device_reduce_1stage", kernels.COMM, 2), ("mystery_op", kernels.UNKNOWN, 2))


PROFILE = """
import json, sys, time
import torch
from torch.profiler import ProfilerActivity, profile, record_function

path, step = sys.argv[1], json.loads(sys.argv[2])


def busy(ms):
    end = time.perf_counter() + ms / 1000
    while time.perf_counter() < end:
        pass


x, w = torch.randn(256, 512), torch.randn(512, 512)
with profile(activities=[ProfilerActivity.CPU]) as p:
    for _ in range(3):
        with record_function("decode_step"):
            for name, ms in step:
                with record_function(name):
                    busy(ms)
                    torch.nn.functional.linear(x, w)  # inside a region: the region's
                busy(1)
        for _ in range(4):
            torch.nn.functional.linear(x, w)  # outside every region: a dense GEMM
p.export_chrome_trace(path)
"""


@pytest.fixture(scope="module")
def profiled(tmp_path_factory) -> dict:
    """A chrome trace the torch profiler exports, of 3 steps: each an outer region "decode_step"
    (no kernel's name) holding STEP's regions, 1 ms of plain host work between regions. Made in
    a fresh interpreter: torch._dynamo (which the profiler imports) cannot load in a process
    where ansible's module_utils replaced sys.intern (other unit tests import it)."""
    path = tmp_path_factory.mktemp("trace") / "t.trace.json"
    subprocess.run([sys.executable, "-c", PROFILE, str(path), json.dumps([(n, ms) for n, _, ms in STEP])],
                   check=True, timeout=300)
    return json.loads(path.read_text())


def innermost_sampling(events: list[tuple], step_us: float = 5.0) -> dict[str, float]:
    """Independent of trace.exclusive: sample time every `step_us`, give each sample to the
    shortest region covering it. Returns {name: us}."""
    lo = min(ts for _, ts, _ in events)
    hi = max(ts + d for _, ts, d in events)
    out: dict[str, float] = {}
    t = lo + step_us / 2
    while t < hi:
        cover = [(d, n) for n, ts, d in events if ts <= t < ts + d]
        if cover:
            n = min(cover)[1]
            out[n] = out.get(n, 0.0) + step_us
        t += step_us
    return out


def sweep_gaps(events: list[tuple]) -> float:
    """Independent of trace's merge: the time inside [first start, last end] covered by no event,
    by a sweep over the boundaries counting open events."""
    points = sorted([(ts, 1) for _, ts, _ in events] + [(ts + d, -1) for _, ts, d in events], key=lambda x: (x[0], -x[1]))
    open_, last, gap = 0, None, 0.0
    for t, delta in points:
        if open_ == 0 and last is not None:
            gap += t - last
        open_ += delta
        last = t if open_ == 0 else None
    return gap


def test_a_real_profiler_trace_uses_the_regions_and_agrees_with_sampling(profiled):
    raw = [(e["name"], e["ts"], e["dur"]) for e in profiled["traceEvents"]
           if e.get("ph") == "X" and e.get("cat") == "user_annotation"]
    regions = [(ts, ts + d) for _, ts, d in raw]
    linear = [(e["name"], e["ts"], e["dur"]) for e in profiled["traceEvents"]
              if e.get("ph") == "X" and e.get("name") == "aten::linear"]
    outside = [ev for ev in linear if not any(a <= ev[1] and ev[1] + ev[2] <= b for a, b in regions)]
    assert len(linear) == 3 * (len(STEP) + 4) and len(outside) == 3 * 4
    b = trace.breakdown(profiled, "0.5.23")
    assert b["source"] == "annotation" and b["events"] == len(raw) + len(outside) == 3 * (len(STEP) + 1 + 4)
    sampled = innermost_sampling(raw + outside)
    by_class = dict.fromkeys(kernels.CLASSES, 0.0)
    for name, us in sampled.items():
        by_class[{n: c for n, c, _ in STEP}.get(name, kernels.GEMM if name == "aten::linear" else kernels.UNKNOWN)] += us
    for cls, us in by_class.items():
        assert b["classes"][cls] == pytest.approx(us, abs=60), cls
    # the outer region's own time is the host work between its regions: unknown, never guessed
    own = dict((n, t) for n, t in b["unknown"])
    assert own["decode_step"] == pytest.approx(sampled["decode_step"], abs=60) and own["decode_step"] > 3 * 5000 * 0.9
    assert b["shares"][kernels.DECODE] == pytest.approx(b["classes"][kernels.DECODE] / b["device_us"])
    assert b["classes"][kernels.GEMM] > 0
    # the gaps: between the steps' regions and the GEMMs after them, the profiler's own
    assert b["host_wait_us"] == pytest.approx(sweep_gaps(raw + outside), abs=1)


def test_the_speculative_decode_steps_count_extend_as_target_verify(profiled):
    doc = {"traceEvents": [{"ph": "X", "cat": "user_annotation", "name": "_fwd_kernel", "ts": 0, "dur": 10, "pid": 1,
                            "tid": 1}]}
    assert trace.breakdown(doc, "0.5.23")["classes"][kernels.EXTEND] == 10
    assert trace.breakdown(doc, "0.5.23", speculative=True)["classes"][kernels.VERIFY] == 10


# ---- the trace: a GPU-shaped one ---------------------------------------------------------------

def gpu_trace() -> dict:
    """Kernels on two streams of device 0, a CPU op and an annotation (both ignored: the trace has
    kernels), a hostile event or two (no name, negative duration, NaN)."""
    k = lambda name, ts, dur, tid=7: {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "pid": 0,  # noqa: E731
                                      "tid": tid, "args": {"stream": tid}}
    return {"traceEvents": [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5000, "pid": 100, "tid": 100},
        {"ph": "X", "cat": "user_annotation", "name": "fused_moe_kernel", "ts": 0, "dur": 5000, "pid": 100, "tid": 100},
        k("BatchDecodeWithPagedKVCacheKernel<128>", 100, 300),
        k("fused_moe_kernel_0d1d2d", 420, 200),        # gap 20 us: host wait
        k("sm90_xmma_gemm_bf16bf16_bf16f32", 620, 100),
        k("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 650, 150, tid=13),  # overlaps the gemm on stream 13
        k("void at::native::vectorized_elementwise_kernel<4>", 800, 50),
        k("TopKTopPSamplingFromProbKernel", 900, 40),  # gap 50 us
        k("unheard_of_kernel", 30000, 60),             # gap 29060 us: idle, not host wait
        {"ph": "X", "cat": "kernel", "ts": 1, "dur": 1},
        {"ph": "X", "cat": "kernel", "name": "neg", "ts": 1, "dur": -5},
        {"ph": "X", "cat": "kernel", "name": "nan", "ts": float("nan"), "dur": 5},
    ]}


def test_a_gpu_trace_uses_its_kernels_with_exact_figures():
    b = trace.breakdown(gpu_trace(), "0.5.2")
    assert b["source"] == "kernel" and b["events"] == 7
    want = {kernels.DECODE: 300, kernels.MOE_EXPERTS: 200, kernels.GEMM: 100, kernels.COMM: 150, kernels.OTHER: 50,
            kernels.SAMPLING: 40, kernels.UNKNOWN: 60}
    assert {c: t for c, t in b["classes"].items() if t} == want
    assert b["device_us"] == sum(want.values())
    # independent: union of [100,400] [420,800] [800,850] [900,940] [30000,30060]
    assert b["busy_us"] == 300 + 380 + 50 + 40 + 60
    assert b["host_wait_us"] == 20 + 50 and b["idle_us"] == 30000 - 940
    assert b["host_wait_share"] == pytest.approx(70 / (830 + 70))
    assert b["unknown"] == [["unheard_of_kernel", 60]]


def test_a_trace_that_is_no_trace_gives_no_device_time():
    for doc in ({}, [], {"traceEvents": "x"}, {"traceEvents": [1, "a", None]}):
        b = trace.breakdown(doc)
        assert b["device_us"] == 0 and all(v == 0 for v in b["shares"].values())


# ---- the kernel-class table against the releases ---------------------------------------------

TRITON = {"_fwd_kernel": kernels.EXTEND, "_fwd_kernel_stage1": kernels.DECODE, "_fwd_grouped_kernel_stage1": kernels.DECODE,
          "_fwd_kernel_stage2": kernels.DECODE, "fused_moe_kernel": kernels.MOE_EXPERTS}


@pytest.mark.parametrize("version", ["0.5.2", "0.5.10", "0.5.23"])
def test_each_triton_rule_names_a_kernel_defined_at_the_cited_line(version):
    label, rules = kernels.table(version)
    cited = 0
    with zipfile.ZipFile(ensure_wheel(version)) as z:
        for cls, pattern, source in rules:
            m = re.match(r"((?:srt|kernels)/\S+\.py):([\d,]+) \(([^)]+)\)$", source)
            if not m or version not in m.group(3):
                continue
            text = z.read("sglang/" + m.group(1)).decode().splitlines()
            for line in m.group(2).split(","):
                d = re.match(r"def (\w+)\(", text[int(line) - 1])
                assert d, (version, source, line)
                assert re.search(pattern, d.group(1)) and TRITON[d.group(1)] == cls, (d.group(1), cls)
                assert kernels.classify(d.group(1), rules) == cls
                cited += 1
    assert cited == 5, (version, label)


def test_classes_of_library_names_and_the_unknown():
    _, rules = kernels.table("0.5.23")
    for name, cls in (("ncclDevKernel_AllReduce_Sum_f16_RING_LL", kernels.COMM),
                      ("BatchPrefillWithPagedKVCacheKernel", kernels.EXTEND),
                      ("topkGatingSoftmax<8>", kernels.MOE_ROUTING), ("nvjet_hsh_64x8", kernels.GEMM),
                      ("_verify_fwd", kernels.VERIFY), ("hello", kernels.UNKNOWN)):
        assert kernels.classify(name, rules) == cls, name
    assert kernels.table("0.4.6.post5")[0] == "0.4.6..0.5.9" and kernels.table("0.6.0")[0] == "0.5.23.."


# ---- the expert balance -----------------------------------------------------------------------

def sglang_balancedness(count: "torch.Tensor", ep: int) -> "torch.Tensor":
    """compute_gpu_physical_count + compute_utilization_rate of 0.5.23
    srt/eplb/expert_distribution.py:1140-1168, on the steps' sum, written with torch."""
    total = count.sum(0).float()
    gpu = total.reshape(total.shape[0], ep, -1).sum(-1)
    return (gpu.mean(-1) + 1e-5) / (gpu.amax(-1) + 1e-5)


def test_balance_agrees_with_sglangs_formula_and_finds_the_hot_gpu_and_layer():
    g = torch.Generator().manual_seed(3)
    count = torch.randint(0, 50, (5, 4, 16), generator=g)
    count[:, 2, 13] += 400  # layer 2, expert 13: GPU 3 of 4
    b = experts.balance(count.tolist(), 4)
    want = sglang_balancedness(count, 4)
    for layer in b["layers"]:
        assert layer["balancedness"] == pytest.approx(float(want[layer["layer"]]), rel=1e-6)
    assert (b["worst"]["layer"], b["worst"]["hot_gpu"], b["worst"]["hot_expert"]) == (2, 3, 13)
    with pytest.raises(ValueError):
        experts.balance(count.tolist(), 3)
    with pytest.raises(ValueError):
        experts.balance([[[1, "x"]]], 1)


def test_the_dump_is_read_with_weights_only_and_never_through_a_link(tmp_path):
    count = torch.zeros(2, 3, 8, dtype=torch.int32)
    count[:, 1, 0] = 9
    since = time.time()
    torch.save({"rank": 0, "logical_count": count, "average_utilization_rate_over_window": None},
               tmp_path / f"expert_distribution_recorder_{since}.pt")
    b, names = child.read_dump(str(tmp_path), since, 2)
    assert (b["worst"]["layer"], b["worst"]["hot_gpu"]) == (1, 0)
    from fleetctl.probes.diagnose import run
    assert run.remove_dumps(str(tmp_path), names + ["../etc/passwd"], os.geteuid()) == names[-1]
    assert not list(tmp_path.iterdir())

    class Evil:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    torch.save({"logical_count": Evil()}, tmp_path / f"expert_distribution_recorder_{time.time()}.pt")
    with pytest.raises(Exception, match="[Ww]eights only"):
        child.read_dump(str(tmp_path), since, 2)
    assert not (tmp_path / "pwned").exists()
    for f in tmp_path.iterdir():
        f.unlink()
    target = tmp_path / "real.pt"
    torch.save({"logical_count": count}, target)
    os.symlink(target, tmp_path / f"expert_distribution_recorder_{time.time()}.pt")
    with pytest.raises(ValueError, match="no expert distribution dump"):
        child.read_dump(str(tmp_path), since, 2)


def test_the_trace_file_is_read_bounded_rank_0s_first(tmp_path, monkeypatch):
    import gzip

    doc = gpu_trace()
    (tmp_path / "p-TP-1.trace.json.gz").write_bytes(gzip.compress(json.dumps({"traceEvents": []}).encode()))
    (tmp_path / "p-TP-0.trace.json.gz").write_bytes(gzip.compress(json.dumps(doc).encode()))
    b, name = child.read_trace(str(tmp_path), "0.5.23", False)
    assert name == "p-TP-0.trace.json.gz" and b["device_us"] == 900
    monkeypatch.setattr(child, "MAX_JSON", 100)
    with pytest.raises(ValueError, match="decompressed"):
        child.read_trace(str(tmp_path), "0.5.23", False)
    for f in tmp_path.iterdir():
        f.unlink()
    os.symlink("/etc/hostname", tmp_path / "x.trace.json")
    with pytest.raises(ValueError, match="no trace"):
        child.read_trace(str(tmp_path), "0.5.23", False)


# ---- verdicts and the roll-up ----------------------------------------------------------------

def entry(shares: dict, host_wait: float = 0.05, worst: dict | None = None, page_size: int = 1) -> dict:
    full = dict.fromkeys(kernels.CLASSES, 0.0)
    full.update(shares)
    return {"host": "127.0.0.1", "port": 30000, "server_info": {"page_size": page_size},
            "trace": {"device_us": 1000.0, "shares": full, "host_wait_share": host_wait, "source": "kernel"},
            "experts": {"worst": worst} if worst else None}


HOT = {"layer": 2, "hot_gpu": 3, "hot_gpu_share": 0.7, "balancedness": 0.36}


def test_each_verdict_from_its_figures():
    assert vd.judge(entry({kernels.MOE_EXPERTS: 0.4, kernels.GEMM: 0.6}, worst=HOT))["verdict"] == vd.MOE
    v = vd.judge(entry({kernels.MOE_EXPERTS: 0.4, kernels.GEMM: 0.6}, worst=HOT))
    assert v["figures"]["worst_layer"] == 2 and v["figures"]["worst_gpu"] == 3 and "--enable-eplb" in v["action"]
    # balanced, or MoE too small a share: no MoE verdict
    assert vd.judge(entry({kernels.MOE_EXPERTS: 0.1, kernels.GEMM: 0.9}, worst=HOT))["verdict"] == vd.NONE
    v = vd.judge(entry({kernels.VERIFY: 0.7, kernels.GEMM: 0.3}))
    assert v["verdict"] == vd.ATTENTION and "deploy kernel" in v["action"]
    v = vd.judge(entry({kernels.DECODE: 0.7, kernels.GEMM: 0.3}))
    assert v["verdict"] == vd.ATTENTION and v["action"].startswith(vd.NOT_FLEETCTL)
    runs = [{"kind": "token", "need_sort": False, "runs_per_alloc_mean": 3.0},
            {"kind": "token", "need_sort": True, "runs_per_alloc_mean": 1.1}]
    v = vd.judge(entry({kernels.GEMM: 1.0}), runs)
    assert v["verdict"] == vd.DEFRAG and v["action"] == "fleetctl apply defrag-tier0"
    assert vd.judge(entry({kernels.GEMM: 1.0}, page_size=16), runs)["verdict"] == vd.NONE  # no paged pair
    runs[1]["runs_per_alloc_mean"] = 2.5  # sorting gains 1.2x: under pressure, not worth it
    assert vd.judge(entry({kernels.GEMM: 1.0}), runs)["verdict"] == vd.NONE
    assert vd.judge(entry({kernels.GEMM: 1.0}, host_wait=0.5))["verdict"] == vd.HOST
    cpu = entry({kernels.GEMM: 1.0}, host_wait=0.5)
    cpu["trace"]["source"] = "annotation"  # a CPU trace: no device to wait
    assert vd.judge(cpu)["verdict"] == vd.NONE
    assert vd.judge(entry({kernels.GEMM: 1.0}))["verdict"] == vd.NONE
    assert vd.judge({"trace": None, "trace_error": "no trace"}) == {"verdict": vd.UNMEASURED, "why": "no trace",
                                                                      "action": None, "figures": {}}


def test_identical_servers_are_measured_one_at_a_time_different_ones_side_by_side():
    """Issue 56: one server of a group of identical ones at a time (the rest keep serving)."""
    def server(pid, model="m", tp=2, port=30000):
        return {"pid": pid, "model_path": model, "tp_size": tp, "pp_size": 1, "dp_size": 1, "nnodes": 1,
                "kind": "sglang", "pd": None, "port": port}
    inst = {"sglang": {"version": "0.5.23"}}
    a, b = group_key(server(1), inst), group_key(server(2, port=30001), inst)
    assert a == b  # the port is not what makes servers different
    assert group_key(server(3, tp=4), inst) != a
    assert group_key(server(4, model="other"), inst) != a
    assert group_key(server(5), {"sglang": {"version": "0.5.10"}}) != a
    other = group_key(server(6, model="other"), inst)
    plan = [("h1", [(a, "h1-s1"), (other, "h1-s2")]), ("h2", [(a, "h2-s1")]), ("h3", [(a, "h3-s1"), (a, "h3-s2")])]
    got = waves(plan)
    assert got == [{"h1": ["h1-s1", "h1-s2"]}, {"h2": ["h2-s1"]}, {"h3": ["h3-s1"]}, {"h3": ["h3-s2"]}]
    for wave in got:  # never two members of one group in a wave
        keys = [k for h, members in plan for k, sel in members if sel in sum(wave.values(), [])]
        assert keys.count(a) <= 1
    assert waves([("h1", [(a, "x")]), ("h2", [(other, "y")])]) == [{"h1": ["x"], "h2": ["y"]}]
    assert waves([]) == []


def test_the_roll_up_groups_servers_by_verdict():
    a = entry({kernels.GEMM: 1.0})
    b = dict(entry({kernels.VERIFY: 0.8, kernels.GEMM: 0.2}), port=30001)
    c = entry({kernels.GEMM: 0.5, kernels.OTHER: 0.5})
    for s in (a, b, c):
        s["verdict"] = vd.judge(s)
    out = groups([{"host": "h1", "servers": [a, b]}, {"host": "h2", "servers": [c]}])
    assert [(g["verdict"], g["servers"]) for g in out] == [
        (vd.NONE, ["h1 127.0.0.1:30000", "h2 127.0.0.1:30000"]), (vd.ATTENTION, ["h1 127.0.0.1:30001"])]
    assert out[0]["shares"][kernels.GEMM] == pytest.approx(0.75)


# ---- the HTML report ---------------------------------------------------------------------------

def test_the_html_report_shows_the_last_diagnosis_and_a_stacked_bar_per_group():
    import dataclasses

    from fleetctl.history.model import HostRecord
    from fleetctl.report import html as report_html
    from fleetctl.report import svg
    from report_runs import recorded_runs

    runs = recorded_runs()
    base = runs[-1]
    hostile = "<script>alert(1)</script>\x1b[31m"
    hot = entry({kernels.MOE_EXPERTS: 0.5, kernels.GEMM: 0.5}, worst=HOT)
    slow = dict(entry({kernels.DECODE: 0.8, kernels.GEMM: 0.2}, host_wait=0.1), port=30001)
    for s in (hot, slow):
        s["verdict"] = vd.judge(s)
    slow["verdict"]["why"] += hostile
    run = dataclasses.replace(base, run_id="diag-1", command="diagnose", argv=["fleetctl", "diagnose", "all"],
                              started_at=base.started_at + 60, ended_at=base.started_at + 90, exit_code=0,
                              hosts=[HostRecord("lab-01", "10.213.33.11", "ok", None, 3.0,
                                                {"host": "lab-01", "status": "ok", "servers": [hot, slow]})])
    cells = {h: c for h, c, _ in report_html.overview(runs + [run])}["lab-01"]
    diag = cells[[c[0] for c in report_html.COLUMNS].index("last diagnosis")]
    assert diag.run_id == "diag-1"
    assert diag.lines[0].startswith(":30000 moe-imbalance: layer 2: GPU 3 takes 70%") and "--enable-eplb" in diag.lines[0]
    assert diag.lines[1].startswith(":30001 attention: attention 80%")
    html = report_html.render(runs + [run], NOW, None, "/x/history.sqlite")
    assert "<script>alert" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    bars = re.findall(r'<rect [^>]*class="point seg-(\d+)"[^>]*data-verdict="([^"]+)" data-class="([^"]+)" '
                      r'data-share="([0-9.]+)"', html)
    by_group = {}
    for _, verdict, cls, share in bars:
        by_group.setdefault(verdict, {})[cls] = float(share)
    assert set(by_group) == {vd.MOE, vd.ATTENTION}
    assert by_group[vd.MOE] == {kernels.MOE_EXPERTS: pytest.approx(0.5 * 0.95), kernels.GEMM: pytest.approx(0.5 * 0.95),
                                "host_wait": pytest.approx(0.05)}
    assert sum(by_group[vd.ATTENTION].values()) == pytest.approx(1.0)
    assert svg.diagnose_bars([]).count("class=\"point") == 0


NOW = 1796190000.0
