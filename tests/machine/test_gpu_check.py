"""bench/gpu_check.sh end to end on this CPU machine (--cpu): the same script a GPU machine runs, with the
CPU backend, the smallest shapes and SGLang 0.5.23's carried Triton kernel under TRITON_INTERPRET=1.

One full run (module fixture, ~30 s; the build is the test run's one CPU build, conftest's
`cpu_kernel`, passed as --build-dir), then a `--stages 2` rerun of a copy of its output. Needs triton
3.6.0 (the `test` extra) for the interpreter.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.sh"
SGLANG_SHA256 = "be3baffc80ef9fe484d0b896842522b02bf671785088e05a66ca4dcdb2e8a9b3"
SHAPE_FIELDS = ("ms_kernel", "ms_triton", "ms_sdpa", "speedup_vs_triton", "hbm_gbps", "correct")
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
    assert doc["schema"] == "fleetctl-gpu-check/1" and doc["mode"] == "cpu"
    assert doc["device_name"].startswith("cpu: ")
    assert doc["clocks"] == {"skipped": "no nvidia-smi on this machine"} or "Clocks" in doc["clocks"]
    v = doc["versions"]
    assert v["torch"] and v["triton"] == "3.6.0" and v["python"] and v["runtime"]
    assert doc["carried"]["sha256"] == SGLANG_SHA256
    assert doc["carried"]["matches"] is True and doc["carried"]["import_lines_replaced"] == 4
    assert sorted(doc["stages"]) == ["0", "1", "2", "3", "4"]
    assert {n: s["status"] for n, s in doc["stages"].items() if n != "1"} == {
        "0": "ok", "2": "ok", "3": "ok", "4": "skipped"}
    assert doc["stages"]["4"]["skipped"] == "--cpu: no GPU to profile"
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
    s2 = full_run[1]["stages"]["2"]
    grid = s2["grid"]
    assert grid["cases"] == 24 == len(grid["results"]) and grid["failed"] == 0
    assert all(c["ok"] and c["finite"] for c in grid["results"])
    assert {c["T"] for c in grid["results"]} == {1, 8}
    assert {c["prefix_lens"][0] for c in grid["results"]} == {0, 1, 33}
    assert {(c["dtype"], c["G"]) for c in grid["results"]} == {(d, g) for d in ("float16", "bfloat16") for g in (1, 8)}
    assert {c["tree"] for c in grid["results"]} == {"random", "chain", "star"}
    # No CUDA graphs on a CPU: reported as not checked, never as passed.
    assert s2["graph"] == {"skipped": "--cpu: no CUDA graphs on the CPU backend", "ok": None}


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
    assert s2["triton"] == [
        "interpreter tensor __index__ uses .item() (numpy >= 2.4 refuses int() of a 1-element array)",
        "interpreter tl.dot widens bfloat16 operands to float32 (it multiplied their raw uint16 bits)"]


def test_every_shape_has_timings_and_is_correct(full_run):
    doc = full_run[1]
    rows = doc["shapes"]
    assert [(r["G"], r["P"]) for r in rows] == [(1, 64), (8, 256)]
    for r in rows:
        for f in SHAPE_FIELDS:
            assert f in r, f
        assert r["correct"] is True and r["triton_correct"] is True and r["sdpa_correct"] is True
        assert all(r[f] > 0 for f in ("ms_kernel", "ms_triton", "ms_sdpa", "hbm_gbps"))
        assert r["speedup_vs_triton"] == pytest.approx(r["ms_triton"] / r["ms_kernel"])
        assert r["hbm_gbps"] == pytest.approx(r["kv_bytes"] / r["ms_kernel"] / 1e6)
        assert r["kv_bytes"] == (r["P"] + r["T"]) * r["B"] * r["Hkv"] * r["D"] * 2 * 2
        assert r["timing_kernel"] == r["timing_triton"] == "perf_counter"
    s3 = doc["stages"]["3"]
    assert s3["copy"]["copied_equal"] is True and s3["copy"]["gbps_read_plus_write"] > 0
    assert s3["shapes_timed"] == s3["shapes_planned"] == 2 and s3["baseline_disagreements"] == []
    assert doc["goal"]["met"] is None  # no 64k shape on a CPU: the goal is not judged


def test_markdown_table(full_run):
    out, doc, r = full_run
    md = (out / "gpu_check.md").read_text()
    assert md.startswith("# verify_attention GPU check (cpu)")
    table = [line for line in md.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(table) == len(doc["shapes"]) == 2
    assert all(line.rstrip().endswith("| True |") for line in table)
    assert "stage 1 deploy: **skipped**" in md and "stage 2 correctness: **ok**" in md
    assert md in r.stdout  # the table is printed last, for the device tool's output tail


def test_stages_rerun_touches_only_those_stages(full_run, build_dir, tmp_path):
    """As on the device machine: a fresh, empty OUT, continuing the first run's JSON (--resume-from)."""
    out, before, _ = full_run
    again = tmp_path / "out"
    r = run_check(again, "--build-dir", build_dir, "--stages", "2", "--resume-from", str(out / "gpu_check.json"))
    assert r.returncode == 0, why(again, r)
    after = json.loads((again / "gpu_check.json").read_text())
    assert len(after["runs"]) == 2 and after["runs"][1]["argv"][-4:-2] == ["--stages", "2"]
    new_run = after["runs"][1]["run"]
    assert after["stages"]["2"]["run"] == new_run != before["stages"]["2"]["run"]
    assert after["stages"]["2"]["status"] == "ok"
    for n in ("0", "1", "3", "4"):
        assert after["stages"][n] == before["stages"][n]
    assert after["shapes"] == before["shapes"] and after["goal"] == before["goal"]
    assert (again / "gpu_check.md").exists()
    assert "stage 1 deploy:" not in r.stdout.split("# verify_attention")[0]  # stage 1 did not run


