"""GPU proof of kernels/verify_attention in one command: bash bench/gpu_check.sh [--stages 0,1,2,3,4] [--cpu].

Stages (each appends its part to OUT/gpu_check.json as it finishes, and OUT/gpu_check.md is
rewritten beside it, so a run killed at its time limit still returns what it finished; a stage
that was running when the run died reads "running"; `--stages 2,3` reruns only those and keeps
the others' records; where OUT starts empty, as on the device machine, `--resume-from PATH` starts
from an earlier run's gpu_check.json carried in the tree):

  0 preflight    nvidia-smi (name, compute capability, `nvidia-smi -q -d CLOCK`), torch / CUDA /
                 triton / nvcc / driver versions, runtime kind (gVisor or Firecracker, from the
                 kernel release), free disk and GPU memory, ncu; says which stages cannot run here.
  1 deploy       `PYTHONPATH=agent python3 -m fleetctl.cli deploy kernel verify_attention HOST -i INV
                 --yes --json` against this machine through an inventory host with
                 `ansible_connection: local` (see stage1). Skipped, saying why, while fleetctl has
                 no local connection (issue 10) or its CLI does not import here (no paramiko).
  2 correctness  the kernel against the float64 reference over the grid, CUDA graph replay, the
                 two baselines against the reference (correctness.py).
  3 speed        kernel vs SGLang 0.5.23's Triton target-verify kernel vs gather + SDPA (speed.py).
  4 ncu          if stage 3 is short of the goal: one `ncu --clock-control none` summary of the
                 kernel at the 64k shape with the most K/V bytes, under 60 s; a failure is recorded.

Stages 2-4 build the kernel themselves (in build/verify_attention/, started in the background before
stage 1) and never use fleetctl's transport. --cpu: the CPU backend, the smallest shapes, and the
carried Triton kernel under TRITON_INTERPRET=1 (for the CPU test, tests/machine/test_gpu_check.py).
OUT is --out, else $OUT. Files written there: gpu_check.json, gpu_check.md, gpu_check.log,
stage1_deploy.json (stage 1's fleetctl output), ncu.txt (stage 4).
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
STAGES = {0: "preflight", 1: "deploy", 2: "correctness", 3: "speed", 4: "ncu"}
SCHEMA = "fleetctl-gpu-check/1"


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


class Report:
    """OUT/gpu_check.json: one document, rewritten atomically (temp file + rename) after every change.

    {"schema", "mode", "device_name", "clocks", "versions", "carried", "runs": [...],
     "stages": {"0": {"name", "status", "run", "started", "finished", "seconds", ...}, ...},
     "shapes": [stage 3 rows], "goal": {...}}
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
                   "carried": None, "runs": [], "stages": {}, "shapes": [], "goal": None}
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
        return {"4": "--cpu: no GPU to profile"}
    if not env["cuda_available"]:
        return {s: "no CUDA device (torch.cuda.is_available() is False); --cpu checks the CPU backend"
                for s in ("2", "3", "4")}
    if not env["nvcc"]:
        return {s: "no nvcc: the CUDA backend cannot be built" for s in ("2", "3", "4")}
    if not env["ncu"]:
        return {"4": "ncu not found (PATH, /usr/local/cuda/bin, /opt/nvidia/nsight-compute/*/)"}
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
    from fleetctl.engine.kernelpkg import build_key, load_package
    from fleetctl.probes import kbuild
    from fleetctl.probes.ledger import STATE_DIR

    facts = kbuild.gather_facts()
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


# --- stage 4 ---------------------------------------------------------------------------------------

