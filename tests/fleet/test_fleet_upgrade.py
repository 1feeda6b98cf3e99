"""`pip install --upgrade sglang` under applied changes, through real sshd (issue 49, case 05): on
lab-03 (the 0.5.10 venv, no server), defrag-tier0 and route-verify-attention applied (the kernel
deployed first, the CPU build), then the venv's sglang upgraded to 0.5.23 from the lab's wheel
cache (`pip install --no-deps --no-index --upgrade`, as the lab builds its venvs: lab/host.py
build_venv). `status` says each change was replaced by an upgrade (0.5.10 -> 0.5.23), never
"edited since the apply", and judges 0.5.23's files by 0.5.23's RECORD (no file modified);
`rollback`, with and without --force, refuses, naming `fleetctl rollback --forget CHANGE lab-03`,
and writes nothing; `rollback --forget` drops both entries (superseded in the ledger, the hook
module the upgrade left removed); both playbooks then apply again cleanly to 0.5.23 and status is
clean. Then case 04 there: 0.5.10's dist-info put back beside 0.5.23's and a REQUESTED-only torch
dist-info in the venv: inspect gives 0.5.23 and the torch `import torch` loads, each with a
warning naming the stale directory; status finds no modified file and names the stale one as
the one thing wrong. The host is put back as it was (the re-applies rolled back, 0.5.10 reinstalled)."""

from __future__ import annotations

import sys

from fleetctl.wheels import find_wheel

HOST = "lab-03"
VENV = "/opt/sglang/venv"
SITE = f"{VENV}/lib/python{sys.version_info[0]}.{sys.version_info[1]}/site-packages"
HOOK = "sglang/srt/layers/attention/fleetctl_verify.py"
BACKEND = "sglang/srt/layers/attention/triton_backend.py"
STALE = "sglang-0.5.10.dist-info"
TORCH_LEFT = "torch-2.12.1+cu126.dist-info"


def ok(lab, command, timeout=120):
    r = lab.ssh(HOST, command, timeout=timeout)
    assert r.returncode == 0, (command, r.stdout[-2000:], r.stderr[-2000:])
    return r.stdout


def pip_install(lab, version, *how):
    """The lab's own pip run into the host's venv (lab/host.py build_venv), from the wheel cache."""
    wheel = find_wheel(version)
    assert wheel is not None, f"sglang {version} is not in the wheel cache (scripts/setup.sh)"
    ok(lab, f"{sys.executable} -m pip --python {VENV}/bin/python install --quiet --no-deps --no-index --no-compile "
            f"--disable-pip-version-check {' '.join(how)} {wheel}", timeout=300)


def digest(lab, *rels):
    return ok(lab, f"cd {SITE} && sha256sum {' '.join(rels)} 2>&1 || true")


def apply(lab, playbook):
    _, _, hosts = lab.cli_json("apply", playbook, HOST, "--yes", timeout=300, rc=0)
    assert hosts[HOST]["status"] == "changed", hosts[HOST].get("error")
    return hosts[HOST]["change_id"]