def test_without_a_gpu_the_gpu_stages_say_so(tmp_path):
    """Without --cpu on a machine with no CUDA device: preflight runs, stages 2-4 are skipped with the
    reason (never built, never reported as passed)."""
    r = subprocess.run(["bash", str(SCRIPT), "--out", str(tmp_path), "--stages", "0,2,3,4"], capture_output=True,
                       text=True, timeout=300, cwd=ROOT)
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    if doc["stages"]["0"]["environment"]["cuda_available"]:
        pytest.skip("this machine has a CUDA device")
    assert r.returncode == 0, r.stderr[-3000:]
    assert doc["mode"] == "cuda" and doc["shapes"] == []
    for n in ("2", "3", "4"):
        assert doc["stages"][n]["status"] == "skipped"
        assert doc["stages"][n]["skipped"].startswith("no CUDA device")
    assert "building" not in r.stdout


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


def test_carried_file_is_the_wheels_file_but_for_its_imports():
    """Restoring the four marked import lines gives the 0.5.23 wheel's file byte for byte; the stub
    provides exactly the names those lines import."""
    from fleetctl.wheels import find_wheel

    import common

    wheel = find_wheel("0.5.23")
    if wheel is None:
        pytest.skip("the SGLang 0.5.23 wheel is not in the wheel cache (scripts/setup.sh downloads it)")
    with zipfile.ZipFile(wheel) as z:
        original = z.read("sglang/kernels/ops/attention/extend_attention.py")
    assert hashlib.sha256(original).hexdigest() == SGLANG_SHA256
    assert common.carried_sha256()["sha256_restored"] == SGLANG_SHA256
    carried = (ROOT / "bench/gpu_check/carried/extend_attention.py").read_text().splitlines()
    changed = [(a, b) for a, b in zip(original.decode().splitlines(), carried) if a != b]
    assert len(changed) == 4 and all(b.startswith("from .sglang_stub import ") for _, b in changed)
    import carried.sglang_stub as stub

    names = {n.strip() for _, b in changed for n in b.split("import ", 1)[1].split("  #")[0].split(",")}
    assert names == {"_extract_kv_strides", "unpack_aux_tensors", "envs", "is_cuda", "is_gfx95_supported",
                     "is_gfx1250_supported", "is_hip"}
    assert all(hasattr(stub, n) for n in names)
