"""bench/gpu_check.sh end to end on this CPU machine (--cpu): the same script a GPU machine runs, with the
CPU backend as the new kernel, the smallest shapes and SGLang 0.5.23's carried Triton kernels
(extend_attention_fwd, verify_splitkv_fwd) under TRITON_INTERPRET=1: every stage's code path (0-6;
ncu skipped with its reason), then a `--stage speed` rerun of a copy of its output, and the pure
pieces (roofline, goal, ncu's shape pick, stage names) on hand-made figures.

One full run (module fixture, ~20 s; the build is the test run's one CPU build, conftest's
`cpu_kernel`, passed as --build-dir). Needs triton 3.6.0 (the `test` extra) for the interpreter.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.sh"
SGLANG_SHA256 = {"extend_attention.py": "be3baffc80ef9fe484d0b896842522b02bf671785088e05a66ca4dcdb2e8a9b3",
                 "verify_splitkv.py": "0c2c4009b3553e13bcc4ae1e0e375aa5c96c48e6c96ab9a475a3e2d874c3c6c6"}
IMPORTS_REPLACED = {"extend_attention.py": 4, "verify_splitkv.py": 1}
SHAPE_FIELDS = ("kv_bytes", "flops", "TG", "floor_ms", "ms_kernel", "frac_of_floor", "gbps", "tflops", "goal_ms",
                "goal", "bound", "by_backend", "agree", "correct")
BASELINE_FIELDS = ("ms_kernel", "ms_triton", "ms_sdpa", "ms_kernel_chain", "ms_splitkv", "speedup_vs_triton",
                   "speedup_vs_splitkv", "goal_vs_triton", "goal_vs_splitkv")
sys.path.insert(0, str(ROOT / "bench" / "gpu_check"))


def run_check(out: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), "--cpu", "--out", str(out), *args], capture_output=True, text=True,
                          timeout=900, cwd=ROOT)


def why(out: Path, r: subprocess.CompletedProcess) -> str:
    """A failed run's story: each failed stage's error and failing cases, then the output's tail."""
    lines = []
    try:
        doc = json.loads((out / "gpu_check.json").read_text())
    except (OSError, ValueError) as e:
        doc = {"stages": {}}
        lines.append(f"no JSON: {e}")
    for n, s in doc["stages"].items():
        if s.get("status") in ("failed", "running", "incomplete"):
            bad = [c for c in (s.get("grid") or {}).get("results", []) if not c["ok"]]
            base = s.get("baselines") or {}
            bad += [c for c in base.get("triton", []) + base.get("sdpa", []) if not c["ok"]]
            lines.append(f"stage {n}: {s.get('status')} {s.get('error', '')} failing: {bad[:5]} "
                         f"negative control: {base.get('negative_control')}")
    return "\n".join(lines) + "\n" + r.stdout[-3000:] + r.stderr[-3000:]


@pytest.fixture(scope="module")
def build_dir(cpu_kernel, tmp_path_factory) -> str:
    """A copy of the run's one CPU build (conftest's `cpu_kernel`; times kept, so ninja finds it up
    to date): the script writes its own build log and result there, the original stays as the
    kbuild tests read it."""
    copy = tmp_path_factory.mktemp("gpu_check_build") / "build"
    shutil.copytree(Path(cpu_kernel[3]["module_path"]).parent, copy, symlinks=True)
    return str(copy)


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, build_dir):
    """(OUT dir, its JSON document, the completed process) of one run of every stage."""
    out = tmp_path_factory.mktemp("gpu_check_out")
    r = run_check(out, "--build-dir", build_dir)
    assert r.returncode == 0, why(out, r)
    return out, json.loads((out / "gpu_check.json").read_text()), r


