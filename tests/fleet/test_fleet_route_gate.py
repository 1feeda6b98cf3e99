"""The route gate's refusal and an unprivileged server, through real sshd (lab-04, SGLang 0.5.23, its
stand-in server speculating with a STANDALONE draft on the Triton attention backend; the routed
apply itself is test_fleet_route_verify.py's): a build whose kernel maps query heads to the wrong KV
head (and whose reference test, like many, never tries more than one KV head) deploys, then fails
route-verify-attention's token gate (the smoke gate's greedy decode, before the route gate) and is
rolled back byte-identical; the good build again, and the
server running as an unprivileged user (nobody, 65534) is routed too: its evidence under
PUBLIC/route-evidence/65534, the gate passed, rolled back."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from conftest import kernel_variant
from test_fleet_route_verify import applied_under_the_gate
from fleetctl.probes.facts import verifyroute

HOST = "lab-04"
LOCATION = "/opt/sglang/venv/lib/python3.11/site-packages"
RESTART = "/opt/fleetctl-standin/restart.sh"
PUBLIC = "/var/lib/fleetctl-kernels"
KERNELS = Path(__file__).resolve().parents[2] / "kernels"
SPECULATIVE = "--attention-backend triton --speculative-algorithm STANDALONE --speculative-num-draft-tokens 4"
NOBODY = 'LAUNCHER="setpriv --reuid=65534 --regid=65534 --clear-groups"'  # the server as nobody


def ok(lab, command, timeout=120):
    r = lab.ssh(HOST, command, timeout=timeout)
    assert r.returncode == 0, (command, r.stdout[-2000:], r.stderr[-2000:])
    return r.stdout


def sha(lab, rel):
    return ok(lab, f"sha256sum {LOCATION}/{rel} 2>/dev/null || echo absent").split()[0]


def deploy(lab, *args, kernels: Path = KERNELS, rc=0):
    return lab.cli_json("deploy", "kernel", "verify_attention", HOST, "--yes", "--max-jobs", "2", *args,
                        env={"FLEETCTL_KERNELS_DIR": str(kernels)}, timeout=900, rc=rc)


def apply(lab, rc=None):
    return lab.cli_json("apply", "route-verify-attention", HOST, "--yes", "--repeat", "1", timeout=600, rc=rc)


def checks(gate: dict) -> dict:
    """{check name: check} of a smoke or route gate result (one server)."""
    return {c["name"]: c for c in gate["checks"]}


def serve(lab, restart: str) -> None:
    """Make `restart` the host's restart handler and (re)start the stand-in with it."""
    lab.add_host_vars(HOST, {"fleetctl_restart_cmd": restart})
    ok(lab, restart)


def broken_head_mapping(d: Path) -> None:
    """Query head h reads KV head h % Hkv instead of h / G (interleaved instead of grouped), and the
    package's reference test keeps only its shapes with one KV head, where both mappings agree."""
    src = d / "csrc" / "verify_attention_cpu.cpp"
    text = src.read_text()
    assert text.count("hk = h / G;") == 1
    src.write_text(text.replace("hk = h / G;", "hk = h % d.Hkv;"))
    test = d / "test_kernel.py"
    text = test.read_text()
    anchor = 'DTYPES = {"cpu"'
    assert text.count(anchor) == 1
    test.write_text(text.replace(anchor, "SHAPES = [s for s in SHAPES if s[3] == 1]\n" + anchor))


def routed_apply_and_rollback(lab, uid: int, *args) -> dict:
    """Apply route-verify-attention (must pass its route gate; `args`: more of the CLI's, for the
    apply and the rollback), check the evidence of uid `uid` on the host, roll back byte-identical;
    the apply's host entry."""
    backend, hook = verifyroute.BACKEND, verifyroute.HOOK
    pristine = sha(lab, backend)
    doc, h, _ = applied_under_the_gate(lab, *args)
    pids = json.loads(ok(lab, f"cd {PUBLIC}/route-evidence/{uid} && python3 -c 'import glob, json; "
                              "print(json.dumps({p: json.load(open(p)) for p in glob.glob(\"*.json\")}))'"))
    assert any(e["eager_routed"] > 0 and e["uid"] == uid for e in pids.values()), pids
    assert ok(lab, f"stat -c '%u %a' {PUBLIC}/route-evidence/{uid}").split() == [str(uid), "755"]
    lab.cli_json("rollback", doc["change_id"], HOST, "--yes", *args, timeout=300, rc=0)
    assert (sha(lab, backend), sha(lab, hook)) == (pristine, "absent")
    return h


def test_a_wrong_kernel_fails_the_gate_then_an_unprivileged_server_routes(server_lab, tmp_path):
    lab = server_lab
    inventory = yaml.safe_load(lab.inventory.read_text())
    restart = inventory["all"]["children"]["lab"]["hosts"][HOST]["fleetctl_restart_cmd"]
    try:
        serve(lab, f"{RESTART} {SPECULATIVE}")
        # 1. a kernel with the wrong head mapping: its own test passes, the gate does not
        broken = kernel_variant(tmp_path, "heads", broken_head_mapping)
        r, doc, hosts = deploy(lab, "--route", "all", kernels=broken)
        assert hosts[HOST]["table"]["all"] is True
        pristine = sha(lab, verifyroute.BACKEND)
        r, doc, hosts = apply(lab)
        h = hosts[HOST]
        assert r.returncode != 0 and h["status"] == "failed", h
        # the smoke gate's greedy decode already differs (the route gate, after it, is not reached)
        smoke = checks(h["validation"])
        assert h["validation"]["status"] == "failed" and not smoke["tokens"]["passed"], h["validation"]
        assert "tokens FAILED: output_ids differ" in h["error"] and "route_gate" not in h, h["error"]
        assert h["rolled_back"], h
        assert (sha(lab, verifyroute.BACKEND), sha(lab, verifyroute.HOOK)) == (pristine, "absent")
        # 2. the good build again, the server as nobody (from root's venv, outside any service: the
        # inventory names its account, issue 48's owner rule): routed too
        deploy(lab, "--route", "all")
        serve(lab, f"{NOBODY} {RESTART} {SPECULATIVE}")
        assert ok(lab, "ps -o uid= -p $(cat /opt/fleetctl-standin/server.pid)").strip() == "65534"
        served = yaml.safe_load(lab.inventory.read_text())  # serve()'s restart handler in it
        served["all"]["children"]["lab"]["hosts"][HOST]["fleetctl_server_user"] = "nobody"
        named = tmp_path / "server-user.yaml"
        named.write_text(yaml.safe_dump(served))
        r, _, hosts = apply(lab, rc=2)  # unnamed, it is no server of this host's: nothing is changed
        assert "runs as uid 65534: not root" in hosts[HOST]["error"], hosts[HOST]["error"]
        routed_apply_and_rollback(lab, 65534, "-i", str(named))
    finally:
        serve(lab, restart)
