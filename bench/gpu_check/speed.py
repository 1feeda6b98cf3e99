"""Stages 3-5: time the new kernel (and the CUDA backend beside it), the baselines, the split sweep.

Every timed call is the backend's SGLang-layout entry, `verify_attention_sglang`, on the inputs
SGLang's Triton backend gives it under CUDA graphs (kernels/verify_attention/sglang_layout.py: the
FULL_MASK in a uint8 buffer, kv_indptr int32, kv_indices int64), writing into a preallocated `o`.

Shapes (the deployment's TP8 slice): Hq = 8 query heads, G in {1, 8} (Hkv = 8 / G), D = 128 first,
then 64 and 256; B in {1, 8}; T in {4, 8, 9, 64} (4 and 8: SGLang's auto draft widths); every
request with prefix P in {4096, 16384, 65536}; bf16; one random draft tree shared by the batch.
144 shapes. --cpu: B 1, D 64, (T 4, G 1, P 64) and (T 8, G 8, P 256), timed with perf_counter.

Timing (CUDA): one eager call sizes the replay: calls = clamp(ceil(20 ms / its time), n, 100)
back-to-back calls captured in one CUDA graph, call i reading K/V buffer i mod n; n is chosen so the
buffers hold at least 4x the L2 (4 x 60 MB on an H200), or one buffer when a single call already
reads that much, so a buffer is read again only after >= 4x L2 of other K/V has streamed through
(each call misses L2). One replay warms up; then 5 timed replays, each between two CUDA events;
ms = median replay time / calls. If a method cannot be captured, the same calls run eagerly between
the two events (recorded as "eager"). --cpu: 2 calls, 2 repeats (it checks the script, it measures
nothing).

Per shape (common.roofline): K/V bytes (common.kv_bytes), FLOPs (common.flops, T*G FLOP per byte),
floor = max(bytes / copy rate, FLOPs / bf16 matmul rate) with both rates measured in the same run
(a 2 GiB tensor.copy_ counted read + write, 10 copies between two events after 2 warm-ups, the way
KINDS.md reports the H200's 4.3 TB/s; an 8192^3 bf16 matmul, 10 between two events), the fraction of
the floor reached, GB/s, TFLOP/s and the issue's goal per shape (met / missed / unmeasured).
"""

from __future__ import annotations

import math
import statistics
import time

import torch

from common import compare, flops, kargs, kv_bytes, make_inputs, roofline, target_verify_args, verify_attention_ref

HQ = 8
TARGET_REPLAY_MS = 20.0
MAX_CALLS = 100
# stage 4 times the baselines at these prefixes only (GPU); the CPU run at its own two shapes
BASELINE_PREFIXES = (16384, 65536)
# stage 5: three shapes (a latency-bound one, a memory-bound one, one with T*G = 512) x these splits
SWEEP_SPLITS = (1, 2, 4, 8, 16, 32, 64, 128)
# stage 4 runs SGLang's verify_splitkv_fwd only at T <= this: its `_verify_combine_stage2` at L_EXT 64
# took 1,206 s to compile for sm_90 (kernel-turn4.md finding 7), L_EXT 16 8.3 s
SPLITKV_MAX_T = 16


def shapes(cpu: bool) -> list[dict]:
    if cpu:
        return [{"B": 1, "T": 4, "P": 64, "G": 1, "D": 64}, {"B": 1, "T": 8, "P": 256, "G": 8, "D": 64}]
    return [{"B": B, "T": T, "P": P, "G": G, "D": D}
            for D in (128, 64, 256) for G in (1, 8) for B in (1, 8) for T in (4, 8, 9, 64)
            for P in (4096, 16384, 65536)]


def sweep_shapes(cpu: bool) -> list[dict]:
    if cpu:
        return [{"B": 1, "T": 4, "P": 64, "G": 1, "D": 64}]
    return [{"B": 1, "T": 4, "P": 65536, "G": 1, "D": 128}, {"B": 8, "T": 8, "P": 65536, "G": 1, "D": 128},
            {"B": 8, "T": 64, "P": 16384, "G": 8, "D": 128}]


