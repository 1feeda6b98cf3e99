"""The dispatch table's measurement (run on the host by the interpreter SGLang runs with, by fleetctl's
dispatchbench probe): the deployed build's SGLang-layout entry against the host's own SGLang Triton
`extend_attention_fwd`, per shape, per prefix, per batch bucket, both timed under CUDA graphs.

    python dispatch_bench.py < request.json       # prints one JSON line (the answer), exit 0
    python dispatch_bench.py --input request.json

Request (JSON): {"module": the build's module path (PASSED's: a .so, or the triton build's .py),
  "device": "cuda" (default) | "cpu", "prefixes": [int tokens per request], "iters": timed replays (20),
  "calls": calls per graph (0: sized to ~TARGET_MS), "deadline_s": no measurement starts past it (240),
  "memory_fraction": of the device's free memory one measurement may use (0.5),
  "shapes": [{"head_dim", "group", "draft_tokens", "dtype", "q_heads", "kv_heads", "topk", "batches": [int]}]}
  (q_heads, kv_heads: per TP rank; group = q_heads / kv_heads; topk 1: a chain draft, else a tree).

Answer: {"ok", "device", "device_name", "graphs", "sglang": {"version", "module"} | None, "prefixes",
  "shapes": [shape + {"results": [{"batch", "prefix", "ms_build", "ms_sglang", "speedup" (ms_sglang /
  ms_build), "timing", "max_abs_diff", "agree"} or {"batch", "prefix", "skipped" | "error"}]}],
  "error", "note", "seconds"}. Times in milliseconds per call.

Inputs: kernels/verify_attention/sglang_layout.py `target_verify_args` with mask "uint8" (SGLang's CUDA-graph
buffer layout), page size 1, slot 0 left unused (SGLang's dummy slot), slots a random permutation.
SGLang's call is the one TritonAttnBackend.forward_extend makes in target verify (0.5.23
srt/layers/attention/triton_backend.py:1888-1916: q, k, v, o, k_buffer, v_buffer, qo_indptr, kv_indptr,
kv_indices, custom_mask, causal=True, mask_indptr, max_extend_len, k_descale=1.0, v_descale=1.0, scaling,
logit_cap=0.0, sliding_window_size=-1, sinks=None, window_kv_offsets=None, xai_temperature_len=-1,
page_size=1, score_mod=None, aux_tensors=None, extend_seq_lens_cpu=None), keywords the installed
release's extend_attention_fwd does not take dropped. The function is imported from the host's own
sglang: sglang.kernels.ops.attention.extend_attention (0.5.23), else
sglang.srt.layers.attention.triton_ops.extend_attention (0.4.x to 0.5.10).

Timing (cuda): one eager call of each (compile, load), then `calls` back-to-back calls captured in one
torch.cuda.CUDAGraph (after a warm-up call on a side stream, as torch's docs ask), one warm-up replay,
then `iters` replays each between two CUDA events; ms = median replay / calls. A capture that fails is an
error for that point (never timed eagerly instead: the table is for CUDA-graph serving). The K/V of one
point is one buffer, read again by every call of the graph (the L2 favours both kernels alike at small
prefixes). A point whose inputs would take more than memory_fraction of the free device memory (a host
whose servers hold most of it) is skipped, saying so.

--device cpu (request "device": "cpu") is a plumbing check only: eager calls of the build's CPU entry
against the package's float64 reference (reference.py), timed with
perf_counter; the answer says "device": "cpu", "graphs": false, and fleetctl never enables a shape from
it. Nothing here was timed on a GPU by the machine this was written on (no GPU there); the CUDA path
runs only on GPU hosts.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.machinery
import importlib.util
import inspect
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TARGET_MS = 10.0      # a graph's calls are sized to about this much work
MAX_CALLS = 64
# kernel.yaml's tolerances, doubled: the build and SGLang's kernel are both approximations of the reference
AGREE = {"float32": (4.0e-5, 2.0e-4), "float16": (4.0e-3, 1.0e-2), "bfloat16": (2.0e-2, 4.0e-2)}
SGLANG_MODULES = ("sglang.kernels.ops.attention.extend_attention",
                  "sglang.srt.layers.attention.triton_ops.extend_attention")


def load_entry(module_path: str):
    """The build's `verify_attention_sglang`, its module loaded from its path (.so or .py)."""
    name = os.path.basename(module_path).split(".")[0]
    if module_path.endswith(".py"):
        loader = importlib.machinery.SourceFileLoader(name, module_path)
    else:
        loader = importlib.machinery.ExtensionFileLoader(name, module_path)
    spec = importlib.util.spec_from_file_location(name, module_path, loader=loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod.verify_attention_sglang


def load_sglang():
    """(extend_attention_fwd, {"version", "module"}) from the host's sglang. Raises ImportError."""
    errors = []
    for name in SGLANG_MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError as e:
            errors.append("%s: %s" % (name, e))
            continue
        try:
            version = importlib.import_module("sglang.version").__version__
        except Exception:  # noqa: BLE001 - the version is a note
            version = None
        return mod.extend_attention_fwd, {"version": version, "module": mod.__file__}
    raise ImportError("no extend_attention_fwd in the host's sglang: " + "; ".join(errors))


def sglang_call(fwd, a: dict, o):
    """A zero-argument call of SGLang's extend_attention_fwd on the target-verify arguments `a`
    (sglang_layout.target_verify_args) writing `o`, as triton_backend.py:1888-1916 (0.5.23) calls it."""
    kw = {"logit_cap": 0.0, "sliding_window_size": -1, "sinks": None, "window_kv_offsets": None,
          "xai_temperature_len": -1, "page_size": 1, "score_mod": None, "aux_tensors": None,
          "extend_seq_lens_cpu": None}
    params = inspect.signature(fwd).parameters
    kw = {k: v for k, v in kw.items() if k in params}
    args = (a["q"], a["k_extend"], a["v_extend"], o, a["k_buffer"], a["v_buffer"], a["qo_indptr"], a["kv_indptr"],
            a["kv_indices"], a["custom_mask"], True, a["mask_indptr"], a["T"], 1.0, 1.0, a["sm_scale"])

    def call():
        fwd(*args, **kw)
    return call


def build_call(entry, a: dict, o):
    """A zero-argument call of the build's entry on `a`, positional as the hook calls it."""
    args = (a["q"], a["k_extend"], a["v_extend"], o, a["k_buffer"], a["v_buffer"], a["qo_indptr"], a["kv_indptr"],
            a["kv_indices"], a["custom_mask"], a["mask_indptr"], a["T"], a["sm_scale"])

    def call():
        entry(*args)
    return call


def need_bytes(B: int, P: int, T: int, hq: int, hkv: int, D: int, elem: int) -> int:
    """Bytes one point's inputs take at least: K/V pools, q/o (two outputs), the drafts' K/V, the
    uint8 mask, the index tensors."""
    slots = B * (P + T) + 1
    return (2 * slots * hkv * D + 3 * B * T * hq * D + 2 * B * T * hkv * D) * elem + B * T * (P + T) + 16 * B * (P + T)


def make_args(torch, B: int, P: int, T: int, hq: int, hkv: int, D: int, dtype, device: str, topk: int, seed: int):
    """(SGLang-layout arguments (mask "uint8"), reference-layout inputs) of B requests of prefix P."""
    sys.path.insert(0, HERE)
    try:
        from reference import tree_mask_from_parents
        from sglang_layout import target_verify_args
    finally:
        sys.path.remove(HERE)
    gen = torch.Generator(device=device).manual_seed(seed)
    host = torch.Generator().manual_seed(seed)
    slots = B * (P + T) + 1
    perm = torch.randperm(slots - 1, generator=gen, device=device) + 1      # slot 0: SGLang's dummy
    r2t = perm[:B * (P + T)].view(B, P + T).to(torch.int32)
    if topk <= 1:
        parents = [i - 1 for i in range(T)]
    else:
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=host)) for i in range(1, T)]

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype)

    x = dict(q=randn(B * T, hq, D), k_cache=randn(slots, hkv, D), v_cache=randn(slots, hkv, D), req_to_token=r2t,
             req_pool_indices=torch.arange(B, device=device), prefix_lens=torch.full((B,), P, dtype=torch.int64,
                                                                                     device=device),
             tree_mask=tree_mask_from_parents(parents).to(device), sm_scale=D ** -0.5)
    return target_verify_args(x, mask="uint8"), x


