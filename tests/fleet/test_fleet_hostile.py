"""A hostile host: things a non-root user on a lab host can plant, against the real change probe
over real sshd (security review H1, M7, L1). Each test plants, runs, asserts the exact status and
message, checks that the venv, the state dir and every decoy are byte-identical, and restores."""

from __future__ import annotations

import hashlib
import json
import secrets
import subprocess
import sys
import time

import pytest
import yaml

from fleetctl.engine.changes import change_probe
from fleetctl.engine.fleet import Fleet
from fleetctl.errors import HostFailed
from fleetctl.inventory import load
from fleetctl.vocab import HostStatus


HOST = "lab-04"  # SGLang 0.5.23
SITE = "/opt/sglang/venv/lib/python3.11/site-packages"
REL = "sglang/srt/mem_cache/kv_cache_configurator.py"  # what defrag-tier0 edits on 0.5.23
TARGET = f"{SITE}/{REL}"
STATE = "/var/lib/fleetctl"
DECOY = "/root/fleetctl-decoy"  # outside the package: must never change
# A state dir of this test's own for the probe-level plants, so the shared ledger stays clean.
PROBE_STATE = "/var/lib/fleetctl-hostile-test"


def digest(lab, *paths: str) -> str:
    """One sha256 over names, types, modes, owners, link targets and file bytes under `paths`."""
    quoted = " ".join(paths)
    r = lab.ssh(HOST, f"for p in {quoted}; do [ -e \"$p\" ] || [ -L \"$p\" ] || continue; "
                      "find \"$p\" -printf '%p %y %m %U %G %l\\n' | sort; "
                      "find \"$p\" -type f -print0 | sort -z | xargs -0 -r sha256sum; "
                      "done | sha256sum")
    assert r.returncode == 0, r.stderr
    return r.stdout.split()[0]


def sh(lab, cmd: str) -> str:
    r = lab.ssh(HOST, cmd)
    assert r.returncode == 0, (cmd, r.stderr)
    return r.stdout


@pytest.fixture
def guarded(lab):
    """Hashes of the venv's sglang tree, the state dir's ledger and backups (the lock files change
    with every run) and the decoy before the test; after it (plants removed by the test's own
    `finally`), they must be the same."""
    sh(lab, f"rm -rf {DECOY} && mkdir -p {DECOY} && printf 'root:x:0:0::/root:/bin/sh\\n' > {DECOY}/passwd && "
            f"cp {TARGET} {DECOY}/copy.py && chmod 600 {DECOY}/passwd")
    paths = (f"{SITE}/sglang", f"{STATE}/ledger.jsonl", f"{STATE}/backups", DECOY)
    before = {p: digest(lab, p) for p in paths}
    yield
    after = {p: digest(lab, p) for p in paths}
    sh(lab, f"rm -rf {DECOY} {PROBE_STATE}")
    assert after == before


def test_apply_never_writes_through_a_symlinked_target(lab, guarded):
    """The edited file is a link to a file outside the package with the same bytes: apply (the
    CLI, check pass and all) changes nothing on the host and writes nothing anywhere (the
    decoys are hashed by `guarded`)."""
    sh(lab, f"mv {TARGET} {TARGET}.real && ln -s {DECOY}/copy.py {TARGET}")
    try:
        r, doc, hosts = lab.cli_json("apply", "defrag-tier0", HOST, "--yes")
    finally:
        sh(lab, f"rm -f {TARGET} && mv {TARGET}.real {TARGET}")
    # inspect reads only regular files (review L11): the linked file is not scanned, so no plan
    # edits it and nothing is written through the link (the probe's own refusal of a linked
    # target is test_planted_links_never_redirect_a_write's)
    assert r.returncode == 0 and "nothing to change" in r.stderr, (r.stdout[-2000:], r.stderr[-2000:])
    assert hosts[HOST]["status"] != "changed" and not hosts[HOST].get("change_id")