class Timer:
    """ms per call of `make(i)` (a zero-argument call on K/V buffer i), on CUDA (graph replay, events)
    or the CPU (perf_counter); see the module docstring."""

    def __init__(self, device: str, calls: int | None = None, cpu_reps: int = 2):
        self.device, self.calls, self.cpu_reps = device, calls, cpu_reps

    def time(self, make, nbuf: int) -> dict:
        if self.device != "cuda":
            fns = [make(i % nbuf) for i in range(self.calls or 2)]
            fns[0]()                                            # warm-up
            samples = []
            for _ in range(self.cpu_reps):
                t0 = time.perf_counter()
                for fn in fns:
                    fn()
                samples.append((time.perf_counter() - t0) * 1e3 / len(fns))
            return {"ms": statistics.median(samples), "timing": "perf_counter", "calls": len(fns),
                    "samples_ms": samples}
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        first = make(0)
        first()                                                 # compile / load outside the graph
        torch.cuda.synchronize()
        start.record()
        first()
        end.record()
        end.synchronize()
        calls = self.calls or max(nbuf, min(MAX_CALLS, math.ceil(TARGET_REPLAY_MS / max(start.elapsed_time(end),
                                                                                       1e-3))))
        calls = max(calls, nbuf)            # every buffer used once per replay: reuse distance >= 4x L2
        fns = [make(i % nbuf) for i in range(calls)]
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
        run()                                                   # warm-up replay
        samples = []
        for _ in range(5):
            start.record()
            run()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / len(fns))
        del graph
        return {"ms": statistics.median(samples), "timing": how, "calls": calls,
                "samples_ms": [round(v, 5) for v in samples]}


def copy_bandwidth(device: str) -> dict:
    """Device-to-device copy: GB/s counting bytes read + written (2 GiB on CUDA, 64 MiB on CPU)."""
    nbytes = (2 << 30) if device == "cuda" else (64 << 20)
    src = torch.empty(nbytes // 2, dtype=torch.float16, device=device).uniform_(-1, 1)
    dst = torch.empty_like(src)
    n = 10 if device == "cuda" else 3
    ms = _timed(lambda: dst.copy_(src), n, device)
    ok = bool(torch.equal(dst, src))
    del src, dst
    return {"bytes": nbytes, "ms": ms, "gbps_read_plus_write": 2 * nbytes / ms / 1e6, "copied_equal": ok}


def matmul_rate(device: str) -> dict:
    """bf16 matmul rate: n^3 with n = 8192 on CUDA (256 on the CPU), TFLOP/s = 2 n^3 / ms."""
    n = 8192 if device == "cuda" else 256
    a = torch.randn(n, n, device=device).to(torch.bfloat16)
    b = torch.randn(n, n, device=device).to(torch.bfloat16)
    ms = _timed(lambda: torch.mm(a, b), 10 if device == "cuda" else 3, device)
    del a, b
    return {"n": n, "dtype": "bfloat16", "ms": ms, "tflops": 2 * n ** 3 / ms / 1e9}


def _timed(fn, n: int, device: str) -> float:
    """ms per call of fn: 2 warm-ups, then n calls between two CUDA events (or perf_counter)."""
    for _ in range(2):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / n
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) * 1e3 / n


def _inputs(sh: dict, device: str, l2_bytes: int, cpu: bool, tree: str = "random"):
    """(row skeleton, reference-layout inputs x, per-buffer SGLang args) for one shape."""
    B, T, P, G, D = sh["B"], sh["T"], sh["P"], sh["G"], sh["D"]
    Hkv = HQ // G
    dtype = torch.bfloat16
    per_call = kv_bytes([P] * B, T, Hkv, D, dtype)
    nbuf = 2 if cpu else max(1, math.ceil(4 * l2_bytes / per_call))
    x = make_inputs(B, T, [P] * B, Hkv, G, D, dtype, device, seed=hash((B, T, P, G, D)) % 100000, shared_mask=True,
                    tree=tree, buffers=nbuf)
    kc = x.get("k_caches", [x["k_cache"]])
    vc = x.get("v_caches", [x["v_cache"]])
    args = [target_verify_args(dict(x, k_cache=kc[i], v_cache=vc[i]), "uint8") for i in range(nbuf)]
    row = {"B": B, "T": T, "P": P, "Hq": HQ, "Hkv": Hkv, "G": G, "D": D, "TG": T * G, "dtype": "bfloat16",
           "kv_bytes": per_call, "flops": flops([P] * B, T, HQ, D), "buffers": nbuf, "buffers_bytes": per_call * nbuf}
    return row, x, args


def _time_entry(mod, args: list[dict], timer: Timer, num_splits: int = 0) -> tuple[dict, torch.Tensor]:
    """Time mod.verify_attention_sglang over the buffers' args; returns (timing, buffer 0's o)."""
    def make(i):
        return lambda: mod.verify_attention_sglang(**args[i], num_splits=num_splits)

    t = timer.time(make, len(args))
    return t, args[0]["o"].clone()


