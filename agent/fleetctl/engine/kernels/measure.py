"""The measured dispatch table (engine/kernels/dispatch.py's schema): on a GPU host, the deployed build
against the host's own SGLang Triton `extend_attention_fwd`, on the shapes of the models its servers run.

measured_table(ctx, python, pkg, module_path, key, backend, facts) -> the table dict (source "measured", or "none"
with why saying what failed); the pure parts, unit-tested:
  shapes_for(server_infos, configs) -> the shapes to measure (one per distinct per-rank shape)
  choose(measurements, min_speedup) -> (entries, measured shapes with their speedups)

Host side: probes/traffic/serverinfo.py (each server's /server_info over loopback and config.json under its
model_path) and probes/kernel/dispatchbench.py (kernels/verify_attention/dispatch_bench.py run by the SGLang
interpreter in a fresh process as an unprivileged uid, killed at its deadline). What this module was checked on: a machine
with no GPU (the pure functions, and measured_table against fake probe answers); the CUDA timing itself
runs only on GPU hosts.
"""

from __future__ import annotations

import posixpath

from . import dispatch
from ...errors import FleetctlError

MIN_SPEEDUP = 1.1
PREFIXES = (1024, 4096, 16384)          # tokens of prefix per request, each capped by the server's context
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32)     # requests per verify call, capped by the server's CUDA-graph max batch
DEFAULT_MAX_BATCH = 32
BENCH = "dispatch_bench.py"
BENCH_DEADLINE_S = 240.0
BENCH_SLACK_S = 30.0
RESERVE_S = 300.0      # seconds of the host's deadline left for the activation, restart and gates after measuring
DTYPES = {"float16": "float16", "half": "float16", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float32": "float32", "float": "float32"}


def _int(v) -> int | None:
    return v if type(v) is int and v >= 1 else None


def model_dtype(dtype, config: dict) -> str | None:
    """The activations' dtype SGLang serves with: --dtype (sglang/srt/arg_groups/fields/model.py:160-170 of
    0.5.23: "auto" is FP16 for FP32 and FP16 models, BF16 for BF16 models; ModelConfig._get_and_verify_dtype,
    configs/model_config.py:881) over config.json's torch_dtype (or dtype). None when unknown."""
    if isinstance(dtype, str) and dtype != "auto":
        return DTYPES.get(dtype)
    said = config.get("torch_dtype") or config.get("dtype")
    if said in ("float32", "float16"):
        return "float16"
    return "bfloat16" if said == "bfloat16" else None


def _name(value) -> str:
    """A host's value as the table's `why` may quote it (the table is world-readable, review R4-7):
    itself when a short name (letters, digits, `_.-`, at most 32), else "(not a name)"."""
    ok = isinstance(value, str) and 0 < len(value) <= 32 and all(c.isascii() and (c.isalnum() or c in "_.-")
                                                                  for c in value)
    return value if ok else "(not a name)"


def shape_of(info: dict, config: dict) -> tuple[dict | None, str | None]:
    """(shape, None) or (None, why) of one server: its /server_info (ServerArgs names) and its model's
    config.json (text_config's fields when the top level lacks them: multimodal configs).

    Per attention-TP rank: attn_tp = tp_size, divided by dp_size with enable_dp_attention
    (srt/layers/dp_attention.py:445-456 compute_dp_attention_world_info, 0.5.23); q_heads =
    num_attention_heads // attn_tp (configs/model_config.py:1620-1623 get_num_attention_heads), kv_heads =
    max(1, num_key_value_heads // attn_tp) (model_config.py:1700-1711 get_num_kv_heads), group = q_heads //
    kv_heads; head_dim = config's head_dim, else hidden_size // num_attention_heads (model_config.py:1341-1350);
    draft_tokens = speculative_num_draft_tokens, topk = speculative_eagle_topk (arg_groups/fields/spec.py:62-66);
    dtype model_dtype(); a kv_cache_dtype other than auto or the model dtype (fp8 ...) is not served (the hook
    falls back on mixed dtypes). Batch buckets: BATCH_BUCKETS up to the server's CUDA-graph max batch
    (cuda_graph_max_bs, or cuda_graph_max_bs_decode of 0.5.23 arg_groups/fields/exec_.py:629), else
    DEFAULT_MAX_BATCH. Every value from the host is validated here (types, ranges)."""
    if not isinstance(info, dict) or not isinstance(config, dict):
        return None, "no /server_info or config.json"
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}

    def cfg(name):
        v = config.get(name)
        return text.get(name) if v is None else v
    if not info.get("speculative_algorithm"):
        return None, "the server does not speculate (no speculative_algorithm): no target verify to route"
    backend = info.get("attention_backend")
    if isinstance(backend, str) and backend != "triton":
        return None, "attention_backend %s: the hook serves the triton backend only" % _name(backend)
    tp, dp = _int(info.get("tp_size")) or 1, _int(info.get("dp_size")) or 1
    attn_tp = tp // dp if info.get("enable_dp_attention") is True and tp % dp == 0 else tp
    heads, kv = _int(cfg("num_attention_heads")), _int(cfg("num_key_value_heads")) or _int(cfg("num_attention_heads"))
    T = _int(info.get("speculative_num_draft_tokens"))
    if heads is None or T is None or T > 64:
        return None, "num_attention_heads or speculative_num_draft_tokens missing or out of range"
    if heads % attn_tp or heads > 4096:
        return None, "num_attention_heads %d does not split over attention TP %d" % (heads, attn_tp)
    head_dim = _int(cfg("head_dim"))
    if head_dim is None:
        hidden = _int(cfg("hidden_size"))
        if hidden is None or hidden % heads:
            return None, "no head_dim, and hidden_size does not divide by num_attention_heads"
        head_dim = hidden // heads
    if head_dim > 1024:
        return None, "head_dim %d out of range" % head_dim
    q_heads, kv_heads = heads // attn_tp, max(1, kv // attn_tp)
    if q_heads % kv_heads:
        return None, "%d query heads per rank are not a group of %d KV heads" % (q_heads, kv_heads)
    dtype = model_dtype(info.get("dtype"), {"torch_dtype": cfg("torch_dtype"), "dtype": cfg("dtype")})
    if dtype is None:
        return None, "the model's dtype is unknown (/server_info's dtype %s, config.json's torch_dtype %s)" % (
            _name(info.get("dtype")), _name(cfg("torch_dtype")))
    kvd = info.get("kv_cache_dtype")
    if kvd not in (None, "auto") and DTYPES.get(kvd) != dtype:
        return None, "kv_cache_dtype %s is not the model's %s: the hook serves one dtype" % (_name(kvd), dtype)
    cap = _int(info.get("cuda_graph_max_bs")) or _int(info.get("cuda_graph_max_bs_decode")) or DEFAULT_MAX_BATCH
    batches = [b for b in BATCH_BUCKETS if b <= cap] or [1]
    return {"head_dim": head_dim, "group": q_heads // kv_heads, "draft_tokens": T, "dtype": dtype,
            "q_heads": q_heads, "kv_heads": kv_heads, "topk": _int(info.get("speculative_eagle_topk")) or 1,
            "page_size": _int(info.get("page_size")) or 1, "batches": batches}, None


