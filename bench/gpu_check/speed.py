"""Stage 3: time the kernel, SGLang's Triton target-verify path and gather + SDPA on the same inputs.

Shapes (the deployment's TP8 slice): Hq = 8 query heads, G in {1, 8} (Hkv = 8 / G), D = 128 first,
then 64 and 256; B in {1, 8}; T in {9, 64}; every request with prefix P in {4096, 16384, 65536};
bf16; one random draft tree shared by the batch. 72 shapes. --cpu: B 1, T 9, D 64, (G 1, P 64) and
(G 8, P 256), timed with perf_counter.

Timing (CUDA): each method gets max(calls, n) (calls >= 100) back-to-back calls captured in one
CUDA graph, call i reading K/V buffer i mod n; n is chosen so the buffers hold at least 4x the L2
(4 x 60 MB on an H200), or one buffer when a single call already reads that much, so a buffer is
read again only after >= 4x L2 of other K/V has streamed through (each call misses L2). One replay
warms up; then 3 (slow shapes) to 7 timed replays, each between two CUDA events; ms = median
replay time / calls. If a method cannot be captured, the same calls run eagerly between the two
events (recorded as "eager").
K/V bytes per call: every key and value of every request once per KV head (common.kv_bytes);
hbm_gbps = those bytes / ms_kernel. The device-to-device copy is timed in the same run (a 2 GiB
tensor.copy_, 10 copies between two events after 2 warm-ups) and reported counting read + write,
the way KINDS.md reports the H200's 4.3 TB/s.
"""

from __future__ import annotations

import math
import statistics
import time

import torch

from common import compare, kargs, kv_bytes, make_inputs, verify_attention_ref

HQ = 8


def shapes(cpu: bool) -> list[dict]:
    if cpu:
        return [{"B": 1, "T": 9, "P": 64, "G": 1, "D": 64}, {"B": 1, "T": 9, "P": 256, "G": 8, "D": 64}]
    return [{"B": B, "T": T, "P": P, "G": G, "D": D}
            for D in (128, 64, 256) for G in (1, 8) for B in (1, 8) for T in (9, 64) for P in (4096, 16384, 65536)]


class Timer:
    """ms per call of a list of zero-argument calls, on CUDA (graph replay, events) or CPU (perf_counter)."""

    def __init__(self, device: str, calls: int, cpu_reps: int = 2):
        self.device, self.calls, self.cpu_reps = device, calls, cpu_reps

    def time(self, fns: list) -> dict:
        if self.device != "cuda":
            fns[0]()                                            # warm-up
            samples = []
            for _ in range(self.cpu_reps):
                t0 = time.perf_counter()
                for fn in fns:
                    fn()
                samples.append((time.perf_counter() - t0) * 1e3 / len(fns))
            return {"ms": statistics.median(samples), "timing": "perf_counter", "samples_ms": samples}
        for fn in fns[:3]:                                      # compile / load outside the graph
            fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        graph, how = None, "graph"
        try:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                fns[0]()
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for fn in fns:
                    fn()
            run = graph.replay
        except Exception as e:
            graph, how = None, f"eager (graph capture failed: {type(e).__name__}: {str(e)[:200]})"
            torch.cuda.synchronize()

            def run():
                for fn in fns:
                    fn()
        start.record()
        run()                                                   # warm-up replay, also sizes the repeats
        end.record()
        end.synchronize()
        first = start.elapsed_time(end)
        reps = 3 if first > 300 else 7
        samples = []
        for _ in range(reps):
            start.record()
            run()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / len(fns))
        del graph
        return {"ms": statistics.median(samples), "timing": how, "samples_ms": [round(v, 5) for v in samples]}


