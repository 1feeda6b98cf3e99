"""`fleetctl validate` on the lab: the smoke decode runs on each host against its stand-in server."""

from __future__ import annotations

import json
import time

import yaml


def fleetctl(lab, *args, env=None):
    return lab.cli(*args, env=env)


def validate_json(lab, *args):
    r, _, hosts = lab.cli_json("validate", *args)
    return r, hosts


def test_validate_healthy_hosts(server_lab):
    r, hosts = validate_json(server_lab, "all")
    assert r.returncode == 0, r.stdout
    ids = set()
    for name in server_lab.hosts:
        h = hosts[name]
        assert h["status"] == "ok" and h["error"] is None
        (s,) = h["servers"]
        assert (s["host"], s["port"], s["ok"], s["stand_in"]) == ("127.0.0.1", 30000, True, True)
        assert len(s["output_ids"]) == 16 and len(s["runs"]) == 3
        assert s["latency_s"] > 0 and s["e2e_latency_s"] > 0 and s["tokens_per_s"] > 0
        ids.add(tuple(s["output_ids"]))
    assert len(ids) == 1  # same seeded stand-in everywhere: greedy tokens agree
    r = fleetctl(server_lab, "validate", "all", env=dict(server_lab.env, COLUMNS="200"))
    assert r.returncode == 0 and "stand-in" in r.stdout and "recap: ok=4" in r.stdout


def test_host_that_stays_503_fails_at_health_deadline(server_lab):
    server_lab.set_behavior("lab-02", {"never_healthy": True}, restart=True)
    try:
        t0 = time.monotonic()
        r, hosts = validate_json(server_lab, "all", "--health-timeout", "4")
        took = time.monotonic() - t0
    finally:
        server_lab.set_behavior("lab-02", {}, restart=True)
    assert r.returncode == 2
    assert hosts["lab-02"]["status"] == "failed" and "health deadline" in hosts["lab-02"]["error"]
    assert all(hosts[h]["status"] == "ok" for h in ("lab-01", "lab-03", "lab-04"))
    assert took < 4 + 30


def test_host_without_server_is_skipped_not_passed(lab):
    r, hosts = validate_json(lab, "lab-01")
    assert r.returncode == 0
    assert hosts["lab-01"]["status"] == "skipped"
    assert hosts["lab-01"]["error"] == "validation: skipped (no server)"


def test_offline_smoke_command_from_inventory(lab, tmp_path):
    doc = yaml.safe_load(lab.inventory.read_text())
    hosts = doc["all"]["children"]["lab"]["hosts"]
    hosts["lab-01"]["fleetctl_smoke_cmd"] = "echo decoding; echo 16 tokens"
    hosts["lab-02"]["fleetctl_smoke_cmd"] = "echo broken >&2; exit 3"
    inv = tmp_path / "hosts.yaml"
    inv.write_text(yaml.safe_dump(doc))
    r, res = validate_json(lab, "lab-01:lab-02", "-i", str(inv))
    assert r.returncode == 2
    assert res["lab-01"]["status"] == "ok" and res["lab-01"]["offline"]["tail"] == ["decoding", "16 tokens"]
    assert res["lab-02"]["status"] == "failed" and "exit 3" in res["lab-02"]["error"]
    assert "broken" in res["lab-02"]["error"]


def test_apply_on_hosts_without_server_reports_validation_skipped_or_uses_offline_check(lab, tmp_path):
    doc = yaml.safe_load(lab.inventory.read_text())
    doc["all"]["children"]["lab"]["hosts"]["lab-03"]["fleetctl_smoke_cmd"] = "echo 'no decode here' >&2; exit 1"
    inv = tmp_path / "hosts.yaml"
    inv.write_text(yaml.safe_dump(doc))
    r = fleetctl(lab, "apply", "defrag-tier0", "lab-03:lab-04", "-i", str(inv), "--yes", "--json")
    try:
        hosts = {h["host"]: h for h in json.loads(r.stdout)["hosts"]}
        assert r.returncode == 2
        assert hosts["lab-04"]["status"] == "changed"
        assert hosts["lab-04"]["validation"] == {"status": "skipped", "reason": "no server"}
        # the offline check already fails before the change: the host is refused, nothing written (M8)
        assert hosts["lab-03"]["status"] == "failed" and "rolled_back" not in hosts["lab-03"]
        assert hosts["lab-03"]["error"] == ("baseline smoke failed: not changing this host: offline check "
                                            "\"echo 'no decode here' >&2; exit 1\" failed (exit 1): no decode here")
    finally:
        undo = fleetctl(lab, "rollback", "--last", "lab-03:lab-04", "-i", str(inv), "--yes")
        assert undo.returncode == 0, (undo.stdout[-2000:], undo.stderr[-2000:])
