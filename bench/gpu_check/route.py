"""Stage 7 (route): route-verify-attention's hook, rendered as the playbook renders it
(playbooks/templates/route-verify-attention/fleetctl_verify.py.j2, through fleetctl's own playbook loader)
over a published-style build tree in a temporary directory, called as SGLang's Triton backend calls it
(every keyword of the 0.5.23 guard, triton_backend.py:1851-1886, under extend_attention_fwd's names), under
CUDA graph capture and replay, with the routing evidence read back.

The tree (as kbuild's publish lays it out): TMP/pub/verify_attention/<key>/{src/, build/ (a copy of this run's extension
build: build.ninja names this torch and the arch), PASSED}, `current` -> <key>, dispatch.json (schema
fleetctl-dispatch/1, build <key>, one entry for the checked shape with max_batch MAX_BATCH), and
TMP/pub/route-evidence (root, 01777). Every directory 0755 and file 0644, root's: the hook trusts root-owned
builds only, so a run that is not root skips the stage, saying so.

On CUDA, per batch in BATCHES: static inputs (sglang_layout.target_verify_args, the uint8 graph mask), one
warm-up call on a side stream, verify_fwd captured in a torch.cuda.CUDAGraph, three replays, the output
against the float64 reference (kernel.yaml's tolerances); a batch over MAX_BATCH must return False (SGLang's
kernel then runs: nothing is captured for it). Then, FLUSH_WAIT_S later, this process's evidence
TMP/pub/route-evidence/<euid>/<pid>.json: `captured` must list exactly the routed (batch, shape)s and
`fallbacks` the "batch over max_batch" calls. --cpu: the same calls eagerly (no CUDA graphs on a CPU: said
so, never reported as checked), eager_routed counted instead.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from common import ROOT, compare, make_inputs, target_verify_args, verify_attention_ref

MAX_BATCH = 4
BATCHES = (1, 2, 4, 8)
FLUSH_WAIT_S = 1.0   # probes/routecheck.FLUSH_WAIT_S: the hook writes a dirty record within 0.25 s
KEY = "gpucheck-route"


def shape(cpu: bool) -> dict:
    """The checked shape: the stand-in's on a CPU (D 64, 4 query heads, 2 KV heads, float32), a Llama-8B
    rank's on CUDA (D 128, 32 query heads, 8 KV heads, bfloat16); T 4, a chain draft."""
    if cpu:
        return {"D": 64, "Hkv": 2, "G": 2, "T": 4, "dtype": "float32", "P": 37}
    return {"D": 128, "Hkv": 8, "G": 4, "T": 4, "dtype": "bfloat16", "P": 1000}


def render_hook(link: str) -> str:
    """The hook module's text, rendered by fleetctl's playbook loader (the playbook's own template)."""
    sys.path.insert(0, str(ROOT / "agent"))
    from fleetctl.engine.playbooks.model import load_playbook

    pb = load_playbook(ROOT / "playbooks" / "route-verify-attention.yaml")
    tpl = next(t for t in pb.tasks if t.name == "the hook module").template
    return tpl.render({"facts": {"sglang": {"version": "0.5.23"}, "torch": {"version": torch.__version__}},
                       "findings": {"verify_attention_route": {"kernel": {"link": link}}}}, strip=False)


def make_tree(tmp: Path, module_path: str, sh: dict) -> tuple[Path, Path]:
    """(the `current` link, the evidence directory) of a published-style tree under tmp (module docstring)."""
    pub = tmp / "pub"
    pkg = pub / "verify_attention"
    bdir = pkg / KEY
    built = Path(module_path)
    (bdir / "src").mkdir(parents=True)
    skip = shutil.ignore_patterns("*.o", "lock", "build.log", "build-result.json")
    shutil.copytree(built.parent, bdir / "build", ignore=skip)
    (bdir / "PASSED").write_text(f"{bdir / 'build' / built.name}\n")
    entry = {"head_dim": sh["D"], "group": sh["G"], "draft_tokens": sh["T"], "dtype": sh["dtype"],
             "max_batch": MAX_BATCH, "speedup": None}
    (pkg / "dispatch.json").write_text(json.dumps({
        "schema": "fleetctl-dispatch/1", "kernel": "verify_attention", "build": KEY, "backend": None,
        "source": "operator", "route": ["%d:%d:%d:%s:%d" % (sh["D"], sh["G"], sh["T"], sh["dtype"], MAX_BATCH)],
        "all": False, "entries": [entry], "measured": None, "why": "bench/gpu_check stage 7", "made": None}))
    (pkg / "current").symlink_to(KEY)
    for p in [tmp, *tmp.rglob("*")]:
        if not p.is_symlink():
            os.chmod(p, 0o755 if p.is_dir() else 0o644)
    ev = pub / "route-evidence"
    ev.mkdir()
    os.chmod(ev, 0o1777)
    return pkg / "current", ev