def test_json_has_the_issue_fields(full_run):
    out, doc, _ = full_run
    assert doc["schema"] == "fleetctl-gpu-check/2" and doc["mode"] == "cpu"
    assert doc["device_name"].startswith("cpu: ")
    assert doc["clocks"] == {"skipped": "no nvidia-smi on this machine"} or "Clocks" in doc["clocks"]
    v = doc["versions"]
    assert v["torch"] and v["triton"] == "3.6.0" and v["python"] and v["runtime"]
    assert doc["backend"] == "cpu" and doc["beside"] == [] and doc["backend_errors"] == {}
    for name, sha in SGLANG_SHA256.items():
        c = doc["carried"][name]
        assert c["sha256"] == sha and c["matches"] is True and c["import_lines_replaced"] == IMPORTS_REPLACED[name]
    # issue 53's order: speed, correctness, baselines, split sweep, ncu, each written before the next
    assert [doc["stages"][n]["name"] for n in sorted(doc["stages"], key=int)] == [
        "preflight", "deploy", "correctness", "speed", "baselines", "splits", "ncu", "route"]
    order = (3, 2, 4, 5, 6)
    started = [doc["stages"][str(n)]["started"] for n in order]
    finished = [doc["stages"][str(n)]["finished"] for n in order[:-1]]
    assert all(f <= s for f, s in zip(finished, started[1:]))
    assert {n: s["status"] for n, s in doc["stages"].items() if n != "1"} == {
        "0": "ok", "2": "ok", "3": "ok", "4": "ok", "5": "ok", "6": "skipped", "7": "ok"}
    # ncu cannot run on a CPU: skipped with the reason, never reported as passing
    assert doc["stages"]["6"]["skipped"] == "--cpu: no GPU to profile"
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.json", "gpu_check.log", "gpu_check.md"]


def test_stage1_reports_what_it_found(full_run):
    """Until fleetctl has a local connection (issue 10), stage 1 says so; once it has, --cpu reaches
    the host through it and stops before deploying (the deploy would write /var/lib/fleetctl here)."""
    s1 = full_run[1]["stages"]["1"]
    assert s1["status"] == "skipped"
    if "inspect" in s1 and s1["inspect"]["status"] == "unreachable":
        assert s1["skipped"].startswith("fleetctl has no local connection yet (issue 10)")
        assert "127.0.0.1:9" in s1["skipped"]
    elif "local_connection" in s1:
        assert s1["inspect"]["status"] == "ok" and "--deploy-here" in s1["skipped"]
        assert s1["cli_imports_without_paramiko"] is True  # the GPU image has no paramiko
    else:
        assert "issue 10" in s1["skipped"] and "connection" in s1["skipped"]
    assert "ansible_connection: local" in s1.get("inventory", "ansible_connection: local")


def test_every_cpu_case_is_correct(full_run):
    """36 inputs through both entries of the CPU backend (the SGLang one with the bool and the uint8
    mask, alternating)."""
    s2 = full_run[1]["stages"]["2"]
    grid = s2["grid"]
    assert grid["cases"] == 72 == len(grid["results"]) and grid["failed"] == 0
    assert all(c["ok"] and c["finite"] for c in grid["results"])
    assert {c["T"] for c in grid["results"]} == {1, 4, 8}
    assert {c["prefix_lens"][0] for c in grid["results"]} == {0, 1, 33}
    assert {(c["dtype"], c["G"]) for c in grid["results"]} == {(d, g) for d in ("float16", "bfloat16") for g in (1, 8)}
    assert {c["tree"] for c in grid["results"]} == {"random", "chain", "star"}
    assert {(c["backend"], c["entry"]) for c in grid["results"]} == {
        ("cpu", "req_to_token"), ("cpu", "sglang-bool"), ("cpu", "sglang-uint8")}
    # No CUDA graphs and no CUDA sync check on a CPU: reported as not checked, never as passed.
    assert s2["graph"] == {"skipped": "--cpu: no CUDA graphs on the CPU backend", "ok": None}
    assert s2["sync_debug"] == {"skipped": "--cpu: torch.cuda.set_sync_debug_mode needs CUDA", "ok": None}


