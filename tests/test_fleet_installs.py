"""Installs on lab hosts: `apply --export-patch` against real SGLang releases over real sshd."""

from __future__ import annotations

import hashlib
import subprocess
import zipfile

import pytest

from fleetctl.wheelcache import ensure_wheel

pytestmark = pytest.mark.lab

RELEASES = {"lab-01": "0.4.6.post5", "lab-02": "0.5.2", "lab-03": "0.5.10", "lab-04": "0.5.23"}


def test_exported_patches_apply_to_a_fresh_unpack_of_each_release(lab, tmp_path):
    """One patch per release with need_sort (0.4.6.post5 has none), written in check mode; each
    applies with `patch -p1` to a fresh unpack of its wheel and gives the bytes apply writes (the
    plan's post-images), and names the wheel's sha256 it was checked against."""
    out = tmp_path / "patches"
    r, doc, hosts = lab.cli_json("apply", "defrag-tier0", "all", "--export-patch", str(out), timeout=300)
    assert r.returncode == 0, r.stderr
    assert doc["check"] is True and doc["change_id"] is None
    names = {f"defrag-tier0-sglang-{v}.patch": h for h, v in RELEASES.items() if v != "0.4.6.post5"}
    assert sorted(doc["patches"]) == sorted(str(out / n) for n in names)
    assert hosts["lab-01"]["status"] == "skipped"
    for name, host in names.items():
        version = RELEASES[host]
        text = (out / name).read_text()
        wheel = ensure_wheel(version)
        assert f"{wheel.name} sha256 {hashlib.sha256(wheel.read_bytes()).hexdigest()}" in text
        fresh = tmp_path / f"fresh-{version}"
        with zipfile.ZipFile(wheel) as z:
            z.extractall(fresh, [n for n in z.namelist() if n.startswith("sglang/")])
        p = subprocess.run(["patch", "-p1", "--batch", "-d", str(fresh)], input=text, capture_output=True, text=True)
        assert p.returncode == 0, p.stdout + p.stderr
        files = hosts[host]["plan"]["files"]
        assert files and "texts" not in hosts[host]
        for f in files:
            assert hashlib.sha256((fresh / f["rel"]).read_bytes()).hexdigest() == f["post_sha256"]
    # check mode: no host has a ledger
    assert lab.ssh("lab-04", "test -e /var/lib/fleetctl/ledger.jsonl").returncode == 1
