"""Benchmark on a GPU machine: correctness first, then timings against a PyTorch gather + SDPA baseline.

    python bench.py                       # builds the CUDA backend, prefixes 4k/16k/64k
    python bench.py --module BUILD/verify_attention_cuda.so --prefixes 4096,16384,65536
    python bench.py --device cpu --prefixes 256 --iters 3   # smoke run of this script on a CPU

1. test_kernel.run: the module against the float64 reference on random inputs (tolerances from
   kernel.yaml); stops with exit 1 on a mismatch.
2. For each prefix length P: B requests with prefix P and a T-token draft tree; median of --iters
   timed runs (CUDA events on cuda, perf_counter on cpu) after --warmup runs, for the kernel and for
   the baseline (gather K/V by req_to_token, then scaled_dot_product_attention with the tree mask;
   the mask itself is built outside the timed region). Prints a table; times in milliseconds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import test_kernel  # noqa: E402


def build(device: str, build_dir: str) -> str:
    """Build this package's backend for `device` with torch.utils.cpp_extension; returns the .so path."""
    from torch.utils.cpp_extension import load

    spec = yaml.safe_load((HERE / "kernel.yaml").read_text())
    b = spec["backends"][device]
    mod = load(name=f"{spec['name']}_{device}", sources=[str(HERE / s) for s in b["sources"]],
               extra_cflags=b.get("cflags", []), extra_cuda_cflags=b.get("cuda_cflags", []),
               extra_ldflags=b.get("ldflags", []), build_directory=build_dir, verbose=False)
    return mod.__file__


def timed(fn, iters: int, warmup: int, device: str) -> float:
    """Median milliseconds of `iters` calls of fn after `warmup` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def sdpa_baseline(x: dict, B: int, T: int, P: int):
    """Gather + SDPA for B requests with the same prefix length P; returns (fn, precomputed mask)."""
    Hq, D = x["q"].shape[1], x["q"].shape[2]
    mask = torch.ones(B, 1, T, P + T, dtype=torch.bool, device=x["q"].device)
    mask[:, 0, :, P:] = x["tree_mask"].bool()

    def fn():
        slots = x["req_to_token"][x["req_pool_indices"], : P + T].long()       # [B, L]
        k = x["k_cache"][slots].transpose(1, 2)                                # [B, Hkv, L, D]
        v = x["v_cache"][slots].transpose(1, 2)
        q = x["q"].view(B, T, Hq, D).transpose(1, 2)                           # [B, Hq, T, D]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=x["sm_scale"], enable_gqa=True)
        return o.transpose(1, 2).reshape(B * T, Hq, D)

    return fn


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="verify_attention benchmark")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--module", help="prebuilt extension (.so); default: build into a temporary directory")
    ap.add_argument("--prefixes", default="4096,16384,65536")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--draft", type=int, default=8, help="draft tokens per request (T)")
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--dtype", choices=["float16", "bfloat16"], default="bfloat16")
    ap.add_argument("--splits", type=int, default=0, help="num_splits (0: the kernel's heuristic)")
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=10)
    a = ap.parse_args(argv)

    module_path = a.module or build(a.device, tempfile.mkdtemp(prefix="verify_attention_bench_"))
    spec = yaml.safe_load((HERE / "kernel.yaml").read_text())
    tol = {k: [v["atol"], v["rtol"]] for k, v in spec["tolerances"].items()}
    check = test_kernel.run(module_path, a.device, tol)
    print(f"reference check: {'ok' if check['ok'] else 'FAILED'} ({len(check['cases'])} cases, seed {check['seed']})")
    if not check["ok"]:
        for c in check["failures"]:
            print("  mismatch:", c)
        return 1

    mod = test_kernel.load_module(module_path)
    gen = torch.Generator().manual_seed(0)
    dtype = getattr(torch, a.dtype)
    print(f"B={a.batch} T={a.draft} Hq={a.hq} Hkv={a.hkv} D={a.dim} {a.dtype} device={a.device} "
          f"splits={a.splits or 'auto'} median of {a.iters}")
    print(f"{'prefix':>8} {'kernel ms':>10} {'sdpa ms':>10} {'speedup':>8} {'max|diff|':>10}")
    for P in (int(p) for p in a.prefixes.split(",")):
        x = test_kernel.make_inputs(a.batch, a.draft, [P] * a.batch, a.hkv, a.hq // a.hkv, a.dim, dtype,
                                    a.device, gen, shared_mask=True)
        base = sdpa_baseline(x, a.batch, a.draft, P)

        def kern():
            return mod.verify_attention(**x, num_splits=a.splits)

        diff = (kern().float() - base().float()).abs().max().item()
        t_kernel = timed(kern, a.iters, a.warmup, a.device)
        t_base = timed(base, a.iters, a.warmup, a.device)
        print(f"{P:>8} {t_kernel:>10.4f} {t_base:>10.4f} {t_base / t_kernel:>7.2f}x {diff:>10.2e}")
        del x, base
    return 0


if __name__ == "__main__":
    sys.exit(main())
