"""`fleetctl apply route-verify-attention` on a lab host through real sshd (lab-04, SGLang 0.5.23,
its stand-in server): refused while verify_attention is not deployed there and while its server
does not run the triton attention backend; then, after `deploy kernel verify_attention --route
all` (the CPU backend, the operator's table) and with the server speculating (STANDALONE: a draft
made of the model's first block, 4 draft tokens) on triton, applied under the route gate (every
rank routed, read from the hook's evidence; greedy tokens and logprobs equal to the baseline's; a
4,096+ token prompt; the accept length): the hook module created, its import and the guard
inserted, both files byte-compiled by the host's interpreter, the hook importable there over the
deployed build and routing a call right; `status` showing the routed shapes; rolled back
byte-identical, the hook module deleted. test_fleet_route_gate.py: a wrong kernel refused by the
gate, an unprivileged server routed."""

from __future__ import annotations

import json
import shlex

import yaml

from fleetctl.probes.facts import verifyroute

HOST = "lab-04"
LOCATION = "/opt/sglang/venv/lib/python3.11/site-packages"
PYTHON = "/opt/sglang/venv/bin/python"
KDIR = "/var/lib/fleetctl-kernels/verify_attention"  # published builds, `current`, dispatch.json
SPECULATIVE = "--attention-backend triton --speculative-algorithm STANDALONE --speculative-num-draft-tokens 4"
RESTART = "/opt/fleetctl-standin/restart.sh"


def apply(lab, *args, rc=None):
    return lab.cli_json("apply", "route-verify-attention", HOST, "--yes", "--repeat", "1", *args, timeout=600, rc=rc)


def sha(lab, rel):
    r = lab.ssh(HOST, f"sha256sum {LOCATION}/{rel} 2>/dev/null || echo absent")
    assert r.returncode == 0, r.stderr
    return r.stdout.split()[0]


def applied_under_the_gate(lab, *args) -> tuple[dict, dict, dict]:
    """Apply route-verify-attention (`args`: more of the CLI's), which must change the host and pass
    the smoke gate and every route gate check: (the run's document, the host's entry, {check name:
    route gate check})."""
    r, doc, hosts = apply(lab, *args, rc=0)
    h = hosts[HOST]
    assert h["status"] == "changed", h.get("error")
    assert h["validation"]["status"] == "passed"
    gate = h["route_gate"]
    assert gate["status"] == "passed", gate
    c = {k["name"]: k for k in gate["checks"]}
    assert all(c[n]["passed"] for n in ("ranks", "tokens", "logprobs", "long prompt", "accept length")), c
    return doc, h, c


def restart_cmd(lab) -> str:
    """The host's restart handler as the lab's inventory gives it."""
    inventory = yaml.safe_load(lab.inventory.read_text())
    return inventory["all"]["children"]["lab"]["hosts"][HOST]["fleetctl_restart_cmd"]


def ok(lab, command, timeout=120):
    r = lab.ssh(HOST, command, timeout=timeout)
    assert r.returncode == 0, (command, r.stdout[-2000:], r.stderr[-2000:])
    return r.stdout


# On the host, over the deployed build's own package sources: the hook module loaded by path, one
# target-verify call (the table routes all shapes), checked against the float64 reference.
ROUTED = """
import importlib.util, json, sys, torch
sys.path.insert(0, "{kdir}/current/src")
import test_kernel
from reference import verify_attention_ref
from sglang_layout import target_verify_args
spec = importlib.util.spec_from_file_location("fleetctl_verify", "{hook}")
m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
x = test_kernel.make_inputs(2, 4, [9, 0], 1, 8, 64, torch.float32, "cpu", torch.Generator().manual_seed(1))
a = target_verify_args(x)
routed = m.verify_fwd(q_extend=a["q"], k_extend=a["k_extend"], v_extend=a["v_extend"], o_extend=a["o"],
    k_buffer=a["k_buffer"], v_buffer=a["v_buffer"], qo_indptr=a["qo_indptr"], kv_indptr=a["kv_indptr"],
    kv_indices=a["kv_indices"], custom_mask=a["custom_mask"], is_causal=True, mask_indptr=a["mask_indptr"],
    max_len_extend=a["T"], k_scale=1.0, v_scale=1.0, sm_scale=a["sm_scale"], logit_cap=0.0, page_size=1)
print(json.dumps({{"routed": routed, "err": (a["o"].double() - verify_attention_ref(**x)).abs().max().item()}}))
"""