def shapes_for(server_infos: list, configs: list) -> list[dict]:
    """The shapes to measure, one per distinct (head_dim, group, draft_tokens, dtype, q_heads, kv_heads, topk),
    the batch buckets merged, from each server's /server_info and config.json (the two lists pair up; a
    server whose shape cannot be read is left out: shape_of says why, shapes_and_why collects it).
    Each shape: {head_dim, group, draft_tokens, dtype, q_heads, kv_heads, topk, page_size, batches}."""
    return shapes_and_why(server_infos, configs)[0]


def shapes_and_why(server_infos: list, configs: list) -> tuple[list[dict], list[str]]:
    """(shapes_for's shapes, [why each server left out was])."""
    out, why = {}, []
    for i, (info, config) in enumerate(zip(server_infos, configs)):
        shape, reason = shape_of(info, config)
        if shape is None:
            why.append("server %d: %s" % (i, reason))
            continue
        k = tuple(shape[n] for n in ("head_dim", "group", "draft_tokens", "dtype", "q_heads", "kv_heads", "topk"))
        if k in out:
            out[k]["batches"] = sorted(set(out[k]["batches"]) | set(shape["batches"]))
        else:
            out[k] = shape
    return list(out.values()), why


def choose(measurements: list, min_speedup: float = MIN_SPEEDUP, prefixes: list | None = None) -> tuple[list, list]:
    """(entries, shapes) of dispatch_bench's measured shapes ([shape + {"results": [{batch, prefix, speedup,
    agree, ...}]}]).

    A batch bucket meets the bar when, at EVERY prefix of `prefixes` (default: every prefix the shape has
    results for), it was timed (not skipped, no error), the outputs agreed and speedup >= min_speedup. The
    hook routes every batch <= max_batch, so max_batch is the largest bucket b such that every bucket <= b met
    it (a slower small batch is never routed because a larger one won); the smallest failing: no entry. An
    entry {head_dim, group, draft_tokens, dtype, max_batch, speedup: per prefix the least speedup over the
    routed buckets}. Several measured shapes of one table key (other q_heads or topk) keep the smallest
    max_batch. shapes: every measured shape with its per-batch speedups, enabled, max_batch and why."""
    entries, shapes = {}, []
    for m in measurements:
        rows = [r for r in m.get("results") or [] if isinstance(r, dict)]
        ps = list(prefixes) if prefixes is not None else sorted({r.get("prefix") for r in rows
                                                                if type(r.get("prefix")) is int})
        by = {}
        for r in rows:
            by.setdefault(r.get("batch"), {})[r.get("prefix")] = r
        met, why, per_batch = [], None, {}
        for b in sorted(x for x in by if type(x) is int):
            sp = [by[b].get(p, {}).get("speedup") for p in ps]
            per_batch[b] = sp
            ok = bool(ps) and all(isinstance(s, (int, float)) and s >= min_speedup and by[b][p].get("agree") is True
                                  for s, p in zip(sp, ps))
            if not ok:
                why = why or "batch %d: speedups %s at prefixes %s (below %.2fx, not timed, or outputs disagreed)" % (
                    b, sp, ps, min_speedup)
                break
            met.append(b)
        rec = {k: m.get(k) for k in ("head_dim", "group", "draft_tokens", "dtype", "q_heads", "kv_heads", "topk")}
        rec.update(speedups={str(b): s for b, s in per_batch.items()}, enabled=bool(met),
                   max_batch=max(met) if met else None, why=why if not met else None)
        shapes.append(rec)
        if met:
            key = (m["head_dim"], m["group"], m["draft_tokens"], m["dtype"])
            speed = [min(by[b][p]["speedup"] for b in met) for p in ps]
            e = {"head_dim": key[0], "group": key[1], "draft_tokens": key[2], "dtype": key[3], "max_batch": max(met),
                 "speedup": [round(s, 3) for s in speed]}
            if key not in entries or e["max_batch"] < entries[key]["max_batch"]:
                entries[key] = e
    return list(entries.values()), shapes