def copy_bandwidth(device: str) -> dict:
    """Device-to-device copy: GB/s counting bytes read + written (2 GiB on CUDA, 64 MiB on CPU)."""
    nbytes = (2 << 30) if device == "cuda" else (64 << 20)
    src = torch.empty(nbytes // 2, dtype=torch.float16, device=device).uniform_(-1, 1)
    dst = torch.empty_like(src)
    n = 10 if device == "cuda" else 3
    for _ in range(2):
        dst.copy_(src)
    if device == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            dst.copy_(src)
        end.record()
        end.synchronize()
        ms = start.elapsed_time(end) / n
    else:
        t0 = time.perf_counter()
        for _ in range(n):
            dst.copy_(src)
        ms = (time.perf_counter() - t0) * 1e3 / n
    ok = bool(torch.equal(dst, src))
    del src, dst
    return {"bytes": nbytes, "ms": ms, "gbps_read_plus_write": 2 * nbytes / ms / 1e6, "copied_equal": ok}


def run_shape(mod, extend_attention_fwd, sh: dict, device: str, calls: int, l2_bytes: int, cpu: bool) -> dict:
    """One shape: inputs, correctness of the three methods on buffer 0, then the three timings."""
    import baselines

    B, T, P, G, D = sh["B"], sh["T"], sh["P"], sh["G"], sh["D"]
    Hkv = HQ // G
    dtype = torch.bfloat16
    per_call = kv_bytes([P] * B, T, Hkv, D, dtype)
    nbuf = 2 if cpu else max(1, math.ceil(4 * l2_bytes / per_call))
    x = make_inputs(B, T, [P] * B, Hkv, G, D, dtype, device, seed=hash((B, T, P, G, D)) % 100000, shared_mask=True,
                    buffers=nbuf)
    kc = x.get("k_caches", [x["k_cache"]])
    vc = x.get("v_caches", [x["v_cache"]])
    calls = max(calls, nbuf)                # every buffer used once per replay: reuse distance >= 4x L2
    row = {"B": B, "T": T, "P": P, "Hq": HQ, "Hkv": Hkv, "G": G, "D": D, "dtype": "bfloat16", "kv_bytes": per_call,
           "buffers": nbuf, "buffers_bytes": per_call * nbuf, "calls": calls}
    want = verify_attention_ref(**kargs(x))
    r = compare(mod.verify_attention(**kargs(x)), want, "bfloat16")
    row["correct"], row["max_abs_err"] = r["ok"], {"kernel": r["max_abs_err"]}
    meta = None
    if extend_attention_fwd is not None:
        meta = baselines.sglang_target_verify_metadata(x)
        kext = [c[meta["slots_draft"]].contiguous() for c in kc]
        vext = [c[meta["slots_draft"]].contiguous() for c in vc]
        r = compare(baselines.triton_target_verify(extend_attention_fwd, x, meta, kc[0], vc[0], kext[0], vext[0]),
                    want, "bfloat16")
        row["triton_correct"], row["max_abs_err"]["triton"] = r["ok"], r["max_abs_err"]
    mask = baselines.sdpa_mask(x)
    r = compare(baselines.sdpa_verify(x, mask), want, "bfloat16")
    row["sdpa_correct"], row["max_abs_err"]["sdpa"] = r["ok"], r["max_abs_err"]
    del want

    timer = Timer(device, calls)
    base = kargs(x)

    def kernel_call(i):
        return lambda: mod.verify_attention(**dict(base, k_cache=kc[i % nbuf], v_cache=vc[i % nbuf]))

    t = timer.time([kernel_call(i) for i in range(calls)])
    row["ms_kernel"], row["timing_kernel"] = t["ms"], t["timing"]
    if meta is not None:
        def triton_call(i):
            j = i % nbuf
            return lambda: baselines.triton_target_verify(extend_attention_fwd, x, meta, kc[j], vc[j], kext[j], vext[j])

        t = timer.time([triton_call(i) for i in range(calls)])
        row["ms_triton"], row["timing_triton"] = t["ms"], t["timing"]
    else:
        row["ms_triton"] = None

    def sdpa_call(i):
        return lambda: baselines.sdpa_verify(x, mask, kc[i % nbuf], vc[i % nbuf])

    t = timer.time([sdpa_call(i) for i in range(calls)])
    row["ms_sdpa"], row["timing_sdpa"] = t["ms"], t["timing"]
    row["speedup_vs_triton"] = row["ms_triton"] / row["ms_kernel"] if row["ms_triton"] else None
    row["speedup_vs_sdpa"] = row["ms_sdpa"] / row["ms_kernel"]
    row["hbm_gbps"] = per_call / row["ms_kernel"] / 1e6
    del x, kc, vc, base
    if meta is not None:
        del kext, vext, meta
    if device == "cuda":
        torch.cuda.empty_cache()
    return row


def goal(rows: list[dict], copy: dict | None) -> dict:
    """The issue's goal: >= 3x SGLang's Triton kernel on every shape with a 4k-64k prefix, and the
    kernel's K/V read rate at the 64k shape with the most K/V bytes within 2x of the copy's
    read + write rate."""
    timed = [r for r in rows if r.get("speedup_vs_triton")]
    out = {"speedup_target": 3.0, "bandwidth_target_frac_of_copy": 0.5}
    if not timed or not copy:
        out.update(met=None, why="no timings with a Triton baseline and a copy bandwidth")
        return out
    slow = [r for r in timed if 4096 <= r["P"] <= 65536 and r["speedup_vs_triton"] < 3.0]
    out["min_speedup_vs_triton"] = min(r["speedup_vs_triton"] for r in timed)
    out["shapes_below_3x"] = [{k: r[k] for k in ("B", "T", "P", "G", "D", "speedup_vs_triton")} for r in slow]
    big = [r for r in rows if r["P"] == 65536 and r.get("ms_kernel")]
    if big:
        top = max(big, key=lambda r: r["kv_bytes"])
        frac = top["hbm_gbps"] / copy["gbps_read_plus_write"]
        out["bandwidth_shape"] = {k: top[k] for k in ("B", "T", "P", "G", "D", "kv_bytes", "hbm_gbps")}
        out["bandwidth_frac_of_copy"] = frac
        out["met"] = not slow and frac >= 0.5 and all(r["correct"] for r in rows)
    else:
        out.update(met=None, why="no 64k shape timed")
    return out