def stage4(report: Report, module_path: str | None, env: dict, left: float, out: Path, log) -> tuple[str, dict]:
    """One ncu summary of the kernel at the 64k shape with the most K/V bytes (ncu_target.py)."""
    g = report.doc.get("goal") or {}
    if g.get("met") is True and report.doc["stages"].get("3", {}).get("status") == "ok":
        return "not_needed", {"not_needed": "stage 3 met the goal"}
    if not env.get("ncu"):
        return "skipped", {"skipped": "ncu not found"}
    if not module_path:
        return "skipped", {"skipped": "the kernel was not built"}
    budget = min(60.0, left - 5)
    if budget < 20:
        return "skipped", {"skipped": f"only {left:.0f} s left of the run's deadline"}
    shape = g.get("bandwidth_shape") or {"B": 8, "T": 64, "P": 65536, "G": 1, "D": 256}
    cmd = [env["ncu"], "--clock-control", "none", "--target-processes", "all", "-k", "regex:split_kernel|merge_kernel",
           "--launch-skip", "2", "--launch-count", "2", "--section", "SpeedOfLight", "--section", "MemoryWorkloadAnalysis",
           "--section", "Occupancy", "--section", "LaunchStats",
           sys.executable, str(HERE / "ncu_target.py"), "--module", module_path,
           *[f"--{k}={shape[k]}" for k in ("B", "T", "P", "G", "D")]]
    r = sh(cmd, timeout=budget, cwd=str(ROOT))
    text = (r.stdout or "") + ("\n--- stderr ---\n" + r.stderr if r.stderr else "")
    (out / "ncu.txt").write_text(text)
    metrics = {}
    for name in ("Duration", "DRAM Throughput", "Memory Throughput", "L2 Cache Throughput", "Compute (SM) Throughput",
                 "Achieved Occupancy", "Registers Per Thread", "Grid Size", "Block Size", "Theoretical Occupancy"):
        metrics[name] = re.findall(rf"^\s*{re.escape(name)}\s+(\S+)\s+([\d.,]+)\s*$", r.stdout or "", re.M)
    data = {"cmd": " ".join(cmd), "rc": r.returncode, "shape": shape, "metrics": metrics, "tail": text[-3000:]}
    if r.returncode != 0 or not any(metrics.values()):
        return "failed", dict(data, error=f"ncu exit {r.returncode} (recorded, not fatal)")
    return "ok", data


# --- the Markdown table ------------------------------------------------------------------------------

def _f(v, fmt):
    return "-" if v is None else format(v, fmt)


def markdown(doc: dict) -> str:
    """gpu_check.md: device, clocks, versions, stage statuses, goal, one row per stage 3 shape."""
    v = doc.get("versions") or {}
    lines = [f"# verify_attention GPU check ({doc.get('mode')})", "",
             f"- device: {doc.get('device_name')}",
             f"- versions: torch {v.get('torch')} (CUDA {v.get('torch_cuda')}), triton {v.get('triton')}, "
             f"nvcc {v.get('nvcc')}, driver {v.get('driver')}, runtime {v.get('runtime')}"]
    clocks = doc.get("clocks") or {}
    if "Clocks" in clocks:
        c, m = clocks.get("Clocks", {}), clocks.get("Max Clocks", {})
        lines.append(f"- clocks at preflight: SM {c.get('SM')}, memory {c.get('Memory')} (max SM {m.get('SM')}, "
                     f"max memory {m.get('Memory')})")
    carried = doc.get("carried") or {}
    if carried:
        lines.append(f"- baseline: SGLang 0.5.23 `{carried.get('path_in_wheel')}` sha256 {carried.get('sha256')} "
                     f"(carried copy restores to it: {carried.get('matches')})")
    for n in sorted(doc.get("stages", {}), key=int):
        s = doc["stages"][n]
        why = s.get("skipped") or s.get("not_needed") or s.get("error") or ""
        lines.append(f"- stage {n} {s.get('name')}: **{s.get('status')}** {why[:300]}".rstrip())
    s3 = doc.get("stages", {}).get("3", {})
    if s3.get("copy"):
        lines.append(f"- device-to-device copy: {s3['copy']['gbps_read_plus_write']:.0f} GB/s (read + write)")
    g = doc.get("goal")
    if g:
        lines.append(f"- goal (>= 3x Triton at 4k-64k; 64k K/V read rate >= 0.5 x copy): met = {g.get('met')}; "
                     f"min speedup {_f(g.get('min_speedup_vs_triton'), '.2f')}x; "
                     f"64k rate / copy {_f(g.get('bandwidth_frac_of_copy'), '.2f')}")
    if doc.get("mode") == "cpu":
        lines.append("- --cpu run: CPU backend and the Triton *interpreter*; its times check the script, they "
                     "measure nothing")
    rows = doc.get("shapes") or []
    if rows:
        lines += ["", "| D | G | Hkv | B | T | prefix | K/V MB | kernel ms | Triton ms | SDPA ms | x Triton | x SDPA "
                      "| GB/s | correct |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['D']} | {r['G']} | {r['Hkv']} | {r['B']} | {r['T']} | {r['P']} | "
                         f"{r['kv_bytes'] / 1e6:.1f} | {_f(r.get('ms_kernel'), '.4f')} | {_f(r.get('ms_triton'), '.4f')} | "
                         f"{_f(r.get('ms_sdpa'), '.4f')} | {_f(r.get('speedup_vs_triton'), '.2f')} | "
                         f"{_f(r.get('speedup_vs_sdpa'), '.2f')} | {_f(r.get('hbm_gbps'), '.0f')} | {r.get('correct')} |")
    return "\n".join(lines) + "\n"