def test_triton_baseline_under_the_interpreter_agrees_with_the_reference(full_run):
    """SGLang's extend_attention_fwd, fed the translated custom_mask / mask_indptr / kv_indices,
    matches the float64 reference on ragged requests; with the tree mask transposed it must not."""
    s2 = full_run[1]["stages"]["2"]
    b = s2["baselines"]
    assert len(b["triton"]) == 4 and all(r["ok"] for r in b["triton"])
    assert {(r["G"], r["dtype"]) for r in b["triton"]} == {(g, d) for g in (1, 8) for d in ("float16", "bfloat16")}
    assert all(r["prefix_lens"] == [37, 0] for r in b["triton"])
    assert b["negative_control"]["matched"] is False and b["negative_control"]["max_abs_err"] > 0.1
    assert len(b["sdpa"]) == 4 and all(r["ok"] for r in b["sdpa"])
    # SGLang's verify_splitkv_fwd on a causal chain (the interpreter: one shape)
    assert [(r["G"], r["dtype"], r["tree"], r["ok"]) for r in b["splitkv"]] == [(8, "float16", "chain", True)]
    assert s2["triton"] == [
        "interpreter tensor __index__ uses .item() (numpy >= 2.4 refuses int() of a 1-element array)",
        "interpreter tl.dot widens bfloat16 operands to float32 (it multiplied their raw uint16 bits)"]


def test_every_shape_has_timings_and_is_correct(full_run):
    doc = full_run[1]
    rows = doc["shapes"]
    assert [(r["T"], r["G"], r["P"]) for r in rows] == [(4, 1, 64), (8, 8, 256)]
    copy, mm = doc["rates"]["copy"]["gbps_read_plus_write"], doc["rates"]["matmul"]["tflops"]
    assert doc["rates"]["copy"]["copied_equal"] is True and copy > 0 and mm > 0
    for r in rows:
        for f in SHAPE_FIELDS:
            assert f in r, f
        assert r["correct"] is True and r["backend"] == "cpu" and list(r["by_backend"]) == ["cpu"]
        assert r["kv_bytes"] == (r["P"] + r["T"]) * r["B"] * r["Hkv"] * r["D"] * 2 * 2
        assert r["flops"] == 4 * r["B"] * r["T"] * r["Hq"] * (r["P"] + r["T"]) * r["D"]
        assert r["TG"] == r["T"] * r["G"] and r["flops"] / r["kv_bytes"] == pytest.approx(r["TG"] * r["T"] / r["T"])
        floor = max(r["kv_bytes"] / (copy * 1e6), r["flops"] / (mm * 1e9))
        assert r["floor_ms"] == pytest.approx(floor) and r["ms_kernel"] > 0
        assert r["frac_of_floor"] == pytest.approx(floor / r["ms_kernel"])
        assert r["gbps"] == pytest.approx(r["kv_bytes"] / r["ms_kernel"] / 1e6)
        assert r["tflops"] == pytest.approx(r["flops"] / r["ms_kernel"] / 1e9)
        goal = max(r["kv_bytes"] / (0.5 * copy * 1e6), r["flops"] / 200e9) + 0.010
        assert r["goal_ms"] == pytest.approx(goal) and r["goal"] == ("met" if r["ms_kernel"] <= goal else "missed")
        assert r["by_backend"]["cpu"]["timing"] == "perf_counter"
    s3 = doc["stages"]["3"]
    assert s3["shapes_timed"] == s3["shapes_planned"] == 2 and s3["disagreements"] == []
    g = doc["goal"]
    assert g["met"] is None and g["why"].startswith("--cpu")  # a CPU measures nothing: the goal is not judged
    assert g["worst"]["frac_of_floor"] == min(r["frac_of_floor"] for r in rows)
    assert g["shapes"]["met"] + g["shapes"]["missed"] == 2


def test_baselines_stage(full_run):
    """Stage 4 (on a CPU: one shape): SGLang's extend_attention_fwd, its verify_splitkv_fwd on the causal
    chain, and SDPA, timed against the new kernel; every figure present and its ratio its own."""
    doc = full_run[1]
    [r] = doc["baselines"]
    for f in BASELINE_FIELDS:
        assert f in r, f
    assert (r["T"], r["G"], r["P"]) == (4, 1, 64)
    assert r["ms_kernel"] == doc["shapes"][0]["ms_kernel"]
    assert r["speedup_vs_triton"] == pytest.approx(r["ms_triton"] / r["ms_kernel"])
    assert r["speedup_vs_splitkv"] == pytest.approx(r["ms_splitkv"] / r["ms_kernel_chain"])
    assert r["agree_triton"]["ok"] and r["agree_sdpa"]["ok"]
    assert r["goal_vs_triton"] in ("met", "missed") and r["goal_vs_splitkv"] in ("met", "missed")
    assert doc["stages"]["4"]["baseline_errors"] == {}


