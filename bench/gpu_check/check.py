"""GPU proof of kernels/verify_attention in one command: bash bench/gpu_check.sh [--stages ...] [--cpu].

Stages, run in the order 0, 1, 3, 2, 4, 5, 6, 7 (speed first; before the GPU stages the Triton
backend is built ahead of time for the device's arch in AOT_PROCS processes, `common.aot_build`,
and loaded with `triton_verify.load`: the build deploy ships, nothing compiled while timing; each
stage appends its part to OUT/gpu_check.json as it finishes, and
OUT/gpu_check.md is rewritten beside it, so a run killed at its time limit still returns what it
finished; a stage that was running when the run died reads "running"; `--stages 3` or
`--stage speed` reruns only those and keeps the others' records; where OUT starts empty, as on the
device machine, `--resume-from PATH` starts from an earlier run's gpu_check.json carried in the tree):

  0 preflight    nvidia-smi (name, compute capability, `nvidia-smi -q -d CLOCK`), torch / CUDA /
                 triton / nvcc / driver versions, runtime kind (gVisor or Firecracker, from the
                 kernel release), free disk and GPU memory, ncu; says which stages cannot run here.
  1 deploy       `PYTHONPATH=agent python3 -m fleetctl.cli deploy kernel verify_attention HOST -i INV
                 --yes --json` against this machine through an inventory host with
                 `ansible_connection: local` (see stage1). Skipped, saying why, while fleetctl has
                 no local connection or its CLI does not import here (no paramiko).
  2 correctness  (grid cases start within STAGE_BUDGET_S[2]; the rest counted, stage "incomplete")
                 every backend under test, both entries, against the float64 reference over the grid
                 (small prefixes), CUDA graph capture at one prefix and replay at others, no host
                 sync (set_sync_debug_mode "error"), the baselines against the reference (correctness.py).
  3 speed        the new kernel (--backend, default the Triton backend; --beside adds others, default
                 none), per shape K/V bytes, FLOPs, floor, fraction, GB/s, TFLOP/s and the goal
                 (speed.py); no shape starts past SPEED_BUDGET_S less this run's AOT build time, and
                 the shapes not started count as unmeasured in the goal, never as met.
  4 baselines    at 16k and 64k only: SGLang 0.5.23's extend_attention_fwd, its verify_splitkv_fwd
                 (chain trees, T <= speed.SPLITKV_MAX_T only: "unmeasured" above), gather + SDPA,
                 against the new kernel.
  5 splits       the new kernel's split heuristic against fixed split counts at three shapes.
  6 ncu          `ncu --clock-control none` summaries of the new kernel at the worst shape and at one
                 memory-bound shape; a failure is recorded.
  7 route        route-verify-attention's hook rendered over a published-style tree of the extension
                 build, called as SGLang's Triton backend calls it under CUDA graph capture and replay,
                 the routing evidence read back (route.py; --cpu: eager calls only, said so).

Stages 2-7 build the CUDA (or CPU) extension themselves (in build/verify_attention/, started in the
background before stage 1) and never use fleetctl's transport. --cpu: the CPU backend as the new
kernel, the smallest shapes, and the carried Triton kernels under TRITON_INTERPRET=1 (for the CPU
test, tests/machine/test_gpu_check.py); its times check the script, they measure nothing.
OUT is --out, else $OUT. Files written there: gpu_check.json, gpu_check.md, gpu_check.log,
stage1_deploy.json (stage 1's fleetctl output), ncu.txt (stage 6).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
STAGES = {0: "preflight", 1: "deploy", 2: "correctness", 3: "speed", 4: "baselines", 5: "splits", 6: "ncu",
          7: "route"}
GPU_STAGES = (2, 3, 4, 5, 6, 7)
RUN_ORDER = (3, 2, 4, 5, 6, 7)  # speed first: stage 2's numerics are also checked on the CPU in CI
AOT_PROCS = 8                   # processes for the Triton AOT build (the device machine has 16 cores)
SPEED_BUDGET_S = 120.0        # stage 3 starts no shape past this (the issue: the speed stage reruns in <= 120 s)
STAGE_BUDGET_S = {2: 60.0, 4: 60.0, 5: 25.0}  # grid cases / shapes start within these; others: the deadline
SCHEMA = "fleetctl-gpu-check/2"


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


class Report:
    """OUT/gpu_check.json: one document, rewritten atomically (temp file + rename) after every change.

    {"schema", "mode", "device_name", "clocks", "versions", "carried": {file: {...}}, "backend", "beside",
     "runs": [...], "stages": {"0": {"name", "status", "run", "started", "finished", "seconds", ...}, ...},
     "rates": {"copy", "matmul"}, "shapes": [stage 3 rows], "baselines": [stage 4 rows],
     "splits": [stage 5 rows], "goal": {...}}
    status: ok | failed | skipped (with "skipped": why) | not_needed | incomplete | running (the run
    died inside it). A rerun keeps the records of the stages it does not run.
    """

    def __init__(self, out: Path, run_id: str, argv: list[str], mode: str):
        self.out = out
        self.path = out / "gpu_check.json"
        self.run_id = run_id
        doc = {}
        if self.path.exists():
            try:
                doc = json.loads(self.path.read_text())
            except ValueError:
                doc = {}
        if doc.get("schema") != SCHEMA or doc.get("mode") != mode:
            doc = {"schema": SCHEMA, "mode": mode, "device_name": None, "clocks": None, "versions": None,
                   "carried": None, "runs": [], "stages": {}, "rates": None, "shapes": [], "baselines": [],
                   "splits": [], "goal": None}
        doc["runs"].append({"run": run_id, "argv": argv, "started": now()})
        self.doc = doc
        self.save()

    def save(self) -> None:
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.doc, indent=1, default=str) + "\n")
        os.replace(tmp, self.path)
        (self.out / "gpu_check.md").write_text(markdown(self.doc))

    def start(self, n: int) -> dict:
        rec = {"name": STAGES[n], "status": "running", "run": self.run_id, "started": now()}
        self.doc["stages"][str(n)] = rec
        self.save()
        return rec

    def finish(self, n: int, status: str, t0: float, **data) -> dict:
        rec = self.doc["stages"][str(n)]
        rec.update(data, status=status, finished=now(), seconds=round(time.monotonic() - t0, 1))
        self.save()
        return rec


class Log:
    """Print a line and append it to OUT/gpu_check.log."""

    def __init__(self, out: Path):
        self.f = open(out / "gpu_check.log", "a")

    def __call__(self, msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        print(line, flush=True)
        self.f.write(line + "\n")
        self.f.flush()


def sh(cmd: list[str], timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    """Run a command, never raising: a missing binary or a timeout becomes rc 127 / 124."""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL, **kw)
    except FileNotFoundError as e:
        return subprocess.CompletedProcess(cmd, 127, "", str(e))
    except subprocess.TimeoutExpired as e:
        return subprocess.CompletedProcess(cmd, 124, (e.stdout or b"").decode() if isinstance(e.stdout, bytes)
                                           else (e.stdout or ""), f"timed out after {timeout} s")


# --- stage 0 ---------------------------------------------------------------------------------------

def parse_clocks(text: str) -> dict:
    """`nvidia-smi -q -d CLOCK` -> {section: {field: value}} (e.g. {"Clocks": {"SM": "1980 MHz"}})."""
    out, section = {}, None
    for line in text.splitlines():
        if not line.strip() or line.startswith("=") or line.startswith("GPU "):
            continue
        indent = len(line) - len(line.lstrip())
        key, sep, value = line.strip().partition(":")
        key, value = key.strip(), value.strip()
        if sep and value and section is not None and indent > 4:
            out.setdefault(section, {})[key] = value
        elif indent <= 4 and (not value):
            section = key
        elif sep and value:
            out.setdefault("_", {})[key] = value
    return out


def find_ncu() -> str | None:
    """ncu on PATH, in CUDA's bin, or under /opt/nvidia/nsight-compute/*/."""
    found = shutil.which("ncu") or (shutil.which("ncu", path="/usr/local/cuda/bin"))
    if found:
        return found
    for p in sorted(Path("/opt/nvidia/nsight-compute").glob("*/ncu"), reverse=True):
        if os.access(p, os.X_OK):
            return str(p)
    return None