def test_planted_links_never_redirect_a_write(lab, guarded):
    """Through the real probe on the host: every place a write goes (temp names, the package's
    directories, __pycache__, the backups, the ledger, the state dir) planted in turn."""
    inv_host = load(lab.inventory).select(HOST)[0]
    with Fleet(lab.settings(), timeout=120) as fleet:
        def job(ctx):
            text = ctx.run(["cat", TARGET]).stdout.decode()
            pre = hashlib.sha256(text.encode()).hexdigest()
            new = text + "# fleetctl hostile-host test\n"
            files = [{"path": TARGET, "pre_sha256": pre, "post_sha256": hashlib.sha256(new.encode()).hexdigest(),
                      "new_text": new}]
            seen = {}

            def attempt(name, cid, plant, undo, **kw):
                sh(lab, plant)
                try:
                    change_probe(ctx, "apply", PROBE_STATE, change_id=cid, playbook="t", operator="t",
                                 files=kw.get("files", files), root=SITE, commit=False)
                    seen[name] = "applied"
                except HostFailed as e:
                    seen[name] = str(e)
                finally:
                    sh(lab, undo)

            d = f"{SITE}/sglang/srt/mem_cache"
            attempt("dir", "h-dir", f"mv {d} {d}.real && cp -a {d}.real {DECOY}/mem_cache && ln -s {DECOY}/mem_cache {d}",
                    f"rm -f {d} && mv {d}.real {d} && rm -rf {DECOY}/mem_cache")
            attempt("pycache", "h-pyc",
                    f"mkdir -p {DECOY}/pyc && mv {d}/__pycache__ {d}/__pycache__.real 2>/dev/null; "
                    f"ln -s {DECOY}/pyc {d}/__pycache__",
                    f"rm -f {d}/__pycache__ && (mv {d}/__pycache__.real {d}/__pycache__ 2>/dev/null; true) && "
                    f"rm -rf {DECOY}/pyc")
            attempt("outside", "h-out", "true", "true",
                    files=[{"path": f"{DECOY}/passwd", "pre_sha256": "0" * 64, "post_sha256": "0" * 64,
                            "new_text": ""}])
            attempt("state-mode", "h-mode", f"mkdir -p {PROBE_STATE} && chmod 777 {PROBE_STATE}",
                    f"rm -rf {PROBE_STATE}")
            attempt("ledger", "h-ledger", f"mkdir -m 700 -p {PROBE_STATE} && ln -s {DECOY}/passwd {PROBE_STATE}/ledger.jsonl",
                    f"rm -rf {PROBE_STATE}")
            attempt("backups", "h-backups", f"mkdir -m 700 -p {PROBE_STATE} && ln -s {DECOY} {PROBE_STATE}/backups",
                    f"rm -f {PROBE_STATE}/backups")
            # the old predictable temp names (review H1) planted as links to the decoy: the write
            # and its rollback go on, and never through them
            tmps = [f"{d}/.kv_cache_configurator.py.fleetctl-h-tmp{t}.tmp" for t in ("", "-rb")]
            sh(lab, " && ".join(f"ln -s {DECOY}/passwd {t}" for t in tmps))
            try:
                change_probe(ctx, "apply", PROBE_STATE, change_id="h-tmp", playbook="t", operator="t", files=files,
                             root=SITE, commit=False)
                seen["tmp-applied"] = sh(lab, f"sha256sum < {TARGET}").split()[0] == files[0]["post_sha256"]
                change_probe(ctx, "rollback", PROBE_STATE, change_id="h-tmp", reason="test")
                seen["tmp-restored"] = sh(lab, f"sha256sum < {TARGET}").split()[0] == pre
                seen["modes"] = sh(lab, f"stat -c '%a %U' {PROBE_STATE} {PROBE_STATE}/ledger.jsonl").split("\n")[:2]
            finally:
                sh(lab, f"rm -f {' '.join(tmps)}")
            return ctx.result(HostStatus.OK, data={"seen": seen})

        res = fleet.run([inv_host], job)[0]
    assert res.status == "ok", res.error
    seen = res.data["seen"]
    assert seen["dir"] == f"apply: {DECOY}/mem_cache/kv_cache_configurator.py is outside {SITE} (links resolved): " \
                          "fleetctl only writes there"
    assert seen["pycache"] == f"apply: {SITE}/sglang/srt/mem_cache/__pycache__ is a symlink: not changing it"
    assert seen["outside"] == f"apply: {DECOY}/passwd is outside {SITE} (links resolved): fleetctl only writes there"
    assert seen["state-mode"] == (f"apply: state dir {PROBE_STATE} is owned by uid 0 with mode 777: only its owner "
                                  "(uid 0) may write it, or its ledger cannot be trusted")
    assert seen["ledger"] == f"apply: ledger: {PROBE_STATE}/ledger.jsonl is a symlink, not a regular file"
    assert seen["backups"] == (f"apply: apply failed, files restored: {PROBE_STATE}/backups is a symlink: "
                               "fleetctl does not go through it")
    assert (seen["tmp-applied"], seen["tmp-restored"]) == (True, True)
    assert seen["modes"] == ["700 root", "600 root"]