def test_route_verify_attention_refuses_then_applies_and_rolls_back(server_lab, tmp_path):
    lab = server_lab
    backend, hook = verifyroute.BACKEND, verifyroute.HOOK
    pristine = sha(lab, backend)
    assert sha(lab, hook) == "absent"
    # 1. no kernel deployed: refused, naming the command to run first
    had = lab.ssh(HOST, f"test -L {KDIR}/current").returncode == 0
    if had:
        ok(lab, f"mv {KDIR}/current {KDIR}/current.aside")
    try:
        r, doc, hosts = apply(lab)
    finally:
        if had:
            ok(lab, f"mv {KDIR}/current.aside {KDIR}/current")
    assert r.returncode != 0 and hosts[HOST]["status"] == "failed"
    assert hosts[HOST]["error"] == (f"refused: verify_attention is not deployed here (no {KDIR}/current): run "
                                    "`fleetctl deploy kernel verify_attention HOST` first")
    # 2. deployed (the CPU backend, every shape routed as the operator says), but the server names
    # no attention backend: refused
    r, doc, hosts = lab.cli_json("deploy", "kernel", "verify_attention", HOST, "--yes", "--max-jobs", "2",
                                 "--route", "all", timeout=900, rc=0)
    assert hosts[HOST]["backend"] == "cpu" and hosts[HOST]["status"] in ("changed", "ok")
    table = hosts[HOST]["table"]
    assert (table["source"], table["all"], table["route"], table["build"]) == (
        "operator", True, "all", hosts[HOST]["build_key"])
    r, doc, hosts = apply(lab)
    assert r.returncode != 0 and hosts[HOST]["status"] == "failed"
    assert hosts[HOST]["error"].startswith("refused: server pid ") and "runs attention backend unset" in \
        hosts[HOST]["error"] and "not triton" in hosts[HOST]["error"]
    assert (sha(lab, backend), sha(lab, hook)) == (pristine, "absent")
    # 3. the server speculating on triton (and its restart keeping it so): applied, the gate passed
    restart = restart_cmd(lab)
    lab.add_host_vars(HOST, {"fleetctl_restart_cmd": f"{RESTART} {SPECULATIVE}"})
    ok(lab, f"{RESTART} {SPECULATIVE}")
    try:
        doc, h, c = applied_under_the_gate(lab)
        assert "eager_routed " in c["ranks"]["detail"], c["ranks"]  # routed eagerly (no CUDA graphs here)
        evidence = json.loads(ok(lab, f"cd /var/lib/fleetctl-kernels/route-evidence/0 && {PYTHON} -c 'import glob, "
                                      "json; print(json.dumps([json.load(open(p)) for p in glob.glob(\"*.json\")]))'"))
        assert any(e["eager_routed"] > 0 and e["uid"] == 0 and e["build"] == f"{KDIR}/{table['build']}"
                   for e in evidence), evidence
        _, _, st = lab.cli_json("status", HOST, rc=0)
        assert st[HOST]["kernels"]["verify_attention"] == table["build"]
        assert (st[HOST]["dispatch"]["verify_attention"]["source"], st[HOST]["dispatch"]["verify_attention"]["all"]) \
            == ("operator", True)
        assert {e["kind"] for e in h["plan"]["edits"]} == {"create", "insert"} and len(h["plan"]["edits"]) == 3
        patched = ok(lab, f"cat {LOCATION}/{backend}")
        assert patched.count("try:  # fleetctl route-verify-attention") == 1
        assert patched.count("    from sglang.srt.layers.attention.fleetctl_verify import verify_fwd as _fleetctl_verify_fwd\n"
                             "except Exception:\n    _fleetctl_verify_fwd = None\n") == 1
        assert patched.count("if (_fleetctl_verify_fwd is not None  # fleetctl route-verify-attention") == 1
        guard_end = patched.index("            return o\n        self._forward_extend_kernel(\n")
        assert "page_size=self.page_size," in patched[patched.index("if (_fleetctl_verify_fwd"):guard_end]
        ok(lab, f"{PYTHON} -m py_compile {LOCATION}/{backend} {LOCATION}/{hook}")
        entry = json.loads(ok(lab, "tail -n 1 /var/lib/fleetctl/ledger.jsonl"))
        assert (entry["change_id"], entry["state"], entry["playbook"]) == (doc["change_id"], "applied",
                                                                           "route-verify-attention")
        made = next(f for f in entry["files"] if f["path"].endswith(hook))
        assert made["before_sha256"] is None and made["after_sha256"] == sha(lab, hook)
        # a second apply changes nothing
        r, doc2, hosts2 = apply(lab, rc=0)
        assert hosts2[HOST]["status"] == "ok" and len(hosts2[HOST]["plan"]["already_applied"]) == 3
        # the hook, imported by the host's interpreter over the deployed build: a call routed and right
        script = ROUTED.format(kdir=KDIR, hook=f"{LOCATION}/{hook}")
        res = json.loads(ok(lab, f"{PYTHON} -c {shlex.quote(script)}", timeout=300).splitlines()[-1])
        assert res["routed"] is True and res["err"] < 1e-4
        # 4. rolled back: byte-identical, the hook module and its bytecode gone
        ok(lab, f"{PYTHON} -c 'import py_compile; py_compile.compile(\"{LOCATION}/{hook}\")'")
        lab.cli_json("rollback", doc["change_id"], HOST, "--yes", timeout=300, rc=0)
        assert (sha(lab, backend), sha(lab, hook)) == (pristine, "absent")
        assert ok(lab, f"ls {LOCATION}/sglang/srt/layers/attention/__pycache__ 2>/dev/null | "
                       "grep -c fleetctl_verify || true").strip() == "0"
        entry = json.loads(ok(lab, "tail -n 1 /var/lib/fleetctl/ledger.jsonl"))
        assert (entry["change_id"], entry["state"]) == (doc["change_id"], "rolled-back")
    finally:
        lab.add_host_vars(HOST, {"fleetctl_restart_cmd": restart})
        ok(lab, restart)
