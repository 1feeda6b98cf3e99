"""The verdict on one server's measurement: its bottleneck, the figures behind it, and the change
that addresses it (or that none of fleetctl's does). Pure.

Inputs (probes/diagnose/run.py's entry): the trace breakdown (probes/diagnose/trace.py: class
shares of device time, host_wait_share), the expert balance (probes/diagnose/experts.py: per
layer and GPU, SGLang's balancedness), /server_info's KV token usage and speculative accept
length, and with --allocator-replay the install's replay runs (probes/traffic/allocreplay.py:
runs_per_alloc_mean with need_sort False and True).

The rules, in order (the first that holds is the verdict; the thresholds are module constants):

- MOE: a layer's GPU balancedness below MOE_BALANCE (its hot GPU does the work of
  1/balancedness average GPUs) while MoE kernels (experts and routing) take at least MOE_SHARE of
  device time. Action: SGLang's expert load balancer, `--enable-eplb` with
  `--ep-num-redundant-experts` (0.5.23 srt/arg_groups/fields/exec_.py:914-924).
- ATTENTION: attention kernels take at least ATTENTION_SHARE of device time. The verify pass's
  (target-verify, or extend kernels in a speculative server's decode steps) is fleetctl's to
  change: `fleetctl deploy kernel verify_attention` and the route-verify-attention playbook; decode
  or extend attention without speculative decoding is not (SGLang's --attention-backend).
- DEFRAG: with --allocator-replay, the release's own allocator left each prefill allocation in at
  least DEFRAG_RUNS contiguous runs on average with need_sort False, and need_sort True cuts that
  at least DEFRAG_GAIN times (under pressure, a sort on most admissions gains little: docs/guides/
  is-defrag-needed.md): the defrag-tier0 playbook.
- HOST: the device waits on the host at least HOST_SHARE of the step time: none of fleetctl's
  changes (scheduling and marshaling are SGLang's: its overlap scheduler, CUDA graphs). Only from
  a trace of device kernels (source "kernel"): on a CPU trace (the stand-in's annotated regions)
  host and device are the same processor, and its gaps are the unannotated CPU work, not a wait.
- NONE: nothing above holds: no bottleneck that any of these reaches.

A server whose trace could not be read gets UNMEASURED and why.
"""

from __future__ import annotations

from ...probes.diagnose import kernels as kc

MOE, ATTENTION, DEFRAG, HOST, NONE, UNMEASURED = "moe-imbalance", "attention", "kv-fragmentation", "host-bound", \
    "none", "unmeasured"
VERDICTS = (MOE, ATTENTION, DEFRAG, HOST, NONE, UNMEASURED)
MOE_BALANCE = 0.55
MOE_SHARE = 0.15
ATTENTION_SHARE = 0.6
DEFRAG_RUNS = 1.5
DEFRAG_GAIN = 1.5
HOST_SHARE = 0.4
NOT_FLEETCTL = "none of fleetctl's changes"


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def replay_fragmentation(runs: list[dict] | None, page_size: int | None) -> dict | None:
    """{kind, without_sort, with_sort} (runs_per_alloc_mean of the replay's need_sort False and True
    runs of the allocator kind the server uses: "paged" when its page_size is over 1, else
    "token"), or None when the replay gave no such pair."""
    kind = "paged" if (page_size or 1) > 1 else "token"
    pick = {r.get("need_sort"): r.get("runs_per_alloc_mean") for r in runs or [] if r.get("kind") == kind}
    if not isinstance(pick.get(False), (int, float)) or not isinstance(pick.get(True), (int, float)):
        return None
    return {"kind": kind, "without_sort": float(pick[False]), "with_sort": float(pick[True])}