# --- main ------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="output directory (default: $OUT)")
    ap.add_argument("--stages", default="0,1,2,3,4", help="comma-separated stages to run (others keep their records)")
    ap.add_argument("--cpu", action="store_true", help="CPU backend, smallest shapes, Triton under TRITON_INTERPRET=1")
    ap.add_argument("--module", help="a prebuilt extension (.so) for stages 2-4 instead of building one")
    ap.add_argument("--build-dir", help="build directory (default build/verify_attention/<backend>-torch<version>)")
    ap.add_argument("--calls", type=int, help="calls per timed replay (default 100; --cpu 2)")
    ap.add_argument("--deadline-s", type=float, default=380.0,
                    help="wall seconds for the whole run: stage 3 starts no shape, stage 4 no ncu, past it")
    ap.add_argument("--deploy-here", action="store_true", help="with --cpu: let stage 1 deploy to this machine")
    ap.add_argument("--resume-from", help="a gpu_check.json of an earlier run to continue when OUT has none (the "
                                           "device tool empties $OUT on every call: carry the JSON in the tree)")
    a = ap.parse_args(argv)
    t_start = time.monotonic()
    out = Path(a.out or os.environ.get("OUT") or "")
    if not str(out) or str(out) == ".":
        ap.error("no output directory: give --out DIR or set $OUT")
    out.mkdir(parents=True, exist_ok=True)
    if a.resume_from and not (out / "gpu_check.json").exists():
        shutil.copyfile(a.resume_from, out / "gpu_check.json")
    try:
        stages = sorted({int(s) for s in a.stages.split(",") if s.strip()})
    except ValueError:
        ap.error(f"--stages: {a.stages!r} is not a list of stage numbers")
    if not set(stages) <= set(STAGES):
        ap.error(f"--stages: unknown stage in {a.stages!r} (stages: 0-4)")
    if a.cpu:
        os.environ["TRITON_INTERPRET"] = "1"           # before triton is imported anywhere
    sys.path.insert(0, str(HERE))
    log = Log(out)
    mode = "cpu" if a.cpu else "cuda"
    run_id = f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
    report = Report(out, run_id, sys.argv[1:] if argv is None else argv, mode)
    log(f"gpu_check run {run_id}: stages {stages}, mode {mode}, out {out}")

    def left() -> float:
        return a.deadline_s - (time.monotonic() - t_start)

    env = environment(a.cpu)
    import common

    report.doc["device_name"] = env["device_name"]
    report.doc["versions"] = {k: env.get(k) for k in ("python", "torch", "torch_cuda", "triton", "nvcc", "numpy",
                                                      "runtime", "kernel_release")} | {
        "driver": (report.doc.get("versions") or {}).get("driver")}
    report.doc["carried"] = common.carried_sha256()
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

    # The build for stages 2-4 starts now, in the background, so that it overlaps stage 1.
    build = None
    gpu_stages = [s for s in (2, 3, 4) if s in stages and str(s) not in cannot]
    if gpu_stages and not a.module:
        backend = "cpu" if a.cpu else "cuda"
        bdir = Path(a.build_dir) if a.build_dir else common.default_build_dir(backend)
        build = common.Build(backend, bdir, None if a.cpu else env.get("compute_capability"))
        log(f"building the {backend} backend in {bdir} (background)")

    if 1 in stages:
        t0 = time.monotonic()
        report.start(1)
        try:
            status, data = stage1(a.cpu, a.deploy_here, out, log)
        except Exception:
            status, data = "failed", {"error": traceback.format_exc()[-3000:]}
        report.finish(1, status, t0, **data)
        log(f"stage 1 deploy: {status} {data.get('skipped') or data.get('error') or data.get('checks') or ''}")

    module_path, mod, build_info = a.module, None, None
    if build is not None:
        build_info = build.wait(timeout=max(60.0, left() - 30))
        module_path = build_info["module_path"]
        log(f"build: {'ok' if build_info['ok'] else 'FAILED'} in {build_info['seconds']} s")
    if module_path:
        mod = common.load_module(module_path)
    device = "cpu" if a.cpu else "cuda"

    extend_attention_fwd, triton_note = None, None
    if any(s in stages for s in (2, 3)) and env["triton"]:
        try:
            if a.cpu:
                import interp_shims
                triton_note = interp_shims.apply()
            from carried.extend_attention import extend_attention_fwd
        except Exception as e:  # noqa: BLE001
            triton_note = f"carried kernel did not import: {type(e).__name__}: {e}"

    for n in (2, 3):
        if n not in stages:
            continue
        t0 = time.monotonic()
        report.start(n)
        if str(n) in cannot:
            report.finish(n, "skipped", t0, skipped=cannot[str(n)])
            log(f"stage {n}: skipped: {cannot[str(n)]}")
            continue
        if mod is None:
            report.finish(n, "failed", t0, error="the kernel did not build", build=build_info)
            log(f"stage {n}: FAILED: the kernel did not build")
            continue
        try:
            if n == 2:
                import correctness
                log("stage 2 correctness")
                res = correctness.stage2(mod, extend_attention_fwd, device, a.cpu, log)
                report.finish(2, "ok" if res["ok"] else "failed", t0, build=build_info, triton=triton_note, **res)
            else:
                stage3(report, mod, extend_attention_fwd, env, device, a, left, stages, log, t0, triton_note)
        except Exception:
            report.finish(n, "failed", t0, error=traceback.format_exc()[-3000:])
            log(f"stage {n}: FAILED with an exception:\n{traceback.format_exc()[-2000:]}")

    if 4 in stages:
        t0 = time.monotonic()
        report.start(4)
        if "4" in cannot:
            status, data = "skipped", {"skipped": cannot["4"]}
        else:
            try:
                status, data = stage4(report, module_path, env, left(), out, log)
            except Exception:
                status, data = "failed", {"error": traceback.format_exc()[-3000:]}
        report.finish(4, status, t0, **data)
        log(f"stage 4 ncu: {status} {data.get('skipped') or data.get('not_needed') or data.get('error') or ''}")

    print(markdown(report.doc), flush=True)
    st = report.doc["stages"]
    bad = [n for n in map(str, stages) if st.get(n, {}).get("status") in ("failed", "incomplete", "running")]
    log(f"done in {time.monotonic() - t_start:.0f} s; stages failed: {bad or 'none'}")
    return 1 if bad else 0


