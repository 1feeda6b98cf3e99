"""Stage 2: the built kernel against the float64 reference (kernel.yaml's tolerances), under CUDA
graph replay, and the two baselines against the same reference (which checks how the SGLang
Triton call is set up: its custom_mask layout, indptrs and indices).

GPU grid (B = 2, the second request's prefix P // 2 + 3, so requests are ragged; Hq = 8 as in a
TP8 slice, Hkv = 8 / G): T in {1, 8, 64} x P in {0, 1, 4097, 65536} x G in {1, 8} x D in {64, 128,
256} x fp16/bf16 = 144 inputs, each with num_splits 0 (the heuristic) and 5; draft trees cycle
through random / chain / star parent lists, one mask per request or one shared, req_to_token int32
or int64. The reference runs on the GPU in float64.
CPU grid (--cpu): T in {1, 8} x P in {0, 1, 33} x G in {1, 8} x D = 64 x fp16/bf16 = 24 inputs.
"""

from __future__ import annotations

import itertools
import time

import torch

from common import compare, kargs, make_inputs, verify_attention_ref

TREES = ("random", "chain", "star")


def grid(cpu: bool) -> list[dict]:
    """The input cases: dicts of B, T, P, G, Hkv, D, dtype, tree, shared, r2t, seed."""
    if cpu:
        Ts, Ps, Gs, Ds = (1, 8), (0, 1, 33), (1, 8), (64,)
    else:
        Ts, Ps, Gs, Ds = (1, 8, 64), (0, 1, 4097, 65536), (1, 8), (64, 128, 256)
    cases = []
    for i, (T, P, G, D, dtype) in enumerate(itertools.product(Ts, Ps, Gs, Ds, ("float16", "bfloat16"))):
        cases.append({"B": 2, "T": T, "prefix_lens": [P, P // 2 + 3], "G": G, "Hkv": 8 // G, "D": D, "dtype": dtype,
                      "tree": TREES[i % 3], "shared_mask": i % 2 == 1, "r2t": "int64" if i % 4 >= 2 else "int32",
                      "seed": 1000 + i})
    return cases


def run_grid(mod, device: str, cpu: bool, log) -> dict:
    """Every grid case through the kernel (num_splits 0 and 5 on CUDA; the CPU backend ignores it)."""
    splits = (0,) if cpu else (0, 5)
    results = []
    for c in grid(cpu):
        x = make_inputs(c["B"], c["T"], c["prefix_lens"], c["Hkv"], c["G"], c["D"], getattr(torch, c["dtype"]), device,
                        c["seed"], getattr(torch, c["r2t"]), c["shared_mask"], c["tree"])
        want = verify_attention_ref(**kargs(x))
        for s in splits:
            got = mod.verify_attention(**kargs(x), num_splits=s)
            r = compare(got, want, c["dtype"])
            results.append({**{k: c[k] for k in ("T", "prefix_lens", "G", "Hkv", "D", "dtype", "tree", "shared_mask",
                                                 "r2t")}, "num_splits": s, **r})
            if not r["ok"]:
                log(f"  MISMATCH {results[-1]}")
        del x, want
    fails = [r for r in results if not r["ok"]]
    return {"ok": bool(results) and not fails, "cases": len(results), "failed": len(fails), "results": results}


def run_graph(mod, device: str, log) -> dict:
    """Capture the kernel once in a CUDA graph, then replay it with every prefix of the grid.

    Static inputs are sized for the longest prefix (65536, so the split heuristic, which reads
    req_to_token's width, is the same in eager and replay); the capture runs with prefixes
    [4097, 2051]; each replay rewrites prefix_lens and req_to_token in place (longer and shorter
    prefixes than at capture) and must equal an eager call on the same tensors bit for bit and
    the float64 reference within tolerance. Two configurations: (G 8, D 128, bf16) and (G 1, D 64, fp16).
    """
    configs = [{"G": 8, "D": 128, "dtype": "bfloat16", "T": 8}, {"G": 1, "D": 64, "dtype": "float16", "T": 8}]
    prefixes = (0, 1, 4097, 65536)
    out = {"ok": True, "configs": []}
    for cfg in configs:
        G, D, T, dtype = cfg["G"], cfg["D"], cfg["T"], getattr(torch, cfg["dtype"])
        Hkv = 8 // G
        big = make_inputs(2, T, [65536, 65536 // 2 + 3], Hkv, G, D, dtype, device, seed=77)
        x = kargs(big)
        x["prefix_lens"] = torch.tensor([4097, 4097 // 2 + 3], dtype=torch.int64, device=device)
        num_slots = x["k_cache"].shape[0]
        rec = {**cfg, "capture_prefix_lens": [4097, 2051], "replays": []}
        try:
            mod.verify_attention(**x)                       # warm-up outside the graph
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                static_out = mod.verify_attention(**x)
            for i, P in enumerate(prefixes):
                plens = [P, P // 2 + 3]
                gen = torch.Generator(device=device).manual_seed(500 + i)
                perm = torch.randperm(num_slots, generator=gen, device=device)
                rows = x["req_pool_indices"].tolist()
                start = 0
                for b, n in enumerate(p + T for p in plens):
                    x["req_to_token"][rows[b], :n] = perm[start:start + n].to(x["req_to_token"].dtype)
                    start += n
                x["prefix_lens"].copy_(torch.tensor(plens, dtype=torch.int64))
                g.replay()
                torch.cuda.synchronize()
                replayed = static_out.clone()
                eager = mod.verify_attention(**x)
                want = verify_attention_ref(**x)
                r = compare(replayed, want, cfg["dtype"])
                equal = bool(torch.equal(replayed, eager))
                rec["replays"].append({"prefix_lens": plens, "equal_to_eager": equal, **r})
                if not (equal and r["ok"]):
                    log(f"  GRAPH MISMATCH {cfg} prefix_lens={plens} equal={equal} {r}")
            del g, static_out
        except Exception as e:  # a capture failure is this check failing, not the script
            rec["error"] = f"{type(e).__name__}: {e}"[:2000]
        rec["ok"] = "error" not in rec and len(rec["replays"]) == len(prefixes) and all(
            r["equal_to_eager"] and r["ok"] for r in rec["replays"])
        out["ok"] = out["ok"] and rec["ok"]
        out["configs"].append(rec)
        del big, x
        torch.cuda.empty_cache()
    return out


def run_baselines(extend_attention_fwd, device: str, cpu: bool, log) -> dict:
    """SGLang's Triton path and gather + SDPA against the float64 reference on small shapes.

    Triton: B = 2 with ragged prefixes [37, 0] and one tree per request (so mask_indptr and
    kv_indptr offsets differ per request), Hq = 8, G in {1, 8}, D 64 (CPU) or 64/128/256 (GPU).
    Negative control: the same call with each request's tree mask transposed (a draft token then
    sees its descendants instead of its ancestors) must NOT match, or the comparison proves nothing.
    SDPA: equal prefixes [40, 40] (its mask needs one length).
    """
    import baselines

    out = {"triton": [], "sdpa": [], "ok": True}
    Ds = (64,) if cpu else (64, 128, 256)
    dtypes = ("float16", "bfloat16") if cpu else ("bfloat16",)
    shapes = [(G, D, dt) for G in (1, 8) for D in Ds for dt in dtypes]
    if not cpu:
        shapes.append((8, 128, "float16"))
    for i, (G, D, dt) in enumerate(shapes):
        x = make_inputs(2, 8, [37, 0], 8 // G, G, D, getattr(torch, dt), device, seed=300 + i, tree="random")
        want = verify_attention_ref(**kargs(x))
        if extend_attention_fwd is not None:
            meta = baselines.sglang_target_verify_metadata(x)
            r = compare(baselines.triton_target_verify(extend_attention_fwd, x, meta), want, dt)
            out["triton"].append({"G": G, "D": D, "dtype": dt, "prefix_lens": [37, 0], **r})
        y = make_inputs(2, 8, [40, 40], 8 // G, G, D, getattr(torch, dt), device, seed=400 + i, tree="random")
        r = compare(baselines.sdpa_verify(y, baselines.sdpa_mask(y)), verify_attention_ref(**kargs(y)), dt)
        out["sdpa"].append({"G": G, "D": D, "dtype": dt, "prefix_lens": [40, 40], **r})
    if extend_attention_fwd is not None:
        x = make_inputs(2, 8, [37, 0], 1, 8, 64, torch.float16, device, seed=399, tree="random")
        bad = dict(x, tree_mask=x["tree_mask"].transpose(-1, -2).contiguous())
        got = baselines.triton_target_verify(extend_attention_fwd, x, baselines.sglang_target_verify_metadata(bad))
        r = compare(got, verify_attention_ref(**kargs(x)), "float16")
        out["negative_control"] = {"what": "tree mask transposed", "matched": r["ok"], "max_abs_err": r["max_abs_err"],
                                   "ok": not r["ok"]}
    else:
        out["triton_skipped"] = "triton is not importable here"
    for name in ("triton", "sdpa"):
        for r in out[name]:
            if not r["ok"]:
                log(f"  BASELINE MISMATCH {name} {r}")
    out["ok"] = (all(r["ok"] for r in out["triton"] + out["sdpa"]) and bool(out["sdpa"])
                 and (extend_attention_fwd is None or (bool(out["triton"]) and out["negative_control"]["ok"])))
    return out


def stage2(mod, extend_attention_fwd, device: str, cpu: bool, log) -> dict:
    """The whole stage: {"ok", "grid", "graph", "baselines", "seconds"}."""
    t0 = time.monotonic()
    res = {"grid": run_grid(mod, device, cpu, log)}
    log(f"  grid: {res['grid']['cases'] - res['grid']['failed']}/{res['grid']['cases']} within tolerance")
    if cpu:
        res["graph"] = {"skipped": "--cpu: no CUDA graphs on the CPU backend", "ok": None}
    else:
        res["graph"] = run_graph(mod, device, log)
        log(f"  graph replay: {'ok' if res['graph']['ok'] else 'FAILED'}")
    res["baselines"] = run_baselines(extend_attention_fwd, device, cpu, log)
    log(f"  baselines vs reference: {'ok' if res['baselines']['ok'] else 'FAILED'}")
    graph_ok = res["graph"]["ok"] is not False
    res["ok"] = res["grid"]["ok"] and graph_ok and res["baselines"]["ok"]
    res["seconds"] = round(time.monotonic() - t0, 1)
    return res