def measured_table(ctx, python: str, pkg, module_path: str, key: str, backend: str, facts: dict,
                   min_speedup: float = MIN_SPEEDUP, deadline_s: float = BENCH_DEADLINE_S) -> dict:
    """The dispatch table of build `key` of `backend` (its module `module_path` on the host, PASSED's, in BUILD/build/
    beside BUILD/src where dispatch_bench.py was uploaded) measured on the host of `ctx` with the SGLang
    interpreter `python`: the servers of `facts` (gather's: "servers") asked for their shapes
    (probes/traffic/serverinfo.py), then probes/kernel/dispatchbench.py under a deadline. Source "measured" (entries only
    where choose() enables them; measured: {prefixes, min_speedup, shapes, device}), or source "none" with
    why saying what failed: no servers, no shape, a probe failure or timeout, no CUDA device, a CPU answer.
    Never raises for a measurement problem (FleetctlError, OSError, ValueError, KeyError, TypeError)."""
    from ..validate import SmokeOptions, smoke_targets

    def none(why):
        return dispatch.none_table(pkg.name, key, backend, why)
    try:
        servers = smoke_targets(ctx.host, facts, SmokeOptions(), inside=ctx.container is not None)
        if not servers:
            return none("no SGLang server on the host: no shape to measure")
        info = ctx.probe("traffic.serverinfo", {"servers": servers, "port": ctx.host.sglang_port,
                                        "host": ctx.host.sglang_host if ctx.host.sglang_port is not None else None,
                                        "api_key": ctx.host.sglang_api_key,
                                        "server_user": ctx.host.server_user}, python=python, timeout=120)
        got = [s for s in info.get("servers") or [] if isinstance(s, dict)]
        shapes, why = shapes_and_why([s.get("server_info") for s in got], [s.get("config") for s in got])
        why += ["%s:%s: %s" % (s.get("host"), s.get("port"), s["error"]) for s in got if s.get("error")]
        if not shapes:
            said = "; ".join(why)[:600] or "no server answered"
            return none("no shape to measure: " + said)
        contexts = [s["server_info"].get("context_length") for s in got if isinstance(s.get("server_info"), dict)]
        ctxlen = min([c for c in contexts if type(c) is int and c > 0] or [max(PREFIXES) + 64])
        prefixes = [p for p in PREFIXES if p + 64 <= ctxlen] or [max(1, ctxlen // 2)]
        remaining = getattr(ctx, "remaining", None)
        if remaining is not None:  # leave the host's deadline RESERVE_S for the change that follows
            deadline_s = min(deadline_s, remaining() - RESERVE_S - 2 * BENCH_SLACK_S)
            if deadline_s < 30:
                return none("not measured: %.0f s left of the host's deadline" % remaining())
        bdir = posixpath.dirname(posixpath.dirname(module_path))
        req = {"module": module_path, "device": "cuda", "prefixes": prefixes, "shapes": shapes, "iters": 20,
               "deadline_s": deadline_s}
        res = ctx.probe("kernel.dispatchbench", {"src_dir": posixpath.join(bdir, "src"), "script": BENCH, "request": req,
                                                 "deadline_s": deadline_s + BENCH_SLACK_S,
                                                 "server_pids": [s["pid"] for s in servers if isinstance(s.get("pid"), int)],
                                                 "unprivileged_user": ctx.host.unprivileged_user},
                        python=python, timeout=deadline_s + 2 * BENCH_SLACK_S)
    except (FleetctlError, OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return none("not measured: %s: %s" % (type(e).__name__, str(e)[:400]))
    answer = res.get("answer") if isinstance(res, dict) else None
    if not isinstance(answer, dict) or not answer.get("ok"):
        what = (answer or {}).get("error") if isinstance(answer, dict) else None
        return none("not measured: %s" % (
            what or ("dispatch_bench timed out" if (res or {}).get("timed_out") else
                     "dispatch_bench exit %s: %s" % ((res or {}).get("rc"), str((res or {}).get("stderr_tail"))[-300:]))))
    if answer.get("device") != "cuda" or answer.get("graphs") is not True:
        return none("not measured: dispatch_bench answered device %r, graphs %r: "
                    "only CUDA-graph timings enable a shape" % (answer.get("device"), answer.get("graphs")))
    entries, measured = choose(answer.get("shapes") or [], min_speedup, prefixes)
    doc = {"prefixes": prefixes, "min_speedup": min_speedup, "shapes": measured, "device": answer.get("device_name"),
           "sglang": answer.get("sglang")}
    why_line = ("measured on %s against SGLang %s extend_attention_fwd under CUDA graphs: %d of %d shapes >= %.2fx "
                "at every prefix %s" % (answer.get("device_name"), (answer.get("sglang") or {}).get("version"),
                                        len(entries), len(measured), min_speedup, prefixes))
    return dispatch.measured_table(pkg.name, key, backend, entries, doc, why_line)