def call_kw(a: dict) -> dict:
    """The hook's keywords for SGLang-layout arguments `a`, as the 0.5.23 guard passes them."""
    return {"q_extend": a["q"], "k_extend": a["k_extend"], "v_extend": a["v_extend"], "o_extend": a["o"],
            "k_buffer": a["k_buffer"], "v_buffer": a["v_buffer"], "qo_indptr": a["qo_indptr"],
            "kv_indptr": a["kv_indptr"], "kv_indices": a["kv_indices"], "custom_mask": a["custom_mask"],
            "is_causal": True, "mask_indptr": a["mask_indptr"], "max_len_extend": a["T"], "k_scale": 1.0,
            "v_scale": 1.0, "sm_scale": a["sm_scale"], "logit_cap": 0.0, "sliding_window_size": -1, "sinks": None,
            "window_kv_offsets": None, "xai_temperature_len": -1, "max_bs": 64}


def stage7(module_path: str | None, cpu: bool, log) -> tuple[str, dict]:
    """(status, data) of the route stage (module docstring)."""
    if os.geteuid() != 0:
        return "skipped", {"skipped": "the hook trusts root-owned builds only: run as root"}
    if not module_path:
        return "failed", {"error": "no extension build to lay out"}
    sh = shape(cpu)
    device = "cpu" if cpu else "cuda"
    dtype = getattr(torch, sh["dtype"])
    tmp = Path(tempfile.mkdtemp(prefix="gpucheck-route-"))
    data: dict = {"shape": sh, "max_batch": MAX_BATCH, "batches": list(BATCHES), "calls": []}
    try:
        link, ev = make_tree(tmp, module_path, sh)
        hook_path = tmp / "fleetctl_verify.py"
        hook_path.write_text(render_hook(str(link)))
        spec = importlib.util.spec_from_file_location("fleetctl_verify_gpucheck", hook_path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        if mod.verify_fwd is None:
            return "failed", dict(data, error="the hook refused the tree (verify_fwd is None): see the log")
        fwd = mod.verify_fwd
        for B in BATCHES:
            x = make_inputs(B, sh["T"], [sh["P"]] * B, sh["Hkv"], sh["G"], sh["D"], dtype, device, seed=B,
                            shared_mask=True, tree="chain")
            a = target_verify_args(x, mask="bool" if cpu else "uint8")
            kw = call_kw(a)
            want = verify_attention_ref(**{k: x[k] for k in ("q", "k_cache", "v_cache", "req_to_token",
                                                             "req_pool_indices", "prefix_lens", "tree_mask",
                                                             "sm_scale")})
            rec = {"batch": B}
            if cpu:
                rec["returned"] = fwd(**dict(kw))
            else:
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    rec["warmup_returned"] = fwd(**dict(kw))
                torch.cuda.current_stream().wait_stream(s)
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    rec["returned"] = fwd(**dict(kw))
                a["o"].fill_(float("nan"))
                for _ in range(3):
                    g.replay()
                torch.cuda.synchronize()
            rec["routed_expected"] = B <= MAX_BATCH
            if rec["returned"]:
                rec["check"] = compare(a["o"], want, sh["dtype"])
            rec["ok"] = rec["returned"] is rec["routed_expected"] and (not rec["returned"] or rec["check"]["ok"])
            data["calls"].append(rec)
            log(f"  route: batch {B}: returned {rec['returned']} (expected {rec['routed_expected']}), "
                f"{'max|err| %.2e' % rec['check']['max_abs_err'] if rec.get('check') else 'SGLang kernel'}")
        time.sleep(FLUSH_WAIT_S)
        path = ev / str(os.geteuid()) / f"{os.getpid()}.json"
        evidence = json.loads(path.read_text())
        data["evidence"] = evidence
        data["evidence_path"] = str(path)
        routed = [B for B in BATCHES if B <= MAX_BATCH]
        want_captured = [] if cpu else [{"batch": B, "draft_tokens": sh["T"], "head_dim": sh["D"], "group": sh["G"],
                                         "dtype": sh["dtype"]} for B in routed]
        over = sum(1 for B in BATCHES if B > MAX_BATCH) * (1 if cpu else 2)    # cuda: the warm-up and the capture
        checks = {"calls": all(c["ok"] for c in data["calls"]),
                  "evidence_is_this_process": evidence.get("pid") == os.getpid() and evidence.get("uid") == os.geteuid(),
                  "build": evidence.get("build") == str(link.parent / KEY),
                  "captured": evidence.get("captured") == want_captured,
                  "eager_routed": evidence.get("eager_routed") == len(routed),   # cpu: the calls; cuda: the warm-ups
                  "fallbacks": evidence.get("fallbacks") == ({"batch over max_batch": over} if over else {})}
        data["checks"] = checks
        if cpu:
            data["graphs"] = {"skipped": "--cpu: no CUDA graphs on the CPU backend", "ok": None}
        return ("ok" if all(checks.values()) else "failed"), data
    finally:
        # all but the evidence directory, where the hook's atexit write still lands (a few hundred bytes)
        shutil.rmtree(tmp / "pub" / "verify_attention", ignore_errors=True)
        (tmp / "fleetctl_verify.py").unlink(missing_ok=True)