def test_upgrade_under_applied_changes_is_named_refused_forgotten_and_reapplied(lab):
    _, _, hosts = lab.cli_json("deploy", "kernel", "verify_attention", HOST, "--yes", "--max-jobs", "2",
                               "--route", "all", timeout=600, rc=0)
    deployed = hosts[HOST]["change_id"] if hosts[HOST]["status"] == "changed" else None
    first, again, upgraded = [], [], False
    try:
        first.append(apply(lab, "defrag-tier0"))
        first.append(apply(lab, "route-verify-attention"))
        defrag, route = first
        upgraded = True  # from here on the finally forgets and reinstalls: pip may stop half-way
        pip_install(lab, "0.5.23", "--upgrade")
        assert "__version__ = version = '0.5.23'" in ok(lab, f"cat {SITE}/sglang/_version.py")
        assert ok(lab, f"test -f {SITE}/{HOOK} && echo left").strip() == "left"  # in no RECORD: pip left it

        # status: both changes replaced by the upgrade; 0.5.23's files judged by 0.5.23's RECORD
        r, _, hosts = lab.cli_json("status", HOST)
        st = hosts[HOST]
        assert r.returncode != 0 and st["status"] == "failed"
        upgraded_to = {"dist": "sglang", "from": "0.5.10", "to": "0.5.23"}
        assert {c["change_id"]: c.get("upgraded") for c in st["changes"] if c["change_id"] in first} == {
            defrag: upgraded_to, route: upgraded_to}
        mine = [d for d in st["drift"] if d["change_id"] in (defrag, route)]
        assert mine and all(d["problem"].startswith("replaced by an upgrade of sglang (0.5.10 -> 0.5.23): the change "
                                                    "is gone with the old release") for d in mine), mine
        assert f"`fleetctl rollback --forget {route} {HOST}`" in st["error"]
        assert "edited since the apply" not in st["error"]
        assert st["modified"] == [] and st["installs"][0]["sglang"] == "0.5.23"

        # rollback: refused with and without --force, nothing written
        before = digest(lab, BACKEND, HOOK, "sglang/srt/model_executor/model_runner.py")
        for force in ((), ("--force",)):
            r, _, hosts = lab.cli_json("rollback", "--last", HOST, "--yes", *force)
            assert r.returncode != 0 and hosts[HOST]["status"] == "failed"
            assert "a rollback would write 0.5.10's files into 0.5.23, with or without --force" in hosts[HOST]["error"]
            assert f"`fleetctl rollback --forget {route} {HOST}` (it checks the tree first), then apply " \
                   "route-verify-attention again" in hosts[HOST]["error"]
        assert digest(lab, BACKEND, HOOK, "sglang/srt/model_executor/model_runner.py") == before

        # forget: both entries dropped, the hook module the upgrade left removed
        _, _, hosts = lab.cli_json("rollback", "--forget", route, HOST, "--yes", rc=0)
        (gone,) = hosts[HOST]["forgotten"]
        assert (gone["change_id"], gone["removed"], gone["upgraded"]["to"]) == (route, [f"{SITE}/{HOOK}"], "0.5.23")
        lab.cli_json("rollback", "--forget", defrag, HOST, "--yes", rc=0)
        assert ok(lab, f"test -e {SITE}/{HOOK} || echo absent").strip() == "absent"

        # both playbooks apply again, to 0.5.23, and status is clean
        again.append(apply(lab, "defrag-tier0"))
        again.append(apply(lab, "route-verify-attention"))
        _, _, hosts = lab.cli_json("status", HOST, rc=0)
        states = {c["change_id"]: c["state"] for c in hosts[HOST]["changes"]}
        assert (states[defrag], states[route], states[again[0]], states[again[1]]) == (
            "superseded", "superseded", "applied", "applied")

        # case 04 on the same host: 0.5.10's dist-info put back beside 0.5.23 (an upgrade that failed
        # half-way) and a torch dist-info holding only REQUESTED in the venv (cpython#100666)
        ok(lab, f"cd {SITE} && {sys.executable} -c \"import zipfile; z = zipfile.ZipFile('{find_wheel('0.5.10')}'); "
                f"[z.extract(n, '.') for n in z.namelist() if n.startswith('{STALE}/')]\" && mkdir {TORCH_LEFT} && "
                f"touch {TORCH_LEFT}/REQUESTED")
        _, _, hosts = lab.cli_json("inspect", HOST, rc=0)
        facts = hosts[HOST]["facts"]
        assert facts["sglang"]["version"] == "0.5.23"
        assert f"{STALE} (stale: its files are not the installed ones)" in facts["sglang"]["metadata_warning"]
        torch = facts["torch"]
        assert torch["version"] == ok(lab, f"{VENV}/bin/python -c 'import torch; print(torch.__version__)'").strip()
        assert f"{SITE}/{TORCH_LEFT} (stale: no RECORD, no METADATA" in torch["metadata_warning"]
        r, _, hosts = lab.cli_json("status", HOST)
        assert hosts[HOST]["modified"] == [] and hosts[HOST]["installs"][0]["sglang"] == "0.5.23"
        assert r.returncode != 0 and hosts[HOST]["error"] == \
            f"host:{SITE}/sglang: {hosts[HOST]['installs'][0]['metadata_warning']}"
    finally:  # the host as it was, whatever step failed: the session's other tests use lab-03's 0.5.10
        lab.ssh(HOST, f"cd {SITE} && rm -rf {STALE} {TORCH_LEFT}")
        for cid in reversed(again):
            lab.cli("rollback", cid, HOST, "--yes")
        for cid in reversed(first):
            lab.cli("rollback", *(("--forget",) if upgraded else ()), cid, HOST, "--yes")
        if upgraded:
            pip_install(lab, "0.5.10", "--force-reinstall")
        if deployed:
            lab.cli("rollback", deployed, HOST, "--yes")
    # put back: 0.5.10's own files, no fleetctl change applied on it
    _, _, hosts = lab.cli_json("status", HOST, rc=0)
    assert hosts[HOST]["installs"][0]["sglang"] == "0.5.10" and hosts[HOST]["modified"] == []
    assert not [c for c in hosts[HOST]["changes"] if c["state"] == "applied" and c["change_id"] != deployed]
    assert ok(lab, f"test -e {SITE}/{HOOK} || echo absent").strip() == "absent"
