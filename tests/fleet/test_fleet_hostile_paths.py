"""A hostile host's paths, through real sshd (security review N2): the host's root answers the
inspect probe with a finding's file outside the install, and `apply --export-patch` (a check
mode command) must refuse that host by name and write nothing on the control node, as the review
reproduced it: an inventory `fleetctl_python` naming a root-owned wrapper on the host that runs
the real interpreter and rewrites the probe's JSON answer with sed."""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest
import yaml

import test_fleet_hostile
from test_fleet_hostile import HOST, REL, sh

guarded = test_fleet_hostile.guarded  # the fixture: the venv, the ledger, backups and decoys unchanged

WRAPPER = "/opt/sglang/fleetctl-hostile/bin/python"  # the host's private /opt/sglang: root's, 0755
REAL = "/opt/sglang/venv/bin/python"


@pytest.mark.usefixtures("guarded")
@pytest.mark.parametrize("shape", ["dotdot", "absolute", "version"])
def test_a_host_answering_with_hostile_paths_is_refused_and_nothing_is_written(lab, tmp_path, shape):
    """The file defrag-tier0 edits on 0.5.23 renamed, in every place the answer names it (the
    finding, the scan's files, the sources), to `../` up to the root then /tmp/<unique>/owned.py,
    or to that absolute path; or the SGLang version made a path (it names the patch file and
    the wheel glob): the host fails with the refusal, exit 2, and on the control node the target
    does not exist and the export directory is empty (the old code wrote the host's text at the
    target, as root, before `patch` ran; and crashed writing the patch under the version)."""
    target = Path("/tmp") / f"fleetctl-n2-{secrets.token_hex(6)}" / "owned.py"
    rel = "../" * 12 + str(target).lstrip("/") if shape == "dotdot" else str(target)
    if shape == "version":
        old, new = '"version": "0.5.23"', f'"version": "0.5.23/../{target.parent.name}"'
        error = f"refused a version from the host: '0.5.23/../{target.parent.name}' (not a PEP 440 public " \
                "version in canonical form)"
    else:
        old, new = REL, rel
        error = f"refused a path from the host: {rel!r} (not relative to the install)"
    script = f"#!/bin/sh\n{REAL} \"$@\" | sed 's#{old}#{new}#g'\n"
    sh(lab, f"mkdir -p {WRAPPER.rsplit('/', 1)[0]}")
    r = lab.ssh(HOST, f"cat > {WRAPPER} && chmod 755 {WRAPPER}", input=script)
    assert r.returncode == 0, r.stderr
    inv = yaml.safe_load(lab.inventory.read_text())
    inv["all"]["children"]["lab"]["hosts"][HOST]["fleetctl_python"] = WRAPPER
    named = tmp_path / "hosts.yaml"
    named.write_text(yaml.safe_dump(inv))
    out, empty = tmp_path / "out", tmp_path / "empty"
    empty.mkdir()
    try:
        r, doc, hosts = lab.cli_json("apply", "defrag-tier0", HOST, "-i", str(named), "--export-patch", str(out),
                                     "--pristine-dir", str(empty))
    finally:
        sh(lab, f"rm -rf {WRAPPER.rsplit('/', 2)[0]}")
    assert (r.returncode, hosts[HOST]["status"], hosts[HOST]["error"]) == (2, "failed", error), r.stderr[-2000:]
    assert doc["patches"] == [] and "texts" not in hosts[HOST]
    assert not target.exists() and not target.parent.exists()
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == ["empty", "hosts.yaml", "out"]