def find_nvcc() -> str | None:
    """nvcc as torch finds it: CUDA_HOME/CUDA_PATH, PATH, /usr/local/cuda/bin."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    for p in ([os.path.join(home, "bin", "nvcc")] if home else []) + [shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"]:
        if p and os.access(p, os.X_OK):
            return p
    return None


def environment(cpu: bool) -> dict:
    """Facts every run needs (cheap): device, versions, what can run. Imports torch."""
    import torch

    env = {"python": sys.version.split()[0], "torch": torch.__version__, "torch_cuda": torch.version.cuda,
           "cuda_available": torch.cuda.is_available(), "kernel_release": platform.release()}
    try:
        import numpy
        env["numpy"] = numpy.__version__
    except ImportError:
        env["numpy"] = None
    try:
        import triton
        env["triton"] = triton.__version__
        env["triton_error"] = None
    except Exception as e:  # noqa: BLE001 - any import failure means no Triton baseline
        env["triton"], env["triton_error"] = None, f"{type(e).__name__}: {e}"
    nvcc = find_nvcc()
    env["nvcc_path"] = nvcc
    env["nvcc"] = None
    if nvcc:
        m = re.search(r"release (\d+\.\d+)", sh([nvcc, "--version"]).stdout)
        env["nvcc"] = m.group(1) if m else None
    rel = env["kernel_release"]
    env["runtime"] = ("gvisor" if rel.startswith("4.4.0") else "firecracker" if "-fc-" in rel or "fc" in rel.split("-")
                      else f"unknown (kernel {rel})")
    env["ncu"] = find_ncu()
    if not cpu and env["cuda_available"]:
        p = torch.cuda.get_device_properties(0)
        env.update(device_name=torch.cuda.get_device_name(0), compute_capability=f"{p.major}.{p.minor}",
                   sm_count=p.multi_processor_count, l2_bytes=getattr(p, "L2_cache_size", 0) or 0,
                   gpu_memory_bytes=p.total_memory)
    else:
        model = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                      if ln.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
        env.update(device_name=f"cpu: {model} ({os.cpu_count()} cores)", compute_capability=None, sm_count=None,
                   l2_bytes=0, gpu_memory_bytes=None)
    return env


def stage0(env: dict, cpu: bool, out: Path) -> tuple[str, dict]:
    data = {"environment": env}
    smi = shutil.which("nvidia-smi")
    if smi:
        q = sh([smi, "--query-gpu=name,compute_cap,driver_version,memory.total,memory.used,clocks.sm,clocks.mem,"
                     "clocks.max.sm,clocks.max.mem,power.draw,temperature.gpu,persistence_mode",
                "--format=csv"], timeout=30)
        data["nvidia_smi_query"] = (q.stdout or q.stderr).strip()
        c = sh([smi, "-q", "-d", "CLOCK"], timeout=30)
        data["clocks_raw"] = (c.stdout or c.stderr).strip()
        data["clocks"] = parse_clocks(c.stdout) if c.returncode == 0 else {"error": c.stderr.strip()[-500:]}
        m = re.search(r"Driver Version\s*:\s*(\S+)", sh([smi, "-q"], timeout=30).stdout)
        data["driver"] = m.group(1) if m else None
    else:
        data["nvidia_smi"] = "not found"
        data["clocks"] = {"skipped": "no nvidia-smi on this machine"}
    data["disk_free_bytes"] = {p: shutil.disk_usage(p).free for p in (str(ROOT), tempfile.gettempdir(), str(out))}
    if env.get("cuda_available") and not cpu:
        import torch
        free, total = torch.cuda.mem_get_info()
        data["gpu_memory_free_bytes"], data["gpu_memory_total_bytes"] = free, total
    if env["triton"] is None:
        data["triton_baseline"] = f"not available: {env['triton_error']}"
    data["cannot_run"] = cannot_run(env, cpu)
    return "ok", data


def cannot_run(env: dict, cpu: bool) -> dict:
    """{stage: why} for the stages that cannot run on this machine (from environment())."""
    if cpu:
        return {"6": "--cpu: no GPU to profile"}
    if not env["cuda_available"]:
        return {str(s): "no CUDA device (torch.cuda.is_available() is False); --cpu checks the CPU backend"
                for s in GPU_STAGES}
    if not env["nvcc"]:
        return {str(s): "no nvcc: the CUDA backend cannot be built" for s in GPU_STAGES}
    if not env["ncu"]:
        return {"6": "ncu not found (PATH, /usr/local/cuda/bin, /opt/nvidia/nsight-compute/*/)"}
    return {}


# --- stage 1 ---------------------------------------------------------------------------------------

def stage1(cpu: bool, deploy_here: bool, out: Path, log) -> tuple[str, dict]:
    """Deploy through fleetctl itself, against this machine through a `local` connection.

    The inventory has one host with `ansible_connection: local`, `ansible_host: 127.0.0.1` and
    `ansible_port: 9` (nothing listens there): a fleetctl that honours the local connection never
    dials that address; one that ignores it tries SSH to 127.0.0.1:9 and is refused at once, which
    is how the missing connection is detected (read-only, with `fleetctl inspect` first). Then the
    deploy must: preflight compute capability 9.0 (GPU runs), a build key that is
    kernelpkg.build_key(..., arch="9.0") recomputed here, the reference test on "cuda", and the
    `current` link switched to that key.
    """
    data: dict = {}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "agent")] + [
        p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    r = sh([sys.executable, "-c", "import fleetctl.cli"], cwd=str(ROOT), env=env)
    if r.returncode != 0:
        err = (r.stderr.strip().splitlines() or ["?"])[-1]
        return "skipped", {"skipped": f"fleetctl's CLI does not import here ({err}); stage 1 needs `python3 -m "
                                      "fleetctl.cli` to import without paramiko/fabric for an inventory of local "
                                      "hosts only, and the local connection (issue 10)"}
    # The GPU image has no paramiko or Fabric: the CLI must import without them for local hosts.
    r = sh([sys.executable, "-c", "import sys\nfor m in ('paramiko', 'fabric', 'invoke'): sys.modules[m] = None\n"
                                  "import fleetctl.cli"], cwd=str(ROOT), env=env)
    data["cli_imports_without_paramiko"] = r.returncode == 0
    if r.returncode != 0:
        data["cli_import_error_without_paramiko"] = (r.stderr.strip().splitlines() or ["?"])[-1]
    inv_dir = Path(tempfile.mkdtemp(prefix="gpu_check_inv_"))
    inv = inv_dir / "hosts.yaml"
    host = "gpu-check-local"
    inv.write_text("# written by bench/gpu_check: this machine, through fleetctl's local connection\n"
                   f"all:\n  hosts:\n    {host}:\n      ansible_connection: local\n      ansible_host: 127.0.0.1\n"
                   f"      ansible_port: 9\n      fleetctl_python: {sys.executable}\n")
    data["inventory"] = inv.read_text()
    cli = [sys.executable, "-m", "fleetctl.cli"]
    r = sh(cli + ["inspect", host, "-i", str(inv), "--json", "--connect-timeout", "5", "--timeout", "120"],
           timeout=180, cwd=str(ROOT), env=env)
    data["inspect_rc"] = r.returncode
    try:
        h = json.loads(r.stdout)["hosts"][0]
    except (ValueError, KeyError, IndexError):
        h = None
    if h is None:
        why = (r.stderr.strip() or r.stdout.strip())[-600:]
        if r.returncode == 4 and "connection" in why:
            return "skipped", dict(data, skipped=f"fleetctl has no local connection yet (issue 10): the inventory "
                                                 f"with ansible_connection: local was refused: {why}")
        return "failed", dict(data, error=f"fleetctl inspect exit {r.returncode}: {why}")
    data["inspect"] = {k: h.get(k) for k in ("status", "address", "error")}
    if h["status"] == "unreachable":
        return "skipped", dict(data, skipped=f"fleetctl has no local connection yet (issue 10): it ignored "
                                             f"ansible_connection: local and tried SSH to 127.0.0.1:9 ({h['error']})")
    if h["status"] != "ok":
        return "failed", dict(data, error=f"fleetctl inspect through the local connection: {h['status']}: {h['error']}")
    data["local_connection"] = "works: fleetctl inspect reached this machine"
    if cpu and not deploy_here:
        return "skipped", dict(data, skipped="local connection works, but --cpu does not deploy (it would write "
                                             "/var/lib/fleetctl on this machine); pass --deploy-here to run it")
    r = sh(cli + ["deploy", "kernel", "verify_attention", host, "-i", str(inv), "--yes", "--json",
                  "--max-jobs", str(os.cpu_count() or 4), "--build-timeout", "300", "--timeout", "420"],
           timeout=480, cwd=str(ROOT), env=env)
    (out / "stage1_deploy.json").write_text(r.stdout or "")
    data["deploy_rc"] = r.returncode
    try:
        d = json.loads(r.stdout)["hosts"][0]
    except (ValueError, KeyError, IndexError):
        return "failed", dict(data, error=f"deploy exit {r.returncode}: {(r.stderr or r.stdout)[-800:]}")
    data["deploy"] = {k: d.get(k) for k in ("status", "error", "backend", "arch", "build_key", "previous", "reused",
                                            "refusals", "build", "change_id", "elapsed_s")}
    test = d.get("test") or {}
    data["deploy"]["test"] = {k: test.get(k) for k in ("ok", "device", "seed", "failures")}
    checks = {"status_ok": d.get("status") in ("ok", "changed")}
    sys.path.insert(0, str(ROOT / "agent"))
    from fleetctl.engine.kernels.package import build_key, load_package
    from fleetctl.probes.kernel import preflight
    from fleetctl.probes.change.ledger import STATE_DIR

    facts = preflight.gather_facts()
    torch_f, nvcc_f = facts.get("torch") or {}, facts.get("nvcc") or {}
    pkg = load_package(ROOT / "kernels", "verify_attention")
    want_arch = None if cpu else "9.0"
    if not cpu:
        checks["preflight_compute_capability_9_0"] = d.get("arch") == "9.0" and d.get("backend") == "cuda"
    key = build_key(pkg, d.get("backend") or "cpu", torch_f.get("version"), torch_f.get("cuda"), nvcc_f.get("version"),
                    want_arch)
    built = d.get("build_key")            # absent when the deploy failed before reporting one
    checks["build_key_is_for_arch"] = built == key
    data["build_key_recomputed"] = {"arch": want_arch, "key": key}
    checks["reference_test_on_device"] = test.get("ok") is True and test.get("device") == ("cpu" if cpu else "cuda")
    link = Path(STATE_DIR) / "kernels" / "verify_attention" / "current"
    current = os.readlink(link) if link.is_symlink() else None
    data["current"] = current
    checks["current_is_build"] = built is not None and current == built
    checks["current_switched"] = built is not None and d.get("previous") != built and d.get("status") == "changed"
    if built is not None and d.get("previous") == built:
        data["note"] = "the build was already current (a rerun on the same machine): nothing to switch"
    data["checks"] = checks
    return ("ok" if all(checks.values()) else "failed"), data


# --- stage 6 ---------------------------------------------------------------------------------------

NCU_SECTIONS = ("SpeedOfLight", "MemoryWorkloadAnalysis", "Occupancy", "LaunchStats")
NCU_METRICS = ("Duration", "DRAM Throughput", "Memory Throughput", "L2 Cache Throughput", "Compute (SM) Throughput",
               "Achieved Occupancy", "Registers Per Thread", "Grid Size", "Block Size", "Theoretical Occupancy")


def ncu_shapes(goal: dict | None) -> list[tuple[str, dict]]:
    """[(why, shape)]: stage 3's worst shape (lowest fraction of the floor) and its memory-bound shape
    with the most K/V bytes (the same shape once if they coincide); none without stage 3 figures."""
    g = goal or {}
    out = []
    for why, key in (("worst fraction of the floor", "worst"), ("memory-bound, most K/V bytes", "memory_bound_shape")):
        if g.get(key):
            shape = {k: g[key][k] for k in ("B", "T", "P", "G", "D")}
            if all(shape != s for _, s in out):
                out.append((why, shape))
    return out


def stage6(report: Report, backend: str, module_path: str | None, env: dict, left: float, out: Path,
           log) -> tuple[str, dict]:
    """ncu summaries of the new kernel (ncu_target.py) at ncu_shapes(), each within its share of
    min(60 s, what the deadline leaves); OUT/ncu.txt holds every report."""
    import ncu_target

    if not env.get("ncu"):
        return "skipped", {"skipped": "ncu not found"}
    shapes = ncu_shapes(report.doc.get("goal"))
    if not shapes:
        return "skipped", {"skipped": "no stage 3 figures to pick the shapes from"}
    budget = min(60.0, left - 5)
    if budget < 20:
        return "skipped", {"skipped": f"only {left:.0f} s left of the run's deadline"}
    regex = ncu_target.KERNELS[backend]
    runs, text = [], []
    for why, shape in shapes:
        cmd = [env["ncu"], "--clock-control", "none", "--target-processes", "all", "--profile-from-start", "off",
               "-k", regex, *[a for sec in NCU_SECTIONS for a in ("--section", sec)],
               sys.executable, str(HERE / "ncu_target.py"), "--backend", backend,
               *(["--module", module_path] if module_path and backend != "triton" else []),
               *[f"--{k}={shape[k]}" for k in ("B", "T", "P", "G", "D")]]
        r = sh(cmd, timeout=budget / len(shapes), cwd=str(ROOT))
        text.append(f"=== {why}: {shape}\n$ {' '.join(cmd)}\n{r.stdout or ''}"
                    + ("\n--- stderr ---\n" + r.stderr if r.stderr else ""))
        metrics = {name: re.findall(rf"^\s*{re.escape(name)}\s+(\S+)\s+([\d.,]+)\s*$", r.stdout or "", re.M)
                   for name in NCU_METRICS}
        runs.append({"why": why, "shape": shape, "rc": r.returncode, "metrics": metrics,
                     "ok": r.returncode == 0 and any(metrics.values()), "tail": (r.stdout or r.stderr)[-2000:]})
    (out / "ncu.txt").write_text("\n\n".join(text))
    data = {"backend": backend, "runs": runs}
    if not all(x["ok"] for x in runs):
        return "failed", dict(data, error="ncu failed on " + ", ".join(str(x["shape"]) for x in runs if not x["ok"])
                              + " (recorded, not fatal)")
    return "ok", data


# --- the Markdown table ------------------------------------------------------------------------------

def _f(v, fmt):
    return "-" if v is None else format(v, fmt)


def markdown(doc: dict) -> str:
    """gpu_check.md: device, clocks, versions, stage statuses, goal, one row per stage 3 shape, one per
    stage 4 shape, stage 5's sweep."""
    v = doc.get("versions") or {}
    lines = [f"# verify_attention GPU check ({doc.get('mode')})", "",
             f"- device: {doc.get('device_name')}",
             f"- versions: torch {v.get('torch')} (CUDA {v.get('torch_cuda')}), triton {v.get('triton')}, "
             f"nvcc {v.get('nvcc')}, driver {v.get('driver')}, runtime {v.get('runtime')}",
             f"- backends: new kernel {doc.get('backend')}, beside it {doc.get('beside') or 'none'}"]
    clocks = doc.get("clocks") or {}
    if "Clocks" in clocks:
        c, m = clocks.get("Clocks", {}), clocks.get("Max Clocks", {})
        lines.append(f"- clocks at preflight: SM {c.get('SM')}, memory {c.get('Memory')} (max SM {m.get('SM')}, "
                     f"max memory {m.get('Memory')})")
    for name, c in (doc.get("carried") or {}).items():
        lines.append(f"- baseline: SGLang 0.5.23 `{c.get('path_in_wheel')}` sha256 {c.get('sha256')} "
                     f"(carried copy restores to it: {c.get('matches')})")
    for n in sorted(doc.get("stages", {}), key=int):
        s = doc["stages"][n]
        why = s.get("skipped") or s.get("not_needed") or s.get("error") or ""
        lines.append(f"- stage {n} {s.get('name')}: **{s.get('status')}** {why[:300]}".rstrip())
    rates = doc.get("rates") or {}
    if rates.get("copy"):
        lines.append(f"- device-to-device copy: {rates['copy']['gbps_read_plus_write']:.0f} GB/s (read + write); "
                     f"bf16 matmul {rates['matmul']['tflops']:.4g} TFLOP/s")
    g = doc.get("goal")
    if g:
        lines.append(f"- goal per shape ({g.get('per_shape')}): met {g['shapes']['met']}, missed "
                     f"{g['shapes']['missed']}, unmeasured {g['shapes']['unmeasured']}; worst fraction of the floor "
                     f"{_f((g.get('worst') or {}).get('frac_of_floor'), '.3f')} at {g.get('worst')}, median "
                     f"{_f(g.get('median_frac_of_floor'), '.3f')}; >= 3x Triton {g.get('vs_triton')}, >= 1.0x "
                     f"verify_splitkv_fwd {g.get('vs_splitkv')}; met = {g.get('met')}")
    if doc.get("mode") == "cpu":
        lines.append("- --cpu run: CPU backend and the Triton *interpreter*; its times check the script, they "
                     "measure nothing")
    rows = doc.get("shapes") or []
    if rows:
        lines += ["", "| D | G | Hkv | B | T | prefix | T*G | K/V MB | GFLOP | floor ms | kernel ms | of floor | GB/s "
                      "| TFLOP/s | goal ms | goal | other backends ms |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            others = ", ".join(f"{n} {_f(b.get('ms'), '.4f')}" for n, b in r["by_backend"].items() if n != r["backend"])
            lines.append(f"| {r['D']} | {r['G']} | {r['Hkv']} | {r['B']} | {r['T']} | {r['P']} | {r['TG']} | "
                         f"{r['kv_bytes'] / 1e6:.1f} | {r['flops'] / 1e9:.2f} | {_f(r.get('floor_ms'), '.4f')} | "
                         f"{_f(r.get('ms_kernel'), '.4f')} | {_f(r.get('frac_of_floor'), '.3f')} | "
                         f"{_f(r.get('gbps'), '.0f')} | {_f(r.get('tflops'), '.1f')} | {_f(r.get('goal_ms'), '.4f')} | "
                         f"{r.get('goal')} | {others or '-'} |")
    base = doc.get("baselines") or []
    if base:
        lines += ["", "| D | G | B | T | prefix | kernel ms | Triton ms | x Triton | SDPA ms | kernel ms (chain) "
                      "| verify_splitkv ms | x splitkv |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in base:
            lines.append(f"| {r['D']} | {r['G']} | {r['B']} | {r['T']} | {r['P']} | {_f(r.get('ms_kernel'), '.4f')} | "
                         f"{_f(r.get('ms_triton'), '.4f')} | {_f(r.get('speedup_vs_triton'), '.2f')} | "
                         f"{_f(r.get('ms_sdpa'), '.4f')} | {_f(r.get('ms_kernel_chain'), '.4f')} | "
                         f"{_f(r.get('ms_splitkv'), '.4f') if r.get('ms_splitkv') else 'unmeasured'} | "
                         f"{_f(r.get('speedup_vs_splitkv'), '.2f')} |")
    for r in doc.get("splits") or []:
        lines.append(f"- split sweep B {r['B']} T {r['T']} P {r['P']} G {r['G']} D {r['D']}: heuristic "
                     f"{_f(r.get('ms_heuristic'), '.4f')} ms, best fixed {r.get('best_splits')} splits "
                     f"{_f(r.get('ms_best'), '.4f')} ms (x{_f(r.get('heuristic_over_best'), '.2f')}), ok {r.get('ok')}")
    return "\n".join(lines) + "\n"


# --- main ------------------------------------------------------------------------------------------

def parse_stages(numbers: str | None, names: str | None) -> list[int]:
    """--stages 0,2,3 and/or --stage speed,ncu -> sorted stage numbers; ValueError for an unknown one."""
    by_name = {v: k for k, v in STAGES.items()}
    out = set()
    for item in (numbers or "").split(","):
        if item.strip():
            if not item.strip().isdigit() or int(item) not in STAGES:
                raise ValueError(f"unknown stage {item.strip()!r} (stages: {sorted(STAGES)})")
            out.add(int(item))
    for item in (names or "").split(","):
        if item.strip():
            if item.strip() not in by_name:
                raise ValueError(f"unknown stage {item.strip()!r} (stages: {', '.join(STAGES.values())})")
            out.add(by_name[item.strip()])
    return sorted(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="output directory (default: $OUT)")
    ap.add_argument("--stages", help="comma-separated stage numbers to run (default all; others keep their records)")
    ap.add_argument("--stage", help="comma-separated stage names instead (e.g. speed)")
    ap.add_argument("--cpu", action="store_true", help="CPU backend, smallest shapes, Triton under TRITON_INTERPRET=1")
    ap.add_argument("--backend", choices=("triton", "cuda", "cpu"),
                    help="the new kernel (default: triton; --cpu: cpu)")
    ap.add_argument("--beside", help="comma-separated backends measured beside it (default: none; the CUDA v1 "
                                     "kernel beside every shape would not fit the 120 s speed budget)")
    ap.add_argument("--module", help="a prebuilt extension (.so) of the cpu/cuda backend instead of building one")
    ap.add_argument("--build-dir", help="build directory (default build/verify_attention/<backend>-torch<version>)")
    ap.add_argument("--calls", type=int, help="calls per timed replay (default: sized to ~20 ms; --cpu 2)")
    ap.add_argument("--deadline-s", type=float, default=300.0,
                    help="wall seconds for the whole run: no stage starts a shape, and stage 6 no ncu, past it")
    ap.add_argument("--deploy-here", action="store_true", help="with --cpu: let stage 1 deploy to this machine")
    ap.add_argument("--resume-from", help="a gpu_check.json of an earlier run to continue when OUT has none (the "
                                           "device tool empties $OUT on every call: carry the JSON in the tree)")
    a = ap.parse_args(argv)
    t_start = time.monotonic()
    out = Path(a.out or os.environ.get("OUT") or "")
    if not str(out) or str(out) == ".":
        ap.error("no output directory: give --out DIR or set $OUT")
    try:
        stages = parse_stages(a.stages, a.stage) if (a.stages or a.stage) else sorted(STAGES)
    except ValueError as e:
        ap.error(str(e))
    out.mkdir(parents=True, exist_ok=True)
    if a.resume_from and not (out / "gpu_check.json").exists():
        shutil.copyfile(a.resume_from, out / "gpu_check.json")
    if a.cpu:
        os.environ["TRITON_INTERPRET"] = "1"           # before triton is imported anywhere
    sys.path.insert(0, str(HERE))
    log = Log(out)
    mode = "cpu" if a.cpu else "cuda"
    ext = "cpu" if a.cpu else "cuda"                 # the extension this machine builds
    new = a.backend or ("cpu" if a.cpu else "triton")
    beside = [b for b in (a.beside.split(",") if a.beside is not None else [])
              if b and b != new]
    run_id = f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
    report = Report(out, run_id, sys.argv[1:] if argv is None else argv, mode)
    log(f"gpu_check run {run_id}: stages {stages}, mode {mode}, new kernel {new}, beside {beside}, out {out}")

    def left() -> float:
        return a.deadline_s - (time.monotonic() - t_start)

    env = environment(a.cpu)
    import common

    report.doc["device_name"] = env["device_name"]
    report.doc["versions"] = {k: env.get(k) for k in ("python", "torch", "torch_cuda", "triton", "nvcc", "numpy",
                                                      "runtime", "kernel_release")} | {
        "driver": (report.doc.get("versions") or {}).get("driver")}
    report.doc["carried"] = common.carried_sha256()
    report.doc["backend"], report.doc["beside"] = new, beside
    report.save()

    if 0 in stages:
        t0 = time.monotonic()
        report.start(0)
        status, data = stage0(env, a.cpu, out)
        report.doc["clocks"] = data.get("clocks")
        report.doc["versions"]["driver"] = data.get("driver")
        report.finish(0, status, t0, **data)
        log(f"stage 0 preflight: {env['device_name']}, torch {env['torch']}, triton {env['triton']}, "
            f"nvcc {env['nvcc']}, runtime {env['runtime']}")
    cannot = cannot_run(env, a.cpu)

    # The extension build for stages 2-6 starts now, in the background, so that it overlaps stage 1.
    build = None
    gpu_stages = [s for s in GPU_STAGES if s in stages and str(s) not in cannot]
    if gpu_stages and not a.module and ext in [new, *beside]:
        bdir = Path(a.build_dir) if a.build_dir else common.default_build_dir(ext)
        build = common.Build(ext, bdir, None if a.cpu else env.get("compute_capability"))
        log(f"building the {ext} backend in {bdir} (background)")

    if 1 in stages:
        t0 = time.monotonic()
        report.start(1)
        try:
            status, data = stage1(a.cpu, a.deploy_here, out, log)
        except Exception:
            status, data = "failed", {"error": traceback.format_exc()[-3000:]}
        report.finish(1, status, t0, **data)
        log(f"stage 1 deploy: {status} {data.get('skipped') or data.get('error') or data.get('checks') or ''}")

    module_path, build_info = a.module, None
    if build is not None:
        build_info = build.wait(timeout=max(60.0, left() - 30))
        module_path = build_info["module_path"]
        log(f"build: {'ok' if build_info['ok'] else 'FAILED'} in {build_info['seconds']} s")
    triton_note = None
    if a.cpu and env["triton"]:          # the interpreter runs the carried kernels and a triton backend
        import interp_shims
        triton_note = interp_shims.apply()
    backends, load_errors = {}, {}
    aot_dir = None
    if gpu_stages and not a.cpu and "triton" in [new, *beside]:
        # the Triton kernels built ahead of time first, in parallel processes, and loaded as deploy loads them
        import torch
        major, minor = torch.cuda.get_device_capability()
        aot_dir = ROOT / "build" / "verify_attention" / f"triton-sm{major}{minor}"
        try:
            report.doc["aot_build"] = common.aot_build(major * 10 + minor, aot_dir, procs=AOT_PROCS)
            log(f"triton AOT build: {report.doc['aot_build']}")
        except Exception as e:  # noqa: BLE001 - recorded; the triton backend then does not load
            report.doc["aot_build"] = {"error": f"{type(e).__name__}: {e}"[:2000]}
        report.save()
    if gpu_stages:
        for name in [new, *beside]:
            try:
                if name == "triton" and aot_dir is not None and "error" in report.doc["aot_build"]:
                    raise RuntimeError(f"the AOT build failed: {report.doc['aot_build']['error'][:500]}")
                backends[name] = common.load_backend(name, module_path if name == ext else None,
                                                     str(aot_dir) if name == "triton" and aot_dir else None)
            except Exception as e:  # noqa: BLE001 - a backend that does not load is recorded
                load_errors[name] = f"{type(e).__name__}: {e}"[:1000]
                log(f"backend {name}: did not load: {load_errors[name]}")
    report.doc["backend_errors"] = load_errors
    device = "cpu" if a.cpu else "cuda"

    extend_attention_fwd, verify_splitkv_fwd = None, None
    if any(s in stages for s in (2, 4)) and env["triton"]:
        try:
            from carried.extend_attention import extend_attention_fwd
            from carried.verify_splitkv import verify_splitkv_fwd
        except Exception as e:  # noqa: BLE001
            triton_note = f"carried kernels did not import: {type(e).__name__}: {e}"

    ctx = Ctx(report, backends, new, extend_attention_fwd, verify_splitkv_fwd, env, device, a, left, log, triton_note,
              module_path, out)
    for n in RUN_ORDER:
        if n not in stages:
            continue
        t0 = time.monotonic()
        report.start(n)
        if str(n) in cannot:
            report.finish(n, "skipped", t0, skipped=cannot[str(n)])
            log(f"stage {n} {STAGES[n]}: skipped: {cannot[str(n)]}")
            continue
        if new not in backends and n not in (6, 7):
            report.finish(n, "failed", t0, error=f"the new kernel ({new}) did not load: "
                          f"{load_errors.get(new) or 'not built'}", build=build_info)
            log(f"stage {n}: FAILED: the new kernel did not load")
            continue
        try:
            if n == 2:
                import correctness
                log("stage 2 correctness")
                res = correctness.stage2(backends, extend_attention_fwd, verify_splitkv_fwd, device, a.cpu, log,
                                         min(STAGE_BUDGET_S[2], left() - _reserve([4, 5, 6], stages)))
                status = "incomplete" if res["grid"]["not_run"] else ("ok" if res["ok"] else "failed")
                report.finish(2, status, t0, build=build_info, triton=triton_note, **res)
            elif n == 7:
                import route
                log("stage 7 route")
                status, data = route.stage7(module_path, a.cpu, log)
                report.finish(7, status, t0, **data)
                log(f"stage 7 route: {status} {data.get('skipped') or data.get('error') or data.get('checks') or ''}")
            elif n == 6:
                status, data = stage6(report, new, module_path, env, left(), out, log)
                report.finish(6, status, t0, **data)
                log(f"stage 6 ncu: {status} {data.get('skipped') or data.get('error') or ''}")
            else:
                {3: stage3, 4: stage4, 5: stage5}[n](ctx, t0)
        except Exception:
            report.finish(n, "failed", t0, error=traceback.format_exc()[-3000:])
            log(f"stage {n}: FAILED with an exception:\n{traceback.format_exc()[-2000:]}")

    print(markdown(report.doc), flush=True)
    st = report.doc["stages"]
    bad = [n for n in map(str, stages) if st.get(n, {}).get("status") in ("failed", "incomplete", "running")]
    log(f"done in {time.monotonic() - t_start:.0f} s; stages failed: {bad or 'none'}")
    return 1 if bad else 0


class Ctx:
    """What stages 3-5 share: the report, the loaded backends (new kernel first), the baselines, the
    environment, the device, the parsed arguments and the deadline."""

    def __init__(self, report, backends, new, extend_attention_fwd, verify_splitkv_fwd, env, device, args, left, log,
                 triton_note, module_path, out):
        self.report, self.backends, self.new = report, backends, new
        self.extend_attention_fwd, self.verify_splitkv_fwd = extend_attention_fwd, verify_splitkv_fwd
        self.env, self.device, self.args, self.left, self.log = env, device, args, left, log
        self.triton_note, self.module_path, self.out = triton_note, module_path, out
        self.cpu = device == "cpu"
        self.l2 = env.get("l2_bytes") or 0

    def timer(self, cpu_calls: int = 2):
        import speed

        return speed.Timer(self.device, self.args.calls or (cpu_calls if self.cpu else None))

    def rates(self) -> dict:
        """The copy and matmul rates of this run (measured by stage 3, or by the first stage that needs them)."""
        import speed

        r = self.report.doc.get("rates")
        if not r or r.get("run") != self.report.run_id:
            r = {"run": self.report.run_id, "copy": speed.copy_bandwidth(self.device),
                 "matmul": speed.matmul_rate(self.device)}
            self.report.doc["rates"] = r
            self.report.save()
        return r


def _reserve(stages_after: list[int], stages: list[int]) -> float:
    """Seconds to leave for the later stages this run will still start."""
    return sum({4: STAGE_BUDGET_S[4], 5: STAGE_BUDGET_S[5], 6: 45.0}[s] for s in stages_after if s in stages)


def stage3(c: Ctx, t0: float) -> None:
    """Stage 3: every backend's SGLang entry per shape, rows appended to the report as they are timed;
    no shape starts past SPEED_BUDGET_S or when the later stages' reserve is due."""
    import speed

    import torch

    stages = parse_stages(c.args.stages, c.args.stage) if (c.args.stages or c.args.stage) else sorted(STAGES)
    c.report.doc["shapes"], c.report.doc["goal"] = [], None
    rec = c.report.doc["stages"]["3"]
    rates = c.rates()
    c.log(f"stage 3 speed: copy {rates['copy']['gbps_read_plus_write']:.0f} GB/s (read + write), bf16 matmul "
          f"{rates['matmul']['tflops']:.4g} TFLOP/s")
    timer = c.timer()
    todo = speed.shapes(c.cpu)
    reserve = _reserve([4, 5, 6], stages)
    budget = SPEED_BUDGET_S - (c.report.doc.get("aot_build") or {}).get("seconds", 0.0)  # compiles count too
    for i, sh_ in enumerate(todo):
        if time.monotonic() - t0 > budget or c.left() < reserve:
            rec["not_run"] = todo[i:]
            c.log(f"  budget: {len(todo) - i} shapes not run")
            break
        row = speed.speed_shape(c.backends, sh_, c.device, timer, c.l2, c.cpu, rates["copy"], rates["matmul"])
        c.report.doc["shapes"].append(row)
        c.report.doc["goal"] = speed.goal(c.report.doc["shapes"], c.report.doc.get("baselines"), c.cpu)
        c.report.save()
        c.log(f"  D {row['D']} G {row['G']} B {row['B']} T {row['T']} P {row['P']}: {c.new} {row['ms_kernel']:.4f} ms "
              f"= {row['frac_of_floor']:.3f} of the floor ({row['gbps']:.0f} GB/s, {row['tflops']:.1f} TFLOP/s), "
              f"goal {row['goal']}")
    # shapes cut by the budget count as unmeasured, never as met
    c.report.doc["goal"] = speed.goal(c.report.doc["shapes"], c.report.doc.get("baselines"), c.cpu, rec.get("not_run"))
    if c.device == "cuda" and shutil.which("nvidia-smi"):
        r = sh(["nvidia-smi", "-q", "-d", "CLOCK"], timeout=30)
        rec["clocks_after"] = parse_clocks(r.stdout) if r.returncode == 0 else None
    rows = c.report.doc["shapes"]
    disagree = [{k: r[k] for k in ("B", "T", "P", "G", "D", "agree")} for r in rows
                if any(not v["ok"] for v in r["agree"].values()) or r["correct"] is False]
    status = "ok" if len(rows) == len(todo) and not disagree else ("failed" if disagree else "incomplete")
    c.report.finish(3, status, t0, shapes_timed=len(rows), shapes_planned=len(todo), disagreements=disagree,
                    torch_threads=torch.get_num_threads())


def stage4(c: Ctx, t0: float) -> None:
    """Stage 4: the baselines at 16k and 64k (--cpu: its shapes), against stage 3's kernel times."""
    import speed

    rec = c.report.doc["stages"]["4"]
    rec["triton"] = c.triton_note
    stages = parse_stages(c.args.stages, c.args.stage) if (c.args.stages or c.args.stage) else sorted(STAGES)
    kernel_ms = {tuple(r[k] for k in ("B", "T", "P", "G", "D")): r["ms_kernel"]
                 for r in c.report.doc.get("shapes") or []}
    todo = [s for s in speed.shapes(c.cpu) if c.cpu or s["P"] in speed.BASELINE_PREFIXES]
    if c.cpu:
        todo = todo[:1]                 # the interpreter takes seconds per verify_splitkv call
    c.report.doc["baselines"] = []
    timer = speed.Timer(c.device, c.args.calls or (1 if c.cpu else None), cpu_reps=1)
    reserve = _reserve([5, 6], stages)
    for i, sh_ in enumerate(todo):
        if time.monotonic() - t0 > STAGE_BUDGET_S[4] or c.left() < reserve:
            rec["not_run"] = todo[i:]
            c.log(f"  budget: {len(todo) - i} baseline shapes not run")
            break
        row = speed.baseline_shape(c.backends[c.new], c.extend_attention_fwd, c.verify_splitkv_fwd, sh_, c.device,
                                   timer, c.l2, c.cpu, kernel_ms.get(tuple(sh_[k] for k in ("B", "T", "P", "G", "D"))))
        c.report.doc["baselines"].append(row)
        c.report.doc["goal"] = speed.goal(c.report.doc.get("shapes") or [], c.report.doc["baselines"], c.cpu,
                                          c.report.doc["stages"].get("3", {}).get("not_run"))
        c.report.save()
        c.log(f"  D {row['D']} G {row['G']} B {row['B']} T {row['T']} P {row['P']}: triton "
              f"{_f(row.get('ms_triton'), '.4f')} ms ({_f(row.get('speedup_vs_triton'), '.2f')}x), verify_splitkv "
              f"{_f(row.get('ms_splitkv'), '.4f')} ms ({_f(row.get('speedup_vs_splitkv'), '.2f')}x"
              f"{', ' + row['error_splitkv'][:120] if row.get('error_splitkv') else ''}), sdpa "
              f"{_f(row.get('ms_sdpa'), '.4f')} ms")
    rows = c.report.doc["baselines"]
    status = "ok" if len(rows) == len(todo) else "incomplete"
    errors = {n: sorted({r[f"error_{n}"] for r in rows if r.get(f"error_{n}")}) for n in ("triton", "splitkv", "sdpa")}
    if c.extend_attention_fwd is None:
        status = "failed"
        rec["error"] = f"no Triton baseline: {c.triton_note or 'triton is not importable'}"
    c.report.finish(4, status, t0, shapes_timed=len(rows), shapes_planned=len(todo),
                    baseline_errors={n: e for n, e in errors.items() if e})


def stage5(c: Ctx, t0: float) -> None:
    """Stage 5: the split sweep at speed.sweep_shapes()."""
    import speed

    stages = parse_stages(c.args.stages, c.args.stage) if (c.args.stages or c.args.stage) else sorted(STAGES)
    rec = c.report.doc["stages"]["5"]
    c.report.doc["splits"] = []
    timer = speed.Timer(c.device, c.args.calls or (1 if c.cpu else None), cpu_reps=1)
    todo = speed.sweep_shapes(c.cpu)
    for i, sh_ in enumerate(todo):
        if time.monotonic() - t0 > STAGE_BUDGET_S[5] or c.left() < _reserve([6], stages):
            rec["not_run"] = todo[i:]
            break
        row = speed.split_sweep(c.backends[c.new], sh_, c.device, timer, c.l2, c.cpu)
        c.report.doc["splits"].append(row)
        c.report.save()
        c.log(f"  sweep D {row['D']} G {row['G']} B {row['B']} T {row['T']} P {row['P']}: heuristic "
              f"{row['ms_heuristic']:.4f} ms, best {row['best_splits']} splits {row['ms_best']:.4f} ms")
    rows = c.report.doc["splits"]
    if c.cpu:
        rec["note"] = "--cpu: the CPU backend ignores num_splits; the sweep checks the script, it judges nothing"
    bad = [r for r in rows if r["ok"] is False]
    status = "failed" if bad else ("ok" if len(rows) == len(todo) else "incomplete")
    c.report.finish(5, status, t0, shapes_timed=len(rows), heuristic_within_10pct=None if c.cpu else not bad)


if __name__ == "__main__":
    sys.exit(main())