def graph_ms(torch, fn, calls: int, iters: int) -> float:
    """Median ms per call of `calls` calls of fn captured in one CUDA graph, over `iters` replays."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(iters):
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / calls)
    del g
    return statistics.median(samples)


def eager_ms(torch, fn, device: str) -> float:
    """ms of one eager call (after one untimed): sizes a graph (cuda) or is the CPU check's time."""
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def point(torch, req: dict, sh: dict, B: int, P: int, entry, other, device: str, left) -> dict:
    """One (shape, batch, prefix) measurement: the answer's result row."""
    D, T, hq, hkv = sh["head_dim"], sh["draft_tokens"], sh["q_heads"], sh["kv_heads"]
    dtype = getattr(torch, sh["dtype"])
    row = {"batch": B, "prefix": P}
    if left() <= 0:
        return dict(row, skipped="the deadline passed before this point")
    elem = torch.empty((), dtype=dtype).element_size()
    need = need_bytes(B, P, T, hq, hkv, D, elem)
    if device == "cuda":
        free, _ = torch.cuda.mem_get_info()
        if need > float(req.get("memory_fraction", 0.5)) * free:
            return dict(row, skipped="needs %d MiB, %.0f%% of the %d MiB free is allowed" % (
                need >> 20, 100 * float(req.get("memory_fraction", 0.5)), free >> 20))
    a, x = make_args(torch, B, P, T, hq, hkv, D, dtype, device, int(sh.get("topk") or 1), seed=B * 7919 + P)
    o_build, o_other = torch.full_like(a["q"], float("nan")), torch.full_like(a["q"], float("nan"))
    mine = build_call(entry, a, o_build)
    if device == "cuda":
        theirs = sglang_call(other, a, o_other)
    else:
        def theirs():
            o_other.copy_(other(**x))
    try:
        t1, t2 = eager_ms(torch, mine, device), eager_ms(torch, theirs, device)
        diff = (o_build.float() - o_other.float()).abs()
        atol, rtol = AGREE[sh["dtype"]]
        row["max_abs_diff"] = float(diff.max()) if diff.numel() else 0.0
        row["agree"] = bool(torch.isfinite(o_build).all()) and bool(
            (diff <= atol + rtol * o_other.float().abs()).all())
        if device == "cuda":
            calls = int(req.get("calls") or 0) or max(1, min(MAX_CALLS, int(TARGET_MS / max(t1, t2, 1e-3))))
            iters = int(req.get("iters") or 20)
            row.update(ms_build=graph_ms(torch, mine, calls, iters), ms_sglang=graph_ms(torch, theirs, calls, iters),
                       timing="cuda graph: %d calls per replay, median of %d replays" % (calls, iters))
        else:
            row.update(ms_build=t1, ms_sglang=t2, timing="eager perf_counter (cpu plumbing check)")
        row["speedup"] = row["ms_sglang"] / row["ms_build"] if row["ms_build"] > 0 else None
    except Exception as e:  # noqa: BLE001 - one point's failure is that point's
        row["error"] = "%s: %s" % (type(e).__name__, str(e)[:400])
        if device == "cuda":
            torch.cuda.synchronize()
    return row