def test_api_key_server_with_hostile_argv(server_lab, tmp_path):
    """A server started with --api-key and a model path holding Rich markup and terminal escapes
    (what any local user can put in a process's argv): inspect prints the path escaped and the
    key nowhere; apply refuses the host before writing (its baseline decode gets 401), then
    goes through with fleetctl_sglang_api_key, which is never printed (review M5, M8, M9)."""
    key = "sk-fleetctl-" + secrets.token_hex(12)
    model = "[/INST] [bold red]FAKE OK[/] \x1b[2K"
    # the stand-in behind the key, its model path holding markup and escapes (an argv is the
    # process owner's to choose; a process that only carries SGLang's words in its argv is not
    # taken for a server since the installs model, so the hostile argv is the real server's)
    plant = (f"/opt/fleetctl-standin/restart.sh --api-key {key} "
             "--model-path \"$(printf '[/INST] [bold red]FAKE OK[/] \\033[2K')\"")
    inv = yaml.safe_load(server_lab.inventory.read_text())
    inv["all"]["children"]["lab"]["hosts"][HOST]["fleetctl_sglang_api_key"] = key
    with_key = tmp_path / "hosts.yaml"
    with_key.write_text(yaml.safe_dump(inv))
    r = server_lab.ssh(HOST, plant)
    assert r.returncode == 0, r.stderr
    before = digest(server_lab, f"{SITE}/sglang", f"{STATE}/ledger.jsonl", f"{STATE}/backups")
    try:
        shown = server_lab.cli("inspect", HOST, env={"COLUMNS": "400"})
        js, doc, hosts = server_lab.cli_json("inspect", HOST)
        assert (shown.returncode, js.returncode) == (0, 0), shown.stdout[-2000:]
        served = next(s for s in hosts[HOST]["facts"]["servers"] if s["port"] == 30000)
        assert served["model_path"] == model and served["argv"][-4:] == ["--api-key", "<redacted>", "--model-path", model]
        assert "[/INST] [bold red]FAKE OK[/] \\x1b[2K" in shown.stdout and "\x1b" not in shown.stdout

        refused, _, hosts = server_lab.cli_json("apply", "defrag-tier0", HOST, "--yes")
        assert refused.returncode == 2
        assert (hosts[HOST]["status"], hosts[HOST]["error"]) == (
            "failed", "baseline smoke failed: not changing this host: "
                      '127.0.0.1:30000: /generate answered HTTP 401: {"error": "Unauthorized"}')
        assert digest(server_lab, f"{SITE}/sglang", f"{STATE}/ledger.jsonl", f"{STATE}/backups") == before

        passed, _, hosts = server_lab.cli_json("apply", "defrag-tier0", HOST, "--yes", "-i", str(with_key))
        assert (passed.returncode, hosts[HOST]["status"]) == (0, "changed"), passed.stdout[-3000:]
        for out in (shown, js, refused, passed):
            assert key not in out.stdout + out.stderr
    finally:
        server_lab.set_behavior(HOST, {}, restart=True)
        r = server_lab.cli("rollback", "--last", HOST, "--yes")
        assert r.returncode == 0, r.stdout[-2000:]


def test_world_writable_pth_in_an_inventory_venv_runs_only_as_nobody(lab, guarded, tmp_path):
    """A `.pth` another user can write in the inventory's interpreter (site.py runs its import
    lines at startup): its line runs, but never as root (issue 48: the facts probe asks the
    interpreter as nobody, the owner of this root-owned venv having no server here); the
    probe itself starts the interpreter `-I -S` only (review M6's refusal is no longer needed)."""
    pth, mark = f"{SITE}/zz-fleetctl-test.pth", "/tmp/fleetctl-test-pth-uid"
    sh(lab, f"rm -f {mark}; printf 'import os; open(\"{mark}\", \"a\").write(\"%%d \" %% os.geteuid())\\n' > {pth} "
            f"&& chmod 666 {pth}")
    inv = yaml.safe_load(lab.inventory.read_text())
    inv["all"]["children"]["lab"]["hosts"][HOST]["fleetctl_python"] = "/opt/sglang/venv/bin/python"
    named = tmp_path / "hosts.yaml"
    named.write_text(yaml.safe_dump(inv))
    try:
        r, _, hosts = lab.cli_json("inspect", HOST, "-i", str(named))
        uids = lab.ssh(HOST, f"cat {mark}").stdout.split()
    finally:
        sh(lab, f"rm -f {pth} {mark}")
    assert r.returncode == 0 and hosts[HOST]["status"] == "ok", hosts[HOST].get("error")
    assert uids and set(uids) == {"65534"}, uids  # it ran, as nobody only
    [inst] = hosts[HOST]["installs"]
    assert inst["asked_as"] == {"uid": 65534, "why": "the unprivileged account nobody"}


