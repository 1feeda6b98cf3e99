"""Stage 2: every backend under test (the new kernel first, the CUDA backend beside it) against the
float64 reference (kernel.yaml's tolerances) through both entries, under CUDA graph replay, with
torch.cuda.set_sync_debug_mode("error") around a call, and the baselines against the same reference
(which checks how the SGLang calls are set up: custom_mask layout, indptrs and indices).

GPU grid (small prefixes; B = 2, the second request's prefix P // 2 + 3, so requests are ragged;
Hq = 8 as in a TP8 slice, Hkv = 8 / G): T in {1, 4, 8, 64} x P in {0, 1, 4097} x G in {1, 8} x D in
{64, 128, 256} x fp16/bf16 = 144 inputs, each through verify_attention with num_splits 0 (the
heuristic) and 5, and through verify_attention_sglang (sglang_layout.py's inputs: the FULL_MASK as
SGLang's eager bool tensor or its uint8 graph buffer, alternating, its prefix columns garbage in
every other case) with num_splits 0 and 5; draft trees cycle through random / chain / star parent
lists, one mask per request or one shared, req_to_token int32 or int64. The reference runs on the
GPU in float64. The 64k prefix is checked by the graph replays.
CPU grid (--cpu): T in {1, 4, 8} x P in {0, 1, 33} x G in {1, 8} x D = 64 x fp16/bf16 = 36 inputs.
"""

from __future__ import annotations

import itertools
import time

import torch

from common import compare, kargs, make_inputs, target_verify_args, verify_attention_ref

TREES = ("random", "chain", "star")