def judge(server: dict, replay: list[dict] | None = None) -> dict:
    """The verdict on `server` (run.py's entry) and, with --allocator-replay, its install's replay
    runs: {"verdict" (VERDICTS), "why": the figures behind it (one line), "action": the change
    that addresses it (or NOT_FLEETCTL and whose it is), "figures": {attention_share, moe_share,
    host_wait_share, worst_layer, worst_gpu, balancedness, token_usage, kv_load, accept_length,
    fragmentation}}."""
    tr = server.get("trace")
    info = server.get("server_info") or {}
    ex = server.get("experts") or {}
    worst = ex.get("worst")
    frag = replay_fragmentation(replay, info.get("page_size"))
    if not tr or tr.get("device_us", 0) <= 0:
        return {"verdict": UNMEASURED, "why": server.get("error") or server.get("trace_error") or "no device time",
                "action": None, "figures": {}}
    sh = tr["shares"]
    attn = sum(sh.get(c, 0.0) for c in kc.ATTENTION)
    moe = sh.get(kc.MOE_EXPERTS, 0.0) + sh.get(kc.MOE_ROUTING, 0.0)
    host = tr.get("host_wait_share", 0.0)
    fig = {"attention_share": attn, "verify_share": sh.get(kc.VERIFY, 0.0), "moe_share": moe,
           "host_wait_share": host, "unknown_share": sh.get(kc.UNKNOWN, 0.0),
           "worst_layer": worst["layer"] if worst else None, "worst_gpu": worst["hot_gpu"] if worst else None,
           "balancedness": worst["balancedness"] if worst else None, "token_usage": info.get("token_usage"),
           "kv_load": info.get("kv_load"),
           "accept_length": info.get("avg_spec_accept_length"), "fragmentation": frag, "source": tr.get("source")}
    if worst and worst["balancedness"] < MOE_BALANCE and moe >= MOE_SHARE:
        return {"verdict": MOE, "figures": fig,
                "why": f"layer {worst['layer']}: GPU {worst['hot_gpu']} takes {_pct(worst['hot_gpu_share'])} of its "
                       f"tokens (balancedness {worst['balancedness']:.2f} < {MOE_BALANCE}); MoE kernels "
                       f"{_pct(moe)} of device time",
                "action": "SGLang's expert load balancer: --enable-eplb --ep-num-redundant-experts N"}
    if attn >= ATTENTION_SHARE:
        verify = sh.get(kc.VERIFY, 0.0)
        mine = verify >= attn / 2
        return {"verdict": ATTENTION, "figures": fig,
                "why": f"attention {_pct(attn)} of device time (target-verify {_pct(verify)}, extend "
                       f"{_pct(sh.get(kc.EXTEND, 0.0))}, decode {_pct(sh.get(kc.DECODE, 0.0))})",
                "action": ("fleetctl deploy kernel verify_attention, then fleetctl apply route-verify-attention"
                           if mine else f"{NOT_FLEETCTL}: decode/extend attention is SGLang's --attention-backend")}
    if frag and frag["without_sort"] >= DEFRAG_RUNS and frag["without_sort"] >= DEFRAG_GAIN * frag["with_sort"]:
        return {"verdict": DEFRAG, "figures": fig,
                "why": f"the {frag['kind']} allocator replay: {frag['without_sort']:.2f} runs per prefill allocation "
                       f"without sorting, {frag['with_sort']:.2f} with",
                "action": "fleetctl apply defrag-tier0"}
    if host >= HOST_SHARE and tr.get("source") == "kernel":
        return {"verdict": HOST, "figures": fig,
                "why": f"the device waits on the host {_pct(host)} of the decode steps",
                "action": f"{NOT_FLEETCTL}: scheduling and marshaling are SGLang's (overlap scheduler, CUDA graphs)"}
    return {"verdict": NONE, "figures": fig,
            "why": f"attention {_pct(attn)}, MoE {_pct(moe)}, "
                   + (f"host wait {_pct(host)}" if tr.get("source") == "kernel"
                      else f"gaps between regions {_pct(host)} (a CPU trace: no device to wait)")
                   + (f", balancedness {worst['balancedness']:.2f}" if worst else ""),
            "action": f"{NOT_FLEETCTL}: no bottleneck they reach"}
