"""Shared pieces of the GPU check: paths, kernel.yaml tolerances, the extension build, random inputs.

Inputs follow kernels/verify_attention/reference.py's layout (q [B*T, Hq, D], k_cache/v_cache
[num_slots, Hkv, D], req_to_token [max_reqs, max_ctx], req_pool_indices [B], prefix_lens [B],
tree_mask [T, T] or [B, T, T], sm_scale = D ** -0.5), drawn on the target device with a seeded
generator (a 64k-token prefix would take seconds to draw on the host and copy).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[2]          # the repository
HERE = Path(__file__).resolve().parent               # bench/gpu_check
PKG = ROOT / "kernels" / "verify_attention"
CARRIED = HERE / "carried"

sys.path.insert(0, str(PKG))
from reference import tree_mask_from_parents, verify_attention_ref  # noqa: E402,F401
from sglang_layout import target_verify_args  # noqa: E402,F401


def kernel_spec() -> dict:
    """kernel.yaml of verify_attention (read with PyYAML: stages 2-4 never import fleetctl)."""
    return yaml.safe_load((PKG / "kernel.yaml").read_text())


def tolerances() -> dict[str, tuple[float, float]]:
    """{dtype name: (atol, rtol)} from kernel.yaml: |out - ref| <= atol + rtol * |ref| elementwise."""
    return {k: (float(v["atol"]), float(v["rtol"])) for k, v in kernel_spec()["tolerances"].items()}


def compare(got: torch.Tensor, want: torch.Tensor, dtype: str) -> dict:
    """got (any dtype) against the float64 reference with kernel.yaml's tolerance for `dtype`.

    Returns {"ok", "max_abs_err", "rel_l2_err", "finite"}; NaN/inf never pass.
    """
    atol, rtol = tolerances()[dtype]
    g = got.double()
    err = (g - want).abs()
    finite = bool(torch.isfinite(g).all())
    ok = finite and bool((err <= atol + rtol * want.abs()).all())
    denom = float(want.norm()) or 1.0
    return {"ok": ok, "max_abs_err": float(err.max()) if err.numel() else 0.0,
            "rel_l2_err": float((g - want).norm()) / denom if finite else None, "finite": finite}


def carried_sha256() -> dict:
    """{carried file: its record}: sha256 of each carried SGLang file with its import lines restored,
    against ORIGIN.json ({"wheel", "files": {name: {"path_in_wheel", "sha256", "caller"}}, "changes"}).

    Every line the stub replaced ends with "# fleetctl-carried: was `ORIGINAL`"; putting ORIGINAL
    back must give the wheel's file byte for byte, so "matches" proves nothing else was changed.
    """
    origin = json.loads((CARRIED / "ORIGIN.json").read_text())
    marker = "  # fleetctl-carried: was `"
    out = {}
    for name, rec in origin["files"].items():
        lines, replaced = [], 0
        for line in (CARRIED / name).read_text().split("\n"):
            if marker in line and line.endswith("`"):
                line = line.split(marker, 1)[1][:-1]
                replaced += 1
            lines.append(line)
        sha = hashlib.sha256("\n".join(lines).encode()).hexdigest()
        out[name] = {"wheel": origin["wheel"], "path_in_wheel": rec["path_in_wheel"], "sha256": rec["sha256"],
                     "sha256_restored": sha, "matches": sha == rec["sha256"], "import_lines_replaced": replaced}
    return out


# --- the extension build ---------------------------------------------------------------------------

_BUILD = r"""
import fcntl, json, os, sys
a = json.loads(sys.argv[1])
lock = open(a["build_dir"].rstrip("/") + ".lock", "w")
fcntl.flock(lock, fcntl.LOCK_EX)          # one gpu_check build of this directory at a time
stale = os.path.join(a["build_dir"], "lock")
if os.path.exists(stale):                 # torch's own lock, left behind by a killed build
    os.unlink(stale)