def test_split_sweep_stage(full_run):
    doc = full_run[1]
    [r] = doc["splits"]
    assert list(r["ms_by_splits"]) == ["0", "1", "2", "4", "8", "16", "32", "64", "128"]
    assert r["ms_best"] == min(v for k, v in r["ms_by_splits"].items() if k != "0")
    assert r["ms_heuristic"] == r["ms_by_splits"]["0"]
    assert r["ok"] is None and doc["stages"]["5"]["heuristic_within_10pct"] is None  # the CPU backend has no splits
    assert "ignores num_splits" in doc["stages"]["5"]["note"]


def test_markdown_table(full_run):
    out, doc, r = full_run
    md = (out / "gpu_check.md").read_text()
    assert md.startswith("# verify_attention GPU check (cpu)")
    table = [line for line in md.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(table) == len(doc["shapes"]) + len(doc["baselines"]) == 3
    assert all(f"| {r['goal']} |" in line for r, line in zip(doc["shapes"], table))
    assert "stage 1 deploy: **skipped**" in md and "stage 2 correctness: **ok**" in md
    assert "stage 6 ncu: **skipped** --cpu: no GPU to profile" in md and "split sweep" in md
    assert md in r.stdout  # the table is printed last, for the device tool's output tail


def test_speed_stage_reruns_alone(full_run, build_dir, tmp_path):
    """As on the device machine: a fresh, empty OUT, continuing the first run's JSON (--resume-from),
    `--stage speed` reruns stage 3 only; the others keep their records."""
    out, before, _ = full_run
    again = tmp_path / "out"
    r = run_check(again, "--build-dir", build_dir, "--stage", "speed", "--resume-from", str(out / "gpu_check.json"))
    assert r.returncode == 0, why(again, r)
    after = json.loads((again / "gpu_check.json").read_text())
    assert len(after["runs"]) == 2 and after["runs"][1]["argv"][-4:-2] == ["--stage", "speed"]
    new_run = after["runs"][1]["run"]
    assert after["stages"]["3"]["run"] == new_run != before["stages"]["3"]["run"]
    assert after["stages"]["3"]["status"] == "ok" and len(after["shapes"]) == 2
    for n in ("0", "1", "2", "4", "5", "6", "7"):
        assert after["stages"][n] == before["stages"][n]
    assert after["baselines"] == before["baselines"] and after["splits"] == before["splits"]
    assert after["rates"]["run"] == new_run                 # the floor's rates are this run's own
    assert (again / "gpu_check.md").exists()
    assert "stage 1 deploy:" not in r.stdout.split("# verify_attention")[0]  # stage 1 did not run


def test_without_a_gpu_the_gpu_stages_say_so(tmp_path):
    """Without --cpu on a machine with no CUDA device: preflight runs, stages 2-4 are skipped with the
    reason (never built, never reported as passed)."""
    r = subprocess.run(["bash", str(SCRIPT), "--out", str(tmp_path), "--stages", "0,2,3,4,5,6,7"], capture_output=True,
                       text=True, timeout=300, cwd=ROOT)
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    if doc["stages"]["0"]["environment"]["cuda_available"]:
        pytest.skip("this machine has a CUDA device")
    assert r.returncode == 0, r.stderr[-3000:]
    assert doc["mode"] == "cuda" and doc["shapes"] == [] and doc["backend"] == "triton" and doc["beside"] == []
    for n in ("2", "3", "4", "5", "6", "7"):
        assert doc["stages"][n]["status"] == "skipped"
        assert doc["stages"][n]["skipped"].startswith("no CUDA device")
    assert "building" not in r.stdout


def test_route_stage_routes_and_reads_the_evidence_back(full_run):
    """Stage 7 on a CPU: the hook rendered by fleetctl's playbook loader over a published-style tree of the
    CPU build, called with the 0.5.23 guard's keywords; batches up to the table's max_batch routed and equal
    to the reference, the one over it left to SGLang; the evidence file this process wrote says the same. No
    CUDA graphs on a CPU: the capture is reported as not checked (on a GPU `captured` lists the batches)."""
    s7 = full_run[1]["stages"]["7"]
    if os.geteuid() != 0:
        assert s7["status"] == "skipped" and "root" in s7["skipped"]
        pytest.skip("the hook trusts root-owned builds only")
    assert s7["status"] == "ok" and all(s7["checks"].values()) and set(s7["checks"]) == {
        "calls", "evidence_is_this_process", "build", "captured", "eager_routed", "fallbacks"}
    assert [(c["batch"], c["returned"]) for c in s7["calls"]] == [(1, True), (2, True), (4, True), (8, False)]
    assert all(c["check"]["ok"] for c in s7["calls"] if c["returned"])
    ev = s7["evidence"]
    assert ev["captured"] == [] and ev["eager_routed"] == 3 and ev["fallbacks"] == {"batch over max_batch": 1}
    assert s7["graphs"] == {"skipped": "--cpu: no CUDA graphs on the CPU backend", "ok": None}


def test_route_stage_fails_when_the_table_routes_another_shape(build_dir, monkeypatch):
    """The same stage over a table whose entry names another draft width: nothing routes, the stage fails."""
    if os.geteuid() != 0:
        pytest.skip("the hook trusts root-owned builds only")
    import route

    made = route.make_tree

    def other_table(tmp, module_path, sh):
        link, ev = made(tmp, module_path, sh)
        table = link.parent / "dispatch.json"
        doc = json.loads(table.read_text())
        doc["entries"][0]["draft_tokens"] += 1
        table.write_text(json.dumps(doc))
        return link, ev

    monkeypatch.setattr(route, "make_tree", other_table)
    status, data = route.stage7(str(Path(build_dir) / "verify_attention_cpu.so"), True, lambda m: None)
    assert status == "failed" and data["checks"]["calls"] is False and data["checks"]["eager_routed"] is False
    assert data["evidence"]["fallbacks"] == {"shape not enabled": 4}


def test_dispatch_bench_cpu_plumbing(build_dir):
    """kernels/verify_attention/dispatch_bench.py with "device": "cpu" (the plumbing check: eager calls of the
    CPU build against reference.py): every point timed and agreeing, and the answer says it is no CUDA-graph
    measurement, so engine/kernels/measure.py enables nothing from it. The CUDA path needs a GPU host."""
    req = {"module": str(Path(build_dir) / "verify_attention_cpu.so"), "device": "cpu", "prefixes": [16, 64],
           "shapes": [{"head_dim": 64, "group": 2, "draft_tokens": 4, "dtype": d, "q_heads": 4, "kv_heads": 2,
                       "topk": k, "batches": [1, 2]} for d, k in (("float32", 1), ("bfloat16", 4))]}
    r = subprocess.run([sys.executable, str(ROOT / "kernels/verify_attention/dispatch_bench.py")], input=json.dumps(req),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["ok"] is True and out["device"] == "cpu" and out["graphs"] is False and "measures nothing" in out["note"]
    points = [p for s in out["shapes"] for p in s["results"]]
    assert len(points) == 8 and all(p["agree"] is True and p["ms_build"] > 0 and p["ms_sglang"] > 0 for p in points)
    assert {(p["batch"], p["prefix"]) for p in points} == {(b, p) for b in (1, 2) for p in (16, 64)}


def test_a_killed_run_leaves_valid_json_naming_the_running_stage(tmp_path):
    import check

    rep = check.Report(tmp_path, "r1", ["--cpu"], "cpu")
    rep.start(0)
    rep.finish(0, "ok", 0.0, environment={})
    rep.start(2)                                   # the process dies here
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    assert doc["stages"]["0"]["status"] == "ok" and doc["stages"]["2"]["status"] == "running"
    assert "stage 2 correctness: **running**" in (tmp_path / "gpu_check.md").read_text()
    rep2 = check.Report(tmp_path, "r2", ["--stages", "2"], "cpu")  # a rerun keeps stage 0
    assert rep2.doc["stages"]["0"]["status"] == "ok" and [r["run"] for r in rep2.doc["runs"]] == ["r1", "r2"]


def test_parse_clocks():
    import check

    text = """
==============NVSMI LOG==============

Timestamp                                 : Mon Nov 30 12:00:00 2026
Driver Version                            : 580.159.04
CUDA Version                              : 13.0

Attached GPUs                             : 1
GPU 00000000:00:05.0
    Clocks Event Reasons
        Idle                              : Active
    Clocks
        Graphics                          : 345 MHz
        SM                                : 345 MHz
        Memory                            : 3201 MHz
    Max Clocks
        Graphics                          : 1980 MHz
        SM                                : 1980 MHz
        Memory                            : 3201 MHz
"""
    c = check.parse_clocks(text)
    assert c["Clocks"] == {"Graphics": "345 MHz", "SM": "345 MHz", "Memory": "3201 MHz"}
    assert c["Max Clocks"]["SM"] == "1980 MHz" and c["Clocks Event Reasons"] == {"Idle": "Active"}
    assert c["_"]["Driver Version"] == "580.159.04"


@pytest.mark.parametrize("name", sorted(SGLANG_SHA256))
def test_carried_file_is_the_wheels_file_but_for_its_imports(name):
    """Restoring the marked import lines gives the 0.5.23 wheel's file byte for byte; the stub
    provides exactly the names those lines import."""
    from fleetctl.wheels import find_wheel

    import common

    wheel = find_wheel("0.5.23")
    if wheel is None:
        pytest.skip("the SGLang 0.5.23 wheel is not in the wheel cache (scripts/setup.sh downloads it)")
    with zipfile.ZipFile(wheel) as z:
        original = z.read(f"sglang/kernels/ops/attention/{name}")
    assert hashlib.sha256(original).hexdigest() == SGLANG_SHA256[name]
    assert common.carried_sha256()[name]["sha256_restored"] == SGLANG_SHA256[name]
    carried = (ROOT / "bench/gpu_check/carried" / name).read_text().splitlines()
    changed = [(a, b) for a, b in zip(original.decode().splitlines(), carried) if a != b]
    assert len(changed) == IMPORTS_REPLACED[name] and all(b.startswith("from .sglang_stub import ") for _, b in changed)
    import carried.sglang_stub as stub

    names = {n.strip() for _, b in changed for n in b.split("import ", 1)[1].split("  #")[0].split(",")}
    assert names == {"extend_attention.py": {"_extract_kv_strides", "unpack_aux_tensors", "envs", "is_cuda",
                                             "is_gfx95_supported", "is_gfx1250_supported", "is_hip"},
                     "verify_splitkv.py": {"is_hip"}}[name]
    assert all(hasattr(stub, n) for n in names)


def test_roofline_and_goal_on_hand_figures():
    """1 GB of K/V and 10 TFLOP at a 4000 GB/s copy and an 800 TFLOP/s matmul: the floor is the
    larger of 0.25 ms and 12.5 ms; the goal max(0.5 ms, 50 ms) + 10 us. A shape with no time is
    unmeasured, and a goal with any unmeasured figure (verify_splitkv_fwd that did not run) is not met."""
    import common
    import speed

    r = common.roofline(10 ** 9, 10 ** 13, 25.0, 4000.0, 800.0)
    assert r["floor_ms"] == pytest.approx(12.5) and r["bound"] == "compute"
    assert r["goal_ms"] == pytest.approx(50.01) and r["goal"] == "met"
    assert r["frac_of_floor"] == pytest.approx(0.5) and r["gbps"] == pytest.approx(40.0)
    assert r["tflops"] == pytest.approx(400.0)
    m = common.roofline(10 ** 9, 10 ** 9, 1.0, 4000.0, 800.0)
    assert m["bound"] == "memory" and m["floor_ms"] == pytest.approx(0.25) and m["goal"] == "missed"
    assert common.roofline(10 ** 9, 10 ** 9, None, 4000.0, 800.0)["goal"] == "unmeasured"
    shape = {"B": 8, "T": 4, "P": 65536, "G": 1, "D": 128}
    rows = [dict(shape, ms_kernel=0.4, kv_bytes=10 ** 9, **common.roofline(10 ** 9, 10 ** 9, 0.4, 4000.0, 800.0))]
    base = [dict(shape, goal_vs_triton="met", goal_vs_splitkv="met")]
    assert speed.goal(rows, base)["met"] is True
    assert speed.goal(rows, [dict(base[0], goal_vs_splitkv="unmeasured")])["met"] is False
    assert speed.goal(rows, [])["met"] is False               # no baselines measured: not met
    assert speed.goal(rows, base, cpu=True)["met"] is None
    g = speed.goal(rows + [dict(rows[0], P=4096, ms_kernel=2.0, **common.roofline(10 ** 9, 10 ** 9, 2.0, 4000.0,
                                                                                    800.0))], base)
    assert g["met"] is False and g["worst"]["P"] == 4096 and g["shapes"] == {"met": 1, "missed": 1, "unmeasured": 0}
    assert g["median_frac_of_floor"] == pytest.approx((0.25 / 0.4 + 0.25 / 2.0) / 2)


def test_shapes_cut_for_time_are_unmeasured_never_met():
    """kernel-turn4.md finding 6: a speed stage that ran out of budget after one met shape reports
    the shapes it did not start as unmeasured, and the goal as not met."""
    import common
    import speed

    shape = {"B": 8, "T": 4, "P": 65536, "G": 1, "D": 128}
    rows = [dict(shape, ms_kernel=0.4, kv_bytes=10 ** 9, **common.roofline(10 ** 9, 10 ** 9, 0.4, 4000.0, 800.0))]
    base = [dict(shape, goal_vs_triton="met", goal_vs_splitkv="met")]
    g = speed.goal(rows, base, not_run=[dict(shape, P=4096), dict(shape, P=16384)])
    assert g["shapes"] == {"met": 1, "missed": 0, "unmeasured": 2} and g["met"] is False


def test_ncu_profiles_the_worst_and_a_memory_bound_shape():
    import check

    worst = {"B": 1, "T": 64, "P": 4096, "G": 8, "D": 64, "ms_kernel": 1, "floor_ms": 1, "frac_of_floor": 0.1}
    mem = {"B": 8, "T": 4, "P": 65536, "G": 1, "D": 256, "kv_bytes": 1, "gbps": 1}
    assert check.ncu_shapes({"worst": worst, "memory_bound_shape": mem}) == [
        ("worst fraction of the floor", {"B": 1, "T": 64, "P": 4096, "G": 8, "D": 64}),
        ("memory-bound, most K/V bytes", {"B": 8, "T": 4, "P": 65536, "G": 1, "D": 256})]
    assert len(check.ncu_shapes({"worst": dict(worst, **{k: mem[k] for k in "BTPGD"}), "memory_bound_shape": mem})) == 1
    assert check.ncu_shapes(None) == []


def test_stage_names():
    import check

    assert check.parse_stages(None, "speed") == [3]
    assert check.parse_stages("0,2", "ncu,baselines") == [0, 2, 4, 6]
    with pytest.raises(ValueError, match="unknown stage 'sped'"):
        check.parse_stages(None, "sped")
    assert check.parse_stages(None, "route") == [7]
    with pytest.raises(ValueError, match="unknown stage '8'"):
        check.parse_stages("8", None)


def test_aot_build_in_parallel_processes_merges_into_one_loadable_build(tmp_path):
    """common.aot_build: the Triton kernels for sm_90 built in two processes, merged into one
    directory whose manifest triton_verify.read_kernels reads back without compiling (issue 53: the
    GPU check times what deploy ships, built at its start in parallel)."""
    import common
    import triton_verify as tv

    keys = [tv.fwd_key("bf16", 64, 16, "sglang_tree"), tv.combine_key("bf16", 64)]
    r = common.aot_build(90, tmp_path / "aot", procs=2, keys=keys)
    assert r["procs"] == 2 and r["instantiations"] == 2 and len(r["per_process_s"]) == 2
    manifest, kernels = tv.read_kernels(tmp_path / "aot")
    assert manifest["arch"] == 90 and sorted(kernels) == sorted(keys)
    assert not list((tmp_path / "aot").glob("part-*"))