# The fleetctl CLI in a child, its peak RSS read after it exits (RUSAGE_CHILDREN: the largest of
# the children waited for, the ssh client included).
PEAK_CLI = """
import json, resource, subprocess, sys
p = subprocess.run([sys.executable, "-m", "fleetctl.cli", *sys.argv[1:]], capture_output=True, text=True)
print(json.dumps({"rc": p.returncode, "stdout": p.stdout, "stderr": p.stderr[-2000:],
                  "peak": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}))
"""


@pytest.mark.parametrize("kind", ["paramiko", "ssh"])
def test_a_gibibyte_probe_answer_through_sshd_is_cut_at_the_cap(lab, tmp_path, kind):
    """Review M3 through real sshd, both connections: an interpreter (named in the inventory,
    root's and trusted) that answers the facts probe with 1 GiB: the host is failed with the cap's
    message, the run goes on (lab-02 is inspected), and fleetctl never holds much more than the
    64 MiB cap (peak RSS under cap + 200 MiB)."""
    from fleetctl.connection.base import OUTPUT_MAX
    big = "/opt/sglang/fleetctl-big/bin/python"  # the host's private /opt/sglang: root's, 0755
    sh(lab, f"mkdir -p {big.rsplit('/', 1)[0]} && printf '#!/bin/sh\\nexec head -c {1 << 30} /dev/zero\\n' > {big} "
            f"&& chmod 755 {big}")
    inv = yaml.safe_load(lab.inventory.read_text())
    hosts_ = inv["all"]["children"]["lab"]["hosts"]
    hosts_[HOST]["fleetctl_python"] = big
    named = tmp_path / "hosts.yaml"
    named.write_text(yaml.safe_dump(inv))
    try:
        p = subprocess.run([sys.executable, "-c", PEAK_CLI, "inspect", f"{HOST},lab-02", "-i", str(named), "-c", kind,
                            "--json"], capture_output=True, text=True, env=lab.env, timeout=600)
    finally:
        sh(lab, f"rm -rf {big.rsplit('/', 2)[0]}")
    r = json.loads(p.stdout)
    hosts = {h["host"]: h for h in json.loads(r["stdout"])["hosts"]}
    assert r["rc"] == 2 and hosts[HOST]["status"] == "failed", (r["rc"], r["stderr"], hosts[HOST])
    assert hosts[HOST]["error"].startswith("output over 64 MiB from the facts.host probe"), hosts[HOST]["error"]
    assert hosts["lab-02"]["status"] == "ok", hosts["lab-02"]["error"]
    assert r["peak"] < OUTPUT_MAX + (200 << 20), r["peak"]


def test_a_record_naming_a_fifo_and_dev_zero_through_sshd_is_reported_not_read(lab, guarded):
    """Review L11 / M3 through real sshd: the installed RECORD names a FIFO in the package and
    /dev/zero; `status` finishes well within its deadline (neither is opened) and reports both
    as skipped, not read."""
    record = sh(lab, f"ls {SITE}/sglang-*.dist-info/RECORD").strip()
    up = "../" * len(SITE.strip("/").split("/"))
    sh(lab, f"cp -p {record} /root/RECORD.fleetctl-test && mkfifo {SITE}/sglang/fifo_planted.py && "
            f"printf 'sglang/fifo_planted.py,sha256=AAAA,1\\n{up}dev/zero,sha256=AAAA,1\\n' >> {record}")
    try:
        t0 = time.monotonic()
        r, _, hosts = lab.cli_json("status", HOST, "--timeout", "120")
        took = time.monotonic() - t0
    finally:
        sh(lab, f"mv /root/RECORD.fleetctl-test {record} && rm -f {SITE}/sglang/fifo_planted.py")
    h = hosts[HOST]
    assert took < 120 and h["status"] == "failed", (took, h["status"], h["error"])
    assert [m for m in h["modified"] if "skipped" in m["problem"]] == [
        {"path": f"{SITE}/sglang/fifo_planted.py",
         "problem": f"skipped, not read: {SITE}/sglang/fifo_planted.py is a FIFO, not a regular file"},
        {"path": "/dev/zero", "problem": "skipped, not read: /dev/zero is a character device, not a regular file"}]