def speed_shape(backends: dict, sh: dict, device: str, timer: Timer, l2_bytes: int, cpu: bool, copy: dict,
                mm: dict) -> dict:
    """One stage-3 shape: every backend's SGLang entry timed; the first backend is the new kernel.

    The row's flat fields are the new kernel's (ms_kernel, floor_ms, frac_of_floor, gbps, tflops,
    goal_ms, goal); "by_backend" has each backend's roofline; "agree" compares the other backends'
    outputs with the new kernel's (kernel.yaml's bf16 tolerance); --cpu also checks the new kernel
    against the float64 reference ("correct"; on a GPU stage 2 is the correctness proof)."""
    row, x, args = _inputs(sh, device, l2_bytes, cpu)
    row["by_backend"], row["agree"], outs = {}, {}, {}
    for name, mod in backends.items():
        t, outs[name] = _time_entry(mod, args, timer)
        row["by_backend"][name] = {"timing": t["timing"], "calls": t["calls"],
                                   **roofline(row["kv_bytes"], row["flops"], t["ms"], copy["gbps_read_plus_write"],
                                              mm["tflops"])}
    new = next(iter(backends))
    for name in list(backends)[1:]:
        r = compare(outs[name], outs[new].double(), "bfloat16")
        row["agree"][name] = {"ok": r["ok"], "max_abs_err": r["max_abs_err"]}
    if cpu:
        row["correct"] = compare(outs[new], verify_attention_ref(**kargs(x)), "bfloat16")["ok"]
    else:
        row["correct"] = None
    k = row["by_backend"][new]
    row.update(backend=new, ms_kernel=k["ms"], floor_ms=k["floor_ms"], frac_of_floor=k["frac_of_floor"],
               gbps=k["gbps"], tflops=k["tflops"], goal_ms=k["goal_ms"], goal=k["goal"], bound=k["bound"])
    _free(device)
    return row


def baseline_shape(mod, extend_attention_fwd, verify_splitkv_fwd, sh: dict, device: str, timer: Timer,
                   l2_bytes: int, cpu: bool, ms_kernel: float | None) -> dict:
    """One stage-4 shape: SGLang's extend_attention_fwd and gather + SDPA on the shape's random tree
    (against the new kernel's stage-3 time ms_kernel), and on a causal chain SGLang's
    verify_splitkv_fwd against the new kernel timed again on the same chain. A baseline that cannot
    run records its error and its figure is "unmeasured"; each baseline's output is compared with the
    new kernel's on the same inputs (agree_*)."""
    import baselines

    row, x, args = _inputs(sh, device, l2_bytes, cpu)
    row["ms_kernel"] = ms_kernel
    mod.verify_attention_sglang(**args[0])
    want = args[0]["o"].double()
    meta = baselines.sglang_target_verify_metadata(x)

    def timed(name, make, check, want):
        try:
            t = timer.time(make, len(args))
            r = compare(check(), want, "bfloat16")
            row[f"ms_{name}"], row[f"timing_{name}"] = t["ms"], t["timing"]
            row[f"agree_{name}"] = {"ok": r["ok"], "max_abs_err": r["max_abs_err"]}
        except Exception as e:  # noqa: BLE001 - a baseline that cannot run is recorded, not fatal
            row[f"ms_{name}"], row[f"error_{name}"] = None, f"{type(e).__name__}: {e}"[:800]

    kc = [a["k_buffer"] for a in args]
    vc = [a["v_buffer"] for a in args]
    if extend_attention_fwd is not None:
        def tri(i):
            return lambda: baselines.triton_target_verify(extend_attention_fwd, x, meta, kc[i], vc[i],
                                                          args[i]["k_extend"], args[i]["v_extend"])
        timed("triton", tri, lambda: tri(0)(), want)
    else:
        row["ms_triton"], row["error_triton"] = None, "triton is not importable here"
    mask = baselines.sdpa_mask(x)

    def sdpa(i):
        return lambda: baselines.sdpa_verify(x, mask, kc[i], vc[i])
    timed("sdpa", sdpa, lambda: sdpa(0)(), want)

    # the causal chain: the new kernel with custom_mask None (as SGLang has no spec mask) and verify_splitkv
    chain_x = dict(x, tree_mask=torch.ones(sh["T"], sh["T"], dtype=torch.bool, device=device).tril())
    chain = [dict(a, custom_mask=None) for a in args]
    t = timer.time(lambda i: lambda: mod.verify_attention_sglang(**chain[i]), len(args))
    row["ms_kernel_chain"] = t["ms"]
    mod.verify_attention_sglang(**chain[0])
    want_chain = chain[0]["o"].double()
    chain_meta = baselines.sglang_target_verify_metadata(chain_x)
    if verify_splitkv_fwd is not None and sh["T"] > SPLITKV_MAX_T:
        row["ms_splitkv"], row["error_splitkv"] = None, (
            f"unmeasured: T {sh['T']} > {SPLITKV_MAX_T}, its combine does not compile in budget (kernel-turn4.md "
            "finding 7: L_EXT 64 took 1,206 s)")
    elif verify_splitkv_fwd is not None:
        outs = [torch.empty_like(x["q"]) for _ in args]

        def skv(i):
            return lambda: baselines.splitkv_target_verify(verify_splitkv_fwd, chain_x, chain_meta, kc[i], vc[i],
                                                           chain[i]["k_extend"], chain[i]["v_extend"], outs[i])

        def skv_checked():
            baselines.zero_splitkv_scratch(verify_splitkv_fwd)
            return skv(0)()
        timed("splitkv", skv, skv_checked, want_chain)
    else:
        row["ms_splitkv"], row["error_splitkv"] = None, "the carried verify_splitkv.py did not import"
    row["speedup_vs_triton"] = row["ms_triton"] / ms_kernel if row.get("ms_triton") and ms_kernel else None
    row["speedup_vs_sdpa"] = row["ms_sdpa"] / ms_kernel if row.get("ms_sdpa") and ms_kernel else None
    row["speedup_vs_splitkv"] = row["ms_splitkv"] / row["ms_kernel_chain"] if row.get("ms_splitkv") else None
    for name, target in (("triton", 3.0), ("splitkv", 1.0)):
        s = row[f"speedup_vs_{name}"]
        row[f"goal_vs_{name}"] = "unmeasured" if s is None else ("met" if s >= target else "missed")
    _free(device)
    return row


