"""`fleetctl inspect` against the lab: real sshd, real SGLang releases, real faults."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import zipfile

import pytest

from conftest import write_ssh_config
from fleetctl.probes.facts import callsites
from fleetctl.wheels import ensure_wheel


RELEASES = {"lab-01": "0.4.6.post5", "lab-02": "0.5.2", "lab-03": "0.5.10", "lab-04": "0.5.23"}


def fleetctl(lab, *args):
    return lab.cli(*args, timeout=120)


def inspect_json(lab, *args):
    r, _, hosts = lab.cli_json("inspect", *args, timeout=120)
    return r, hosts


@pytest.fixture(scope="module")
def local_scans(tmp_path_factory):
    """The same scan run locally over each release's unpacked wheel (what the hosts must report)."""
    out = {}
    for version in RELEASES.values():
        d = tmp_path_factory.mktemp(f"sg-{version}")
        with zipfile.ZipFile(ensure_wheel(version)) as z:
            z.extractall(d, [n for n in z.namelist() if n.startswith("sglang/")])
        out[version] = callsites.scan(str(d))
    return out


def test_inspect_four_releases(lab, local_scans):
    r, hosts = inspect_json(lab, "all")
    assert r.returncode == 0, r.stderr
    assert list(hosts) == list(RELEASES)
    for name, version in RELEASES.items():
        h = hosts[name]
        assert (h["status"], h["error"]) == ("ok", None)
        f = h["facts"]
        assert f["hostname"] == name
        assert f["python"]["path"] == "/opt/sglang/venv/bin/python"
        assert f["sglang"]["version"] == version
        assert f["sglang"]["location"].startswith("/opt/sglang/venv/lib/python3")
        assert f["torch"]["version"].startswith("2.13.0") and f["torch"]["cuda"] is None
        assert f["gpus"] == [] and "nvidia-smi" in f["gpus_reason"]
        assert f["servers"] == []
        local = local_scans[version]
        # remote equals local, every field (need_sort passing, expr, resolved, columns), and the hashes
        assert h["allocator_call_sites"] == local["allocator_call_sites"]
        assert h["need_sort_origins"] == local["need_sort_origins"]
        assert h["scan"]["files"] == local["files"] and h["scan"]["parse_errors"] == local["parse_errors"]
    assert hosts["lab-01"]["need_sort_origins"] == []
    assert {s["need_sort"]["passing"] for s in hosts["lab-01"]["allocator_call_sites"]} == {"absent"}
    computed = [o for o in hosts["lab-04"]["need_sort_origins"]
                if not o["literal"] and o["file"].endswith("mem_cache/kv_cache_configurator.py")]
    assert len(computed) == 4
    assert any(s["need_sort"]["passing"] == "positional" for s in hosts["lab-02"]["allocator_call_sites"])


def test_table_shows_selected_hosts_and_says_no_need_sort(lab):
    """Two hosts of different releases: two rows, one saying 0.4.6 has no need_sort (coalescing
    of identical hosts is tested in test_report.py: no two lab hosts are alike)."""
    r = lab.cli("inspect", "sglang_0_4_6_post5:sglang_0_5_23", timeout=120, env={"COLUMNS": "400"})
    assert r.returncode == 0, r.stderr
    assert "this release has no need_sort" in r.stdout
    assert "lab-01" in r.stdout and "lab-04" in r.stdout
    assert "lab-02" not in r.stdout and "lab-03" not in r.stdout  # not selected


def test_pattern_and_inventory_errors(lab, tmp_path):
    r = fleetctl(lab, "inspect", "nosuchhost")
    assert r.returncode == 5 and "nosuchhost" in r.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("all:\n  hosts:\n    a: {ansible_port: 22\n")
    r = fleetctl(lab, "inspect", "all", "-i", str(bad))
    assert r.returncode == 4 and f"{bad}:" in r.stderr


@pytest.mark.parametrize("fault,undo", [("freeze", "thaw"), ("down", "up")])
def test_unreachable_within_connect_timeout(lab, fault, undo):
    lab.fault("lab-02", fault)
    try:
        t0 = time.monotonic()
        r, hosts = inspect_json(lab, "all", "--connect-timeout", "3")
        took = time.monotonic() - t0
    finally:
        lab.fault("lab-02", undo)
    assert r.returncode == 3
    assert hosts["lab-02"]["status"] == "unreachable"
    assert hosts["lab-02"]["elapsed_s"] < 3 + 3
    assert took < 3 + 15
    assert all(hosts[h]["status"] == "ok" for h in ("lab-01", "lab-03", "lab-04"))


def test_changed_host_key_is_refused(lab):
    before = lab.known_hosts.read_text()
    lab.fault("lab-03", "rekey")
    try:
        r, hosts = inspect_json(lab, "lab-03", "--accept-new")
    finally:
        lab.fault("lab-03", "unrekey")
    assert r.returncode == 3
    h = hosts["lab-03"]
    assert h["status"] == "unreachable" and h["facts"] is None
    assert "HOST KEY CHANGED" in h["error"] and h["error"].count("SHA256:") == 2
    assert lab.known_hosts.read_text() == before