def run(req: dict) -> dict:
    """The answer to request `req` (the module docstring). Never raises: failures land in error."""
    t0 = time.monotonic()
    device = req.get("device") or "cuda"
    out = {"ok": False, "device": device, "device_name": None, "graphs": device == "cuda", "sglang": None,
           "prefixes": [int(p) for p in req.get("prefixes") or []], "shapes": [], "error": None, "note": None,
           "seconds": None}
    deadline = float(req.get("deadline_s", 240))

    def left():
        return deadline - (time.monotonic() - t0)
    try:
        import torch

        if device == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError("torch %s sees no CUDA device" % torch.__version__)
            best = max(range(torch.cuda.device_count()), key=lambda i: torch.cuda.mem_get_info(i)[0])
            torch.cuda.set_device(best)
            out["device_name"] = "%s (cuda:%d)" % (torch.cuda.get_device_name(best), best)
            other, out["sglang"] = load_sglang()
        elif device == "cpu":
            sys.path.insert(0, HERE)
            try:
                from reference import verify_attention_ref as other
            finally:
                sys.path.remove(HERE)
            out["device_name"] = "cpu"
            out["note"] = ("cpu plumbing check: eager calls of the build's CPU entry against reference.py; it "
                           "measures nothing and fleetctl enables no shape from it")
        else:
            raise ValueError("device must be cuda or cpu, got %r" % device)
        entry = load_entry(req["module"])
        for sh in req.get("shapes") or []:
            rec = dict(sh, results=[])
            for B in sh["batches"]:
                for P in out["prefixes"]:
                    rec["results"].append(point(torch, req, sh, int(B), P, entry, other, device, left))
            out["shapes"].append(rec)
        out["ok"] = True
    except Exception as e:  # noqa: BLE001 - the caller records why nothing was measured
        out["error"] = "%s: %s" % (type(e).__name__, str(e)[:1000])
    out["seconds"] = round(time.monotonic() - t0, 3)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--input", help="the request's JSON file (default: stdin)")
    ap.add_argument("--device", choices=("cuda", "cpu"), help="overrides the request's device")
    a = ap.parse_args(argv)
    text = open(a.input).read() if a.input else sys.stdin.read()
    req = json.loads(text)
    if a.device:
        req["device"] = a.device
    print(json.dumps(run(req)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