def stage3(report: Report, mod, extend_attention_fwd, env: dict, device: str, a, left, stages, log, t0,
           triton_note) -> None:
    """Stage 3, appending each shape's row to the report as it is timed."""
    import speed

    import torch

    report.doc["shapes"] = []
    report.doc["goal"] = None
    rec = report.doc["stages"]["3"]
    rec["triton"] = triton_note
    copy = speed.copy_bandwidth(device)
    rec["copy"] = copy
    log(f"stage 3 speed: copy {copy['gbps_read_plus_write']:.0f} GB/s (read + write)")
    report.save()
    calls = a.calls or (2 if a.cpu else 100)
    reserve = 70.0 if 4 in stages else 5.0
    todo = speed.shapes(a.cpu)
    for i, sh_ in enumerate(todo):
        if left() < reserve:
            rec["not_run"] = todo[i:]
            log(f"  deadline: {len(todo) - i} shapes not run")
            break
        row = speed.run_shape(mod, extend_attention_fwd, sh_, device, calls, env.get("l2_bytes") or 0, a.cpu)
        report.doc["shapes"].append(row)
        report.doc["goal"] = speed.goal(report.doc["shapes"], copy)
        report.save()
        log(f"  D {row['D']} G {row['G']} B {row['B']} T {row['T']} P {row['P']}: kernel {row['ms_kernel']:.4f} ms, "
            f"triton {_f(row.get('ms_triton'), '.4f')} ms, sdpa {row['ms_sdpa']:.4f} ms, "
            f"{_f(row.get('speedup_vs_triton'), '.2f')}x, {row['hbm_gbps']:.0f} GB/s, correct {row['correct']}")
    if device == "cuda" and shutil.which("nvidia-smi"):
        c = sh(["nvidia-smi", "-q", "-d", "CLOCK"], timeout=30)
        rec["clocks_after"] = parse_clocks(c.stdout) if c.returncode == 0 else None
    rows = report.doc["shapes"]
    complete = len(rows) == len(todo)
    kernel_correct = all(r["correct"] for r in rows)
    # A baseline outside kernel.yaml's tolerance is reported, not a failure of this kernel (stage 2
    # already checked the Triton call's set-up against the reference); each row says which.
    rec["baseline_disagreements"] = [
        {k: r[k] for k in ("B", "T", "P", "G", "D", "max_abs_err")} for r in rows
        if r.get("triton_correct") is False or r.get("sdpa_correct") is False]
    status = "ok" if complete and kernel_correct else ("failed" if not kernel_correct else "incomplete")
    if extend_attention_fwd is None:
        status = "failed"
        rec["error"] = f"no Triton baseline: {triton_note or 'triton is not importable'}"
    report.finish(3, status, t0, shapes_timed=len(rows), shapes_planned=len(todo), calls=calls, torch_threads=
                  torch.get_num_threads())


if __name__ == "__main__":
    sys.exit(main())