def split_sweep(mod, sh: dict, device: str, timer: Timer, l2_bytes: int, cpu: bool) -> dict:
    """Stage 5 at one shape: the new kernel with its own split count (num_splits 0) and with each of
    SWEEP_SPLITS; ok when the heuristic is within 10% of the best fixed split."""
    row, _, args = _inputs(sh, device, l2_bytes, cpu)
    row["ms_by_splits"] = {}
    for s in (0, *SWEEP_SPLITS):
        row["ms_by_splits"][str(s)] = _time_entry(mod, args, timer, num_splits=s)[0]["ms"]
    fixed = {s: ms for s, ms in row["ms_by_splits"].items() if s != "0"}
    best = min(fixed, key=fixed.get)
    row.update(best_splits=int(best), ms_best=fixed[best], ms_heuristic=row["ms_by_splits"]["0"],
               heuristic_over_best=row["ms_by_splits"]["0"] / fixed[best])
    row["ok"] = None if cpu else row["heuristic_over_best"] <= 1.10
    _free(device)
    return row


def _free(device: str) -> None:
    if device == "cuda":
        torch.cuda.empty_cache()


def goal(rows: list[dict], baseline_rows: list[dict] | None = None, cpu: bool = False,
         not_run: list[dict] | None = None) -> dict:
    """The issue's goal over the timed shapes: per shape t <= max(bytes / (0.5 x copy),
    FLOPs / 200 TFLOP/s) + 10 us (each row's "goal"), worst and median fraction of the floor, and from
    stage 4 >= 3x extend_attention_fwd at 4k-64k and >= 1.0x verify_splitkv_fwd on chains. Shapes
    stage 3 did not start for time (`not_run`) count as unmeasured. "met" is True only when every
    shape met and nothing is unmeasured; None on a CPU (it measures nothing)."""
    out = {"per_shape": "t <= max(bytes / (0.5 x copy), FLOPs / 200 TFLOP/s) + 10 us"}
    timed = [r for r in rows if r.get("frac_of_floor")]
    counts = {k: sum(r.get("goal") == k for r in rows) for k in ("met", "missed", "unmeasured")}
    counts["unmeasured"] += len(not_run or [])
    out["shapes"] = counts
    if timed:
        worst = min(timed, key=lambda r: r["frac_of_floor"])
        out["worst"] = {k: worst[k] for k in ("B", "T", "P", "G", "D", "ms_kernel", "floor_ms", "frac_of_floor")}
        out["median_frac_of_floor"] = statistics.median(r["frac_of_floor"] for r in timed)
        big = [r for r in timed if r["bound"] == "memory"]
        if big:
            top = max(big, key=lambda r: r["kv_bytes"])
            out["memory_bound_shape"] = {k: top[k] for k in ("B", "T", "P", "G", "D", "kv_bytes", "gbps")}
    for name in ("triton", "splitkv"):
        vals = [r[f"goal_vs_{name}"] for r in baseline_rows or []]
        out[f"vs_{name}"] = {k: vals.count(k) for k in ("met", "missed", "unmeasured")}
    if cpu:
        out.update(met=None, why="--cpu: the CPU backend and the interpreter measure nothing")
        return out
    every = counts["missed"] == counts["unmeasured"] == 0 and bool(rows)
    base = all(out[f"vs_{n}"]["missed"] == out[f"vs_{n}"]["unmeasured"] == 0 for n in ("triton", "splitkv"))
    out["met"] = every and base and bool(baseline_rows)
    return out