def test_unknown_host_key_refused_unless_accept_new(lab, tmp_path):
    known = tmp_path / "ssh" / "known_hosts"
    cfg = write_ssh_config(tmp_path / "ssh" / "config", known)
    run = lambda *a: lab.cli("inspect", "lab-01", "--json", "--ssh-config", str(cfg), *a, timeout=60)  # noqa: E731
    r = run()
    assert r.returncode == 3 and "unknown host key" in json.loads(r.stdout)["hosts"][0]["error"]
    assert not known.exists()
    r = run("--accept-new")
    assert r.returncode == 0, r.stdout
    assert lab.address("lab-01") in known.read_text()
    assert run().returncode == 0


def test_hanging_interpreter_fails_at_deadline_and_leaves_nothing(lab):
    lab.fault("lab-04", "hang")
    try:
        t0 = time.monotonic()
        r, hosts = inspect_json(lab, "all", "--timeout", "6")
        took = time.monotonic() - t0
        deadline = time.monotonic() + 10  # remote cleanup may take a moment: poll, do not sleep once
        while lab.pids("lab-04") and time.monotonic() < deadline:
            time.sleep(0.2)
        left = []
        for p in lab.pids("lab-04"):
            try:
                left.append(open(f"/proc/{p}/cmdline", "rb").read())
            except OSError:  # exited between the listing and the read
                pass
    finally:
        lab.fault("lab-04", "unhang")
    assert r.returncode == 2
    assert hosts["lab-04"]["status"] == "failed" and "deadline" in hosts["lab-04"]["error"]
    assert all(hosts[h]["status"] == "ok" for h in ("lab-01", "lab-02", "lab-03"))
    assert took < 6 + 15
    assert left == [], left


def test_ssh_config_proxyjump_is_honoured_and_every_hop_verified(lab, tmp_path):
    """~/.ssh/config: HostName, User, IdentityFile, ProxyJump through lab-01 to lab-03."""
    key = lab.state_dir / "client_ed25519"
    known_hosts = tmp_path / "ssh" / "known_hosts"
    write_ssh_config(tmp_path / "ssh" / "config", known_hosts,
                     f"Host jumphost\n  HostName {lab.address('lab-01')}\n  User root\n  IdentityFile {key}\n"
                     f"Host gpu-behind-jump\n  HostName {lab.address('lab-03')}\n  User root\n  IdentityFile {key}\n"
                     f"  ProxyJump jumphost\n")
    inv = tmp_path / "hosts.yaml"
    inv.write_text("all:\n  hosts:\n    gpu-behind-jump:\n")
    known = lab.known_hosts.read_text().splitlines()
    target_only = [line for line in known if line.split()[0] == lab.address("lab-03")]
    known_hosts.write_text("\n".join(target_only) + "\n")
    env = dict(lab.env, FLEETCTL_SSH_CONFIG=str(tmp_path / "ssh" / "config"))
    run = lambda: subprocess.run([sys.executable, "-m", "fleetctl.cli", "inspect", "all", "-i", str(inv),  # noqa: E731
                                  "--json"], capture_output=True, text=True, env=env, timeout=120)
    r = run()
    h = json.loads(r.stdout)["hosts"][0]
    assert r.returncode == 3 and "unknown host key" in h["error"] and lab.address("lab-01") in h["error"]
    known_hosts.write_text("\n".join(known) + "\n")
    r = run()
    h = json.loads(r.stdout)["hosts"][0]
    assert r.returncode == 0, h["error"]
    assert h["facts"]["hostname"] == "lab-03" and h["facts"]["sglang"]["version"] == "0.5.10"


def test_scan_cache_cold_warm_and_no_cache_give_one_answer(lab):
    """Issue 18: on every lab release the answer is the same whether the host's scan cache was
    just cleared (cold), filled (warm) or bypassed (--no-cache); `cache clear` empties it."""
    r, _, cleared = lab.cli_json("cache", "clear", "all", timeout=120)
    assert r.returncode == 0, r.stderr
    assert {h["cache"]["path"] for h in cleared.values()} == {"/var/lib/fleetctl/scan-cache"}
    runs = {name: inspect_json(lab, "all", *extra)[1] for name, extra in
            (("cold", ()), ("warm", ()), ("no-cache", ("--no-cache",)))}
    keys = ("allocator_call_sites", "need_sort_origins", "files", "stats", "parse_errors")
    for host in RELEASES:
        scans = {name: runs[name][host]["installs"][0]["scan"] for name in runs}
        total = scans["cold"]["stats"]["files_total"]
        assert (scans["cold"]["cache"]["hits"], scans["cold"]["cache"]["misses"]) == (0, total), host
        assert (scans["warm"]["cache"]["hits"], scans["warm"]["cache"]["misses"]) == (total, 0), host
        assert scans["warm"]["cache"]["path"].startswith("/var/lib/fleetctl/scan-cache/scan-")
        assert scans["no-cache"]["cache"]["path"] is None
        assert set(scans["warm"]["phases_s"]) == {"walk", "prefilter", "parse", "analysis"}
        answers = [{k: (runs[n][host][k] if k in ("allocator_call_sites", "need_sort_origins") else scans[n][k])
                    for k in keys} for n in runs]
        assert answers[0]["allocator_call_sites"] and answers[0] == answers[1] == answers[2], host