from torch.utils.cpp_extension import load
m = load(name=a["name"], sources=a["sources"], extra_cflags=a["cflags"], extra_cuda_cflags=a["cuda_cflags"],
         extra_ldflags=a["ldflags"], build_directory=a["build_dir"], verbose=True)
with open(a["result"], "w") as f:
    json.dump({"module_path": m.__file__}, f)
"""


class Build:
    """The kernel's backend built with torch.utils.cpp_extension.load in a child process, started at
    once so that it can overlap stage 1. build_dir persists between runs (ninja rebuilds only what
    changed; the test suite passes its one CPU build's directory, made by the kbuild probe with the
    same name and flags, as --build-dir, so one build serves both); arch is TORCH_CUDA_ARCH_LIST (e.g. "9.0"), None
    for the cpu backend. Under an flock on BUILD_DIR.lock, a torch `lock` file left by a killed
    build is removed first (torch would wait on it forever)."""

    def __init__(self, backend: str, build_dir: Path, arch: str | None):
        spec = kernel_spec()
        b = spec["backends"][backend]
        self.backend, self.build_dir = backend, Path(build_dir)
        self.build_dir.mkdir(parents=True, exist_ok=True)
        self.result = self.build_dir / "build-result.json"
        if self.result.exists():
            self.result.unlink()
        self.log_path = self.build_dir / "build.log"
        args = {"name": f"{spec['name']}_{backend}", "build_dir": str(self.build_dir), "result": str(self.result),
                "sources": [str(PKG / s) for s in b["sources"]], "cflags": b.get("cflags", []),
                "cuda_cflags": b.get("cuda_cflags", []), "ldflags": b.get("ldflags", [])}
        env = dict(os.environ, MAX_JOBS=str(os.cpu_count() or 1))
        env.pop("TORCH_CUDA_ARCH_LIST", None)
        if arch:
            env["TORCH_CUDA_ARCH_LIST"] = arch
        self.arch = arch
        self.started = time.monotonic()
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen([sys.executable, "-c", _BUILD, json.dumps(args)], stdin=subprocess.DEVNULL,
                                     stdout=self._log, stderr=subprocess.STDOUT, cwd=self.build_dir, env=env,
                                     start_new_session=True)
        self.outcome: dict | None = None

    def wait(self, timeout: float) -> dict:
        """{"ok", "module_path", "seconds", "log_path", "log_tail" (failure only), "arch"}; kills it at timeout."""
        if self.outcome is not None:
            return self.outcome
        try:
            rc = self.proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
            rc = self.proc.wait()
        self._log.close()
        out = {"ok": rc == 0 and self.result.exists(), "rc": rc, "seconds": round(time.monotonic() - self.started, 1),
               "log_path": str(self.log_path), "arch": self.arch, "backend": self.backend, "module_path": None}
        if out["ok"]:
            out["module_path"] = json.loads(self.result.read_text())["module_path"]
        else:
            out["log_tail"] = self.log_path.read_bytes()[-3000:].decode("utf-8", "replace")
        self.outcome = out
        return out


def default_build_dir(backend: str) -> Path:
    """build/verify_attention/<backend>-torch<version> in the repository (git-ignored)."""
    return ROOT / "build" / "verify_attention" / f"{backend}-torch{torch.__version__}"


def load_module(path: str):
    """Import a built extension from its file (the module name is the file name up to the first dot)."""
    import importlib.util

    name = Path(path).name.split(".")[0]
    spec = importlib.util.spec_from_file_location(name, str(path))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# --- inputs ----------------------------------------------------------------------------------------

def parents_for(kind: str, T: int, gen: torch.Generator) -> list[int]:
    """A draft tree as a parent list (parents[i] < i, -1 for the root): "random" (BFS order, root 0),
    "chain" (each token the child of the one before: a causal mask) or "star" (all children of 0)."""
    if kind == "chain":
        return [i - 1 for i in range(T)]
    if kind == "star":
        return [-1] + [0] * (T - 1)
    return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, T)]


def make_inputs(B: int, T: int, prefix_lens: list[int], Hkv: int, G: int, D: int, dtype: torch.dtype,
                device: str, seed: int, r2t_dtype=torch.int32, shared_mask: bool = False,
                tree: str = "random", buffers: int = 1) -> dict:
    """Random kernel inputs on `device`; slots are a random permutation of a cache a little larger
    than needed, rows of req_to_token a random pick. With buffers > 1, "k_caches"/"v_caches" hold
    that many independent caches (same slots, different memory) and k_cache/v_cache are the first."""
    host = torch.Generator().manual_seed(seed)
    dev = torch.Generator(device=device).manual_seed(seed)
    lens = [p + T for p in prefix_lens]
    num_slots = sum(lens) + 7
    perm = torch.randperm(num_slots, generator=dev, device=device)
    max_reqs, max_ctx = B + 2, max(lens) + 3
    req_to_token = torch.zeros(max_reqs, max_ctx, dtype=r2t_dtype, device=device)
    rows = torch.randperm(max_reqs, generator=host)[:B]
    start = 0
    for b, n in enumerate(lens):
        req_to_token[int(rows[b]), :n] = perm[start:start + n].to(r2t_dtype)
        start += n
    masks = [tree_mask_from_parents(parents_for(tree, T, host)) for _ in range(1 if shared_mask else B)]
    mask = masks[0] if shared_mask else torch.stack(masks)

    def randn(*shape):
        return torch.randn(*shape, generator=dev, device=device, dtype=torch.float32).to(dtype)

    k_caches = [randn(num_slots, Hkv, D) for _ in range(buffers)]
    v_caches = [randn(num_slots, Hkv, D) for _ in range(buffers)]
    x = dict(q=randn(B * T, Hkv * G, D), k_cache=k_caches[0], v_cache=v_caches[0],
             req_to_token=req_to_token, req_pool_indices=rows.to(device),
             prefix_lens=torch.tensor(prefix_lens, dtype=torch.int64, device=device),
             tree_mask=mask.to(device), sm_scale=D ** -0.5)
    if buffers > 1:
        x["k_caches"], x["v_caches"] = k_caches, v_caches
    return x


KERNEL_ARGS = ("q", "k_cache", "v_cache", "req_to_token", "req_pool_indices", "prefix_lens", "tree_mask", "sm_scale")


def kargs(x: dict) -> dict:
    """The kernel's (and the reference's) keyword arguments out of an inputs dict."""
    return {k: x[k] for k in KERNEL_ARGS}


def kv_bytes(prefix_lens: list[int], T: int, Hkv: int, D: int, dtype: torch.dtype) -> int:
    """K and V bytes one call must read at least: every visible key and value once per KV head."""
    elem = torch.empty((), dtype=dtype).element_size()
    return sum(p + T for p in prefix_lens) * Hkv * D * 2 * elem


def flops(prefix_lens: list[int], T: int, Hq: int, D: int) -> int:
    """Matrix FLOPs of one call: QK^T and PV, 2 * D each per (query row, key), every key of the
    request counted (the tree mask hides at most T - 1 of P + T), so T*G FLOP per K/V byte in bf16."""
    return sum(4 * T * Hq * (p + T) * D for p in prefix_lens)


# The per-shape goal (issue 27, "Numbers"): t <= max(bytes / (GOAL_COPY_FRAC x copy rate),
# FLOPs / GOAL_TFLOPS) + GOAL_SLACK_MS.
GOAL_COPY_FRAC, GOAL_TFLOPS, GOAL_SLACK_MS = 0.5, 200.0, 0.010


def roofline(nbytes: int, nflops: int, ms: float | None, copy_gbps: float, matmul_tflops: float) -> dict:
    """One timing against the device's measured limits.

    floor_ms = max(bytes / copy rate, FLOPs / bf16 matmul rate) (the copy rate is read + write, as
    measured by speed.copy_bandwidth); frac_of_floor = floor_ms / ms; gbps = bytes / ms;
    tflops = FLOPs / ms; goal_ms as GOAL_*; goal "met" / "missed", or "unmeasured" without a time.
    """
    floor = max(nbytes / (copy_gbps * 1e6), nflops / (matmul_tflops * 1e9))
    goal_ms = max(nbytes / (GOAL_COPY_FRAC * copy_gbps * 1e6), nflops / (GOAL_TFLOPS * 1e9)) + GOAL_SLACK_MS
    out = {"floor_ms": floor, "goal_ms": goal_ms, "bound": "memory" if nbytes / (copy_gbps * 1e6) >= nflops / (
        matmul_tflops * 1e9) else "compute"}
    if not ms:
        return dict(out, ms=None, frac_of_floor=None, gbps=None, tflops=None, goal="unmeasured")
    return dict(out, ms=ms, frac_of_floor=floor / ms, gbps=nbytes / ms / 1e6, tflops=nflops / ms / 1e9,
                goal="met" if ms <= goal_ms else "missed")


def aot_build(arch: int, out_dir: Path, procs: int = 8, keys: list[str] | None = None) -> dict:
    """triton_verify.build(arch) of every instantiation (60: `instantiations(arch)`) split over
    `procs` processes (a compile is single-threaded; the device machine has 16 cores), each into
    out_dir/part-<i>, then merged into out_dir (the kernels' cache directories copied, one
    manifest.json over all), so `triton_verify.load(out_dir)` gives what deploy ships.
    keys: only these instantiation keys (tests). Returns {seconds, procs, instantiations,
    per_process_s}; raises RuntimeError with a process's stderr when one fails (after 600 s at most)."""
    import shutil

    import triton_verify as tv
    t0 = time.monotonic()
    out_dir = Path(out_dir)
    shutil.rmtree(out_dir, ignore_errors=True)
    keys = [i["key"] for i in tv.instantiations(arch) if keys is None or i["key"] in keys]
    procs = max(1, min(procs, len(keys)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    running = []
    for i in range(procs):
        part = out_dir / f"part-{i}"
        code = (f"import sys, time; sys.path.insert(0, {str(PKG)!r}); import triton_verify as tv; "
                f"t = time.monotonic(); tv.build({arch}, {str(part)!r}, keys=set({keys[i::procs]!r})); "
                "print(time.monotonic() - t)")
        running.append((part, subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                                               stderr=subprocess.PIPE, text=True)))
    records, head, per = [], None, []
    for part, proc in running:
        out, err = proc.communicate(timeout=600)
        if proc.returncode:
            raise RuntimeError(f"triton_verify.build({arch}) of {part.name} failed: {err[-3000:]}")
        per.append(round(float(out.strip().splitlines()[-1]), 1))
        manifest = json.loads((part / tv.MANIFEST).read_text())
        head = head or {k: v for k, v in manifest.items() if k != "instantiations"}
        records += manifest["instantiations"]
        for d in part.iterdir():
            if d.is_dir():
                shutil.copytree(d, out_dir / d.name, dirs_exist_ok=True)
        shutil.rmtree(part)
    (out_dir / tv.MANIFEST).write_text(json.dumps(dict(head, instantiations=records), indent=1))
    return {"seconds": round(time.monotonic() - t0, 1), "procs": procs, "instantiations": len(records),
            "per_process_s": per}


def load_backend(name: str, module_path: str | None, aot_dir: str | None = None):
    """The backend under test: "cpu"/"cuda" = the built extension at module_path; "triton" = the
    package's triton_verify module: with aot_dir, `triton_verify.load(aot_dir)` (the ahead-of-time
    build, `aot_build`: what deploy ships, nothing compiled while timing), else Triton's JIT (under
    TRITON_INTERPRET=1 its interpreter). Each has verify_attention(...) and
    verify_attention_sglang(...) (kernels/verify_attention/README.md)."""
    if name == "triton":
        import importlib

        tv = importlib.import_module("triton_verify")
        return tv.load(aot_dir) if aot_dir else tv
    if not module_path:
        raise RuntimeError(f"the {name} backend was not built")
    return load_module(module_path)