def grid(cpu: bool) -> list[dict]:
    """The input cases: dicts of B, T, P, G, Hkv, D, dtype, tree, shared, r2t, seed."""
    if cpu:
        Ts, Ps, Gs, Ds = (1, 4, 8), (0, 1, 33), (1, 8), (64,)
    else:
        Ts, Ps, Gs, Ds = (1, 4, 8, 64), (0, 1, 4097), (1, 8), (64, 128, 256)
    cases = []
    for i, (T, P, G, D, dtype) in enumerate(itertools.product(Ts, Ps, Gs, Ds, ("float16", "bfloat16"))):
        cases.append({"B": 2, "T": T, "prefix_lens": [P, P // 2 + 3], "G": G, "Hkv": 8 // G, "D": D, "dtype": dtype,
                      "tree": TREES[i % 3], "shared_mask": i % 2 == 1, "r2t": "int64" if i % 4 >= 2 else "int32",
                      "seed": 1000 + i})
    return cases


def run_grid(backends: dict, device: str, cpu: bool, log, deadline: float = float("inf")) -> dict:
    """Every grid case through every backend's two entries (num_splits 0 and 5; the CPU backend
    ignores it, so --cpu runs 0 only). Each result names its backend and entry. No case starts past
    `deadline` (time.monotonic()); the cases left are counted in "not_run" and the grid is not ok."""
    splits = (0,) if cpu else (0, 5)
    results = []
    cases = grid(cpu)
    not_run = 0
    for i, c in enumerate(cases):
        if time.monotonic() > deadline:
            not_run = len(cases) - i
            log(f"  budget: {not_run} grid cases not run")
            break
        x = make_inputs(c["B"], c["T"], c["prefix_lens"], c["Hkv"], c["G"], c["D"], getattr(torch, c["dtype"]), device,
                        c["seed"], getattr(torch, c["r2t"]), c["shared_mask"], c["tree"])
        want = verify_attention_ref(**kargs(x))
        mask = "uint8" if i % 2 else "bool"
        a = target_verify_args(x, mask, "garbage" if i % 4 >= 2 else "true")
        facts = {k: c[k] for k in ("T", "prefix_lens", "G", "Hkv", "D", "dtype", "tree", "shared_mask", "r2t")}
        for name, mod in backends.items():
            for s in splits:
                r = compare(mod.verify_attention(**kargs(x), num_splits=s), want, c["dtype"])
                results.append({**facts, "backend": name, "entry": "req_to_token", "num_splits": s, **r})
                a["o"].fill_(float("nan"))
                mod.verify_attention_sglang(**a, num_splits=s)
                r = compare(a["o"], want, c["dtype"])
                results.append({**facts, "backend": name, "entry": f"sglang-{mask}", "num_splits": s, **r})
                for res in results[-2:]:
                    if not res["ok"]:
                        log(f"  MISMATCH {res}")
        del x, want, a
    fails = [r for r in results if not r["ok"]]
    return {"ok": bool(results) and not fails and not not_run, "cases": len(results), "failed": len(fails),
            "not_run": not_run, "results": results}


def _sglang_graph_inputs(G: int, D: int, T: int, dtype, device: str, max_prefix: int) -> tuple[dict, dict]:
    """Static SGLang-layout buffers sized for [max_prefix, max_prefix // 2 + 3] (as SGLang's graph
    buffers are sized for the longest context): (entry args, reference-layout inputs at that size)."""
    big = make_inputs(2, T, [max_prefix, max_prefix // 2 + 3], 8 // G, G, D, dtype, device, seed=77)
    return target_verify_args(big, "uint8"), big


def _refill_sglang(a: dict, full: dict, plens: list[int], T: int, gen) -> dict:
    """Rewrite the SGLang buffers in place for prefix lengths `plens` (as _update_target_verify_buffers
    does before a replay, triton_backend.py:592-653): kv_indptr, kv_indices (a fresh random pick of
    slots), the uint8 mask and mask_indptr. Returns the reference-layout inputs of the new call."""
    from sglang_layout import reference_args

    dev = a["q"].device
    num_slots = a["k_buffer"].shape[0]
    slots = torch.randperm(num_slots, generator=gen, device=dev)[:sum(plens)]
    a["kv_indptr"][1:] = torch.cumsum(torch.tensor(plens, device=dev), 0).to(a["kv_indptr"].dtype)
    a["kv_indices"][:sum(plens)] = slots
    tree = full["tree_mask"]
    trees = tree.expand(2, T, T) if tree.dim() == 2 else tree
    rows = []
    for b, P in enumerate(plens):
        m = torch.ones(T, P + T, dtype=torch.uint8, device=dev)
        m[:, P:] = trees[b].to(torch.uint8)
        rows.append(m.flatten())
    mask = torch.cat(rows)
    a["custom_mask"][:mask.numel()] = mask
    a["mask_indptr"][1:] = torch.cumsum(torch.tensor([T * (P + T) for P in plens], device=dev), 0)
    view = dict(a, kv_indices=a["kv_indices"][:sum(plens)])
    return reference_args(view, tree)


def run_graph(backends: dict, device: str, log) -> dict:
    """Capture each backend once in a CUDA graph per entry, then replay it with every prefix.

    req_to_token entry: static inputs sized for the longest prefix (65536, so the split heuristic,
    which reads req_to_token's width, is the same in eager and replay); capture with prefixes
    [4097, 2051]; each replay rewrites prefix_lens and req_to_token in place.
    SGLang entry: SGLang's static buffers (kv_indices and the uint8 mask sized for 65536), captured
    at [4097, 2051]; each replay rewrites kv_indptr, kv_indices, custom_mask and mask_indptr in place.
    Every replay (longer and shorter prefixes than at capture) must equal an eager call on the same
    tensors bit for bit and the float64 reference within tolerance. Two configurations:
    (G 8, D 128, bf16) and (G 1, D 64, fp16), T 8.
    """
    configs = [{"G": 8, "D": 128, "dtype": "bfloat16", "T": 8}, {"G": 1, "D": 64, "dtype": "float16", "T": 8}]
    prefixes = (0, 1, 4097, 65536)
    out = {"ok": True, "configs": []}
    for name, mod in backends.items():
        for cfg in configs:
            for entry in ("req_to_token", "sglang"):
                rec = {**cfg, "backend": name, "entry": entry, "capture_prefix_lens": [4097, 2051], "replays": []}
                try:
                    _graph_one(mod, entry, cfg, prefixes, device, rec, log)
                except Exception as e:  # a capture failure is this check failing, not the script
                    rec["error"] = f"{type(e).__name__}: {e}"[:2000]
                rec["ok"] = "error" not in rec and len(rec["replays"]) == len(prefixes) and all(
                    r["equal_to_eager"] and r["ok"] for r in rec["replays"])
                out["ok"] = out["ok"] and rec["ok"]
                out["configs"].append(rec)
                torch.cuda.empty_cache()
    return out


def _graph_one(mod, entry: str, cfg: dict, prefixes, device: str, rec: dict, log) -> None:
    G, D, T, dtype = cfg["G"], cfg["D"], cfg["T"], getattr(torch, cfg["dtype"])
    if entry == "req_to_token":
        big = make_inputs(2, T, [65536, 65536 // 2 + 3], 8 // G, G, D, dtype, device, seed=77)
        x = kargs(big)
        x["prefix_lens"] = torch.tensor([4097, 4097 // 2 + 3], dtype=torch.int64, device=device)
        call = lambda: mod.verify_attention(**x)  # noqa: E731
    else:
        a, big = _sglang_graph_inputs(G, D, T, dtype, device, 65536)
        _refill_sglang(a, big, [4097, 2051], T, torch.Generator(device=device).manual_seed(1))

        def call():
            mod.verify_attention_sglang(**a)
            return a["o"]
    num_slots = big["k_cache"].shape[0]
    call()                                                   # warm-up outside the graph
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_out = call()
    for i, P in enumerate(prefixes):
        plens = [P, P // 2 + 3]
        gen = torch.Generator(device=device).manual_seed(500 + i)
        if entry == "req_to_token":
            perm = torch.randperm(num_slots, generator=gen, device=device)
            rows = x["req_pool_indices"].tolist()
            start = 0
            for b, n in enumerate(p + T for p in plens):
                x["req_to_token"][rows[b], :n] = perm[start:start + n].to(x["req_to_token"].dtype)
                start += n
            x["prefix_lens"].copy_(torch.tensor(plens, dtype=torch.int64))
            ref = x
        else:
            ref = _refill_sglang(a, big, plens, T, gen)
        g.replay()
        torch.cuda.synchronize()
        replayed = static_out.clone()
        if entry == "req_to_token":
            eager = mod.verify_attention(**x)
        else:
            eager_args = dict(a, o=torch.empty_like(a["o"]))
            mod.verify_attention_sglang(**eager_args)
            eager = eager_args["o"]
        r = compare(replayed, verify_attention_ref(**ref), cfg["dtype"])
        equal = bool(torch.equal(replayed, eager))
        rec["replays"].append({"prefix_lens": plens, "equal_to_eager": equal, **r})
        if not (equal and r["ok"]):
            log(f"  GRAPH MISMATCH {rec['backend']} {entry} {cfg} prefix_lens={plens} equal={equal} {r}")
    del g, static_out


def run_sync_debug(backends: dict, device: str) -> dict:
    """Each entry called once under torch.cuda.set_sync_debug_mode("error") (after a warm-up outside
    it): a host synchronisation on the call path raises there. {"ok", "calls": [...]}."""
    x = make_inputs(2, 8, [4097, 100], 2, 4, 128, torch.bfloat16, device, seed=88)
    a = target_verify_args(x, "uint8")
    calls = []
    for name, mod in backends.items():
        for entry, fn in (("req_to_token", lambda: mod.verify_attention(**kargs(x))),
                          ("sglang", lambda: mod.verify_attention_sglang(**a))):
            fn()
            torch.cuda.synchronize()
            rec = {"backend": name, "entry": entry}
            try:
                torch.cuda.set_sync_debug_mode("error")
                fn()
                rec["ok"] = True
            except Exception as e:  # noqa: BLE001 - the sync is the finding
                rec.update(ok=False, error=f"{type(e).__name__}: {e}"[:1000])
            finally:
                torch.cuda.set_sync_debug_mode(0)
            calls.append(rec)
    return {"ok": all(c["ok"] for c in calls), "calls": calls}


def run_baselines(extend_attention_fwd, verify_splitkv_fwd, device: str, cpu: bool, log) -> dict:
    """SGLang's Triton path, its split-KV verify kernel and gather + SDPA against the float64 reference.

    Triton: B = 2 with ragged prefixes [37, 0] and one tree per request (so mask_indptr and
    kv_indptr offsets differ per request), Hq = 8, G in {1, 8}, D 64 (CPU) or 64/128/256 (GPU).
    Negative control: the same call with each request's tree mask transposed (a draft token then
    sees its descendants instead of its ancestors) must NOT match, or the comparison proves nothing.
    verify_splitkv_fwd: the same shapes on causal chains (the only trees it serves; on the CPU one
    shape, G 8 fp16: the interpreter takes seconds per call), compared after its scratch is zeroed
    (baselines.zero_splitkv_scratch says why); a call that raises is recorded ("error"), and
    stage 4 then reports its figure as unmeasured. SDPA: equal prefixes [40, 40] (its mask needs one length).
    """
    import baselines

    out = {"triton": [], "splitkv": [], "sdpa": [], "ok": True}
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
        if verify_splitkv_fwd is not None and (not cpu or (G, dt) == (8, "float16")):
            c = make_inputs(2, 8, [37, 5], 8 // G, G, D, getattr(torch, dt), device, seed=350 + i, tree="chain")
            rec = {"G": G, "D": D, "dtype": dt, "prefix_lens": [37, 5], "tree": "chain"}
            try:
                meta = baselines.sglang_target_verify_metadata(c)
                baselines.splitkv_target_verify(verify_splitkv_fwd, c, meta)      # allocates its scratch
                rec["scratch_zeroed"] = baselines.zero_splitkv_scratch(verify_splitkv_fwd)
                got = baselines.splitkv_target_verify(verify_splitkv_fwd, c, meta)
                rec.update(compare(got, verify_attention_ref(**kargs(c)), dt))
            except Exception as e:  # noqa: BLE001 - recorded: stage 4's figure is then unmeasured
                rec.update(ok=None, error=f"{type(e).__name__}: {e}"[:1000])
            out["splitkv"].append(rec)
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
    for name in ("triton", "splitkv", "sdpa"):
        for r in out[name]:
            if r["ok"] is False:
                log(f"  BASELINE MISMATCH {name} {r}")
    out["ok"] = (all(r["ok"] for r in out["triton"] + out["sdpa"]) and bool(out["sdpa"])
                 and all(r["ok"] is not False for r in out["splitkv"])
                 and (extend_attention_fwd is None or (bool(out["triton"]) and out["negative_control"]["ok"])))
    return out


def stage2(backends: dict, extend_attention_fwd, verify_splitkv_fwd, device: str, cpu: bool, log,
           grid_budget_s: float = float("inf")) -> dict:
    """The whole stage: {"ok", "grid", "graph", "sync_debug", "baselines", "seconds"}; the grid starts
    no case after grid_budget_s seconds (its "not_run" counts them)."""
    t0 = time.monotonic()
    res = {"grid": run_grid(backends, device, cpu, log, t0 + grid_budget_s)}
    log(f"  grid: {res['grid']['cases'] - res['grid']['failed']}/{res['grid']['cases']} within tolerance")
    if cpu:
        res["graph"] = {"skipped": "--cpu: no CUDA graphs on the CPU backend", "ok": None}
        res["sync_debug"] = {"skipped": "--cpu: torch.cuda.set_sync_debug_mode needs CUDA", "ok": None}
    else:
        res["graph"] = run_graph(backends, device, log)
        log(f"  graph replay: {'ok' if res['graph']['ok'] else 'FAILED'}")
        res["sync_debug"] = run_sync_debug(backends, device)
        log(f"  no host sync (set_sync_debug_mode error): {'ok' if res['sync_debug']['ok'] else 'FAILED'}")
    res["baselines"] = run_baselines(extend_attention_fwd, verify_splitkv_fwd, device, cpu, log)
    log(f"  baselines vs reference: {'ok' if res['baselines']['ok'] else 'FAILED'}")
    res["ok"] = (res["grid"]["ok"] and res["graph"]["ok"] is not False and res["sync_debug"]["ok"] is not False
                 and res["baselines"]["ok"])
    res["seconds"] = round(time.monotonic() - t0, 1)
    return res
