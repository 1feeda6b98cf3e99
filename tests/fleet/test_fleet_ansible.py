"""The collection fleetctl.sglang run by ansible-core itself against the lab's real sshd hosts: the
same facts, diffs, ledger and rollbacks as the fleetctl CLI.

ansible-core comes from the `test` extra (scripts/setup.sh). The collection is built with
`fleetctl collection build --out` into a temporary ANSIBLE_COLLECTIONS_PATH; the inventory is
`fleetctl inventory export`'s, whose ansible_ssh_common_args name the lab's known_hosts
explicitly (HOME is never changed). Modules run with /usr/bin/python3 on the hosts.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import kernel_variant


BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "playbooks" / "ansible" / "defrag-tier0.yml"


def tool(name: str) -> str:
    """The ansible-core program `name` next to this interpreter (else on PATH)."""
    path = BIN / name
    found = str(path) if path.exists() else shutil.which(name)
    assert found, f"{name} not found: install the test extra (scripts/setup.sh)"
    return found


class Ansible:
    """ansible / ansible-playbook against one lab, with the collection built for this checkout."""

    def __init__(self, lab, tmp: Path):
        self.lab, self.tmp = lab, tmp
        r = lab.cli("collection", "build", "--out", str(tmp / "collections"))
        assert r.returncode == 0, r.stderr
        r = lab.cli("inventory", "export")
        assert r.returncode == 0, r.stderr
        assert f"UserKnownHostsFile={lab.known_hosts}" in r.stdout
        self.inventory = tmp / "inventory.yml"
        self.inventory.write_text(r.stdout)
        self.env = dict(lab.env, ANSIBLE_COLLECTIONS_PATH=str(tmp / "collections"),
                        ANSIBLE_PYTHON_INTERPRETER="/usr/bin/python3", ANSIBLE_LOCAL_TEMP=str(tmp / "atmp"),
                        ANSIBLE_SSH_CONTROL_PATH_DIR=str(tmp / "cp"), ANSIBLE_FORKS="8", ANSIBLE_NOCOLOR="1",
                        ANSIBLE_RETRY_FILES_ENABLED="0")

    def run(self, prog: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        return subprocess.run([tool(prog), "-i", str(self.inventory), *args], capture_output=True, text=True,
                              env=self.env, timeout=timeout, cwd=self.tmp)


@pytest.fixture(scope="module")
def ansible(server_lab, tmp_path_factory) -> Ansible:
    for h in server_lab.hosts:
        server_lab.set_behavior(h, {}, restart=True)
    return Ansible(server_lab, tmp_path_factory.mktemp("ansible"))


def sha(lab, host: str, path: str) -> str:
    r = lab.ssh(host, f"sha256sum {path}")
    assert r.returncode == 0, r.stderr
    return r.stdout.split()[0]


def ledger(lab, host: str) -> dict[str, str]:
    """{change id: its last state} in the host's ledger, read over SSH (the CLI's reading of it
    is checked where it matters, with `fleetctl status`)."""
    r = lab.ssh(host, "cat /var/lib/fleetctl/ledger.jsonl 2>/dev/null || true")
    assert r.returncode == 0, r.stderr
    return {e["change_id"]: e["state"] for e in map(json.loads, r.stdout.splitlines())}


@pytest.fixture(scope="module")
def cli_check(server_lab) -> dict:
    """`fleetctl apply defrag-tier0 all --check --diff --json`'s host entries (nothing changed yet)."""
    return server_lab.cli_json("apply", "defrag-tier0", "all", "--check", "--diff")[2]


def test_inspect_module_equals_cli(ansible, server_lab):
    """The inspect module's installs and call sites are `fleetctl inspect --json`'s, on every release."""
    tree = ansible.tmp / "tree"
    r = ansible.run("ansible", "all", "-m", "fleetctl.sglang.inspect", "--tree", str(tree))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    _, _, cli = server_lab.cli_json("inspect", "all", rc=0)
    releases = set()
    for host in server_lab.hosts:
        mod = json.loads((tree / host).read_text())
        assert mod["ansible_facts"]["fleetctl"]["allocator_call_sites"] == mod["allocator_call_sites"]
        assert [(i["id"], i["sglang"]["version"]) for i in mod["installs"]] == \
            [(i["id"], i["sglang"]["version"]) for i in cli[host]["installs"]]
        for got, want in zip(mod["installs"], cli[host]["installs"]):
            assert got["allocator_call_sites"] == want["allocator_call_sites"]
            assert got["need_sort_origins"] == want["need_sort_origins"]
        assert mod["allocator_call_sites"] == cli[host]["allocator_call_sites"]
        # the install was located by its own interpreter (the module re-ran its payload there)
        assert mod["facts"]["interpreter_discovery"]["python"] == cli[host]["facts"]["interpreter_discovery"]["python"]
        releases.add(mod["facts"]["sglang"]["version"])
    assert releases == {"0.4.6.post5", "0.5.2", "0.5.10", "0.5.23"}


CHECK_PLAY = """
- hosts: all
  gather_facts: false
  tasks:
    - fleetctl.sglang.patch:
        playbook: defrag-tier0
      register: patch
    - ansible.builtin.copy:
        content: "{{ patch | to_json }}"
        dest: "{{ out }}/{{ inventory_hostname }}.json"
        mode: "0600"
      delegate_to: localhost
      check_mode: false
"""


def test_check_diff_changes_nothing_and_shows_fleetctl_diffs(ansible, server_lab, cli_check):
    """ansible-playbook --check --diff: the same unified diffs as `fleetctl apply --check --diff`,
    nothing written, nothing in any ledger."""
    cli = cli_check
    out = ansible.tmp / "check"
    out.mkdir()
    play = ansible.tmp / "check.yml"
    play.write_text(CHECK_PLAY)
    before = {h: ledger(server_lab, h) for h in server_lab.hosts}
    r = ansible.run("ansible-playbook", str(play), "--check", "--diff", "-e", f"out={out}")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    changed = 0
    for host in server_lab.hosts:
        got = json.loads((out / f"{host}.json").read_text())
        want = [f["diff"] for f in cli[host]["plan"]["files"]]
        assert [d["prepared"] for d in got.get("diff", [])] == want
        assert got["changed"] == bool(want) == (cli[host]["status"] == "changed")
        changed += bool(want)
        for d in want:
            assert d in r.stdout  # what --diff prints is fleetctl's diff text
        for f in cli[host]["plan"]["files"]:
            assert sha(server_lab, host, f["path"]) == f["pre_sha256"]
    assert changed == 3  # 0.4.6.post5 has no need_sort
    assert {h: ledger(server_lab, h) for h in server_lab.hosts} == before


# The gate's latency check against a machine shared with other test runs: the failing host here
# fails by its tokens, so latency is given room (the playbook's fleetctl_latency_tolerance).
LOADED = ("-e", "fleetctl_latency_tolerance=20")


def test_example_playbook_gate_rollback_and_cli_ledger(ansible, server_lab, cli_check):
    """playbooks/ansible/defrag-tier0.yml: lab-01 (batch 1, 0.4.6.post5: nothing to change) is ok;
    lab-02 (batch 2)
    fails its gate (the restarted server decodes other tokens), is rolled back byte-identical,
    and max_fail_percentage stops the rollout before lab-03 and lab-04. A second run on lab-01 is
    changed=0; its ledger entry, written through Ansible, is read by `fleetctl status` and
    undone by `fleetctl rollback`."""
    files = {h: [f["path"] for f in cli_check[h]["plan"]["files"]] for h in server_lab.hosts}
    before = {h: {p: sha(server_lab, h, p) for p in files[h]} for h in server_lab.hosts}
    server_lab.set_behavior("lab-02", {"token_shift": 1}, restart=False)  # the handler's restart reads it
    try:
        r = ansible.run("ansible-playbook", str(EXAMPLE), *LOADED)
    finally:
        server_lab.set_behavior("lab-02", {}, restart=True)
    log = r.stdout[-6000:] + r.stderr[-2000:]
    assert r.returncode == 2, log
    assert "lab-02" in r.stdout and "rolled back: validation failed" in r.stdout, log
    assert "lab-03" not in r.stdout.split("PLAY RECAP")[0] and "lab-04" not in r.stdout.split("PLAY RECAP")[0], log
    recap = r.stdout.split("PLAY RECAP")[1]
    assert "lab-02" in recap and "rescued=1" in recap.split("lab-02")[1].splitlines()[0], log
    # lab-02: byte-identical, ledger says rolled back; lab-03/04 untouched and no ledger entry
    for p, digest in before["lab-02"].items():
        assert sha(server_lab, "lab-02", p) == digest
    _, _, st = server_lab.cli_json("status", "lab-02")
    assert [c["state"] for c in st["lab-02"]["changes"]] == ["rolled-back"]
    assert ledger(server_lab, "lab-03") == {} and ledger(server_lab, "lab-04") == {}
    for h in ("lab-03", "lab-04"):
        assert {p: sha(server_lab, h, p) for p in files[h]} == before[h]
    # lab-03 applied on its own, then the second run: changed=0
    r2 = ansible.run("ansible-playbook", str(EXAMPLE), "--limit", "lab-03", *LOADED)
    assert r2.returncode == 0, r2.stdout[-4000:]
    r3 = ansible.run("ansible-playbook", str(EXAMPLE), "--limit", "lab-03", *LOADED)
    assert r3.returncode == 0 and "changed=0" in r3.stdout.split("PLAY RECAP")[1], r3.stdout[-4000:]
    # the ledger written through Ansible: fleetctl status reads it, fleetctl rollback undoes it
    _, _, st = server_lab.cli_json("status", "lab-03", rc=0)
    [entry] = st["lab-03"]["changes"]
    assert entry["state"] == "applied" and entry["operator"] == "ansible@lab-03"
    assert {sha(server_lab, "lab-03", p) for p in files["lab-03"]} != set(before["lab-03"].values())
    server_lab.cli_json("rollback", entry["change_id"], "lab-03", "--yes", rc=0)
    assert {p: sha(server_lab, "lab-03", p) for p in files["lab-03"]} == before["lab-03"]


def test_lock_lease_is_honoured_by_the_cli(ansible, server_lab):
    """While fleetctl.sglang.lock holds its lease, `fleetctl recover` (which takes the host lock
    like apply) fails fast naming the holder; once released, it runs."""
    r = ansible.run("ansible", "lab-04", "-m", "fleetctl.sglang.lock", "-a", "state=acquired lease_s=120 holder=play-42")
    assert r.returncode == 0 and '"changed": true' in r.stdout, r.stdout[-2000:]
    try:
        _, _, hosts = server_lab.cli_json("recover", "lab-04", "--yes")
        assert hosts["lab-04"]["status"] == "failed" and "play-42" in hosts["lab-04"]["error"]
    finally:
        r = ansible.run("ansible", "lab-04", "-m", "fleetctl.sglang.lock", "-a", "state=released")
    assert r.returncode == 0 and '"changed": true' in r.stdout, r.stdout[-2000:]
    _, _, hosts = server_lab.cli_json("recover", "lab-04", "--yes", rc=0)
    assert hosts["lab-04"]["status"] == "ok"


KERNEL_PLAY = """
- hosts: all
  gather_facts: false
  tasks:
    - fleetctl.sglang.lock: {state: acquired, lease_s: 1200, holder: kernel-play}
    - block:
        - fleetctl.sglang.kernel:
            name: verify_attention
            kernels_dir: "{{ kernels }}"
            max_jobs: 2
            commit: true
          register: kernel
        - ansible.builtin.copy:
            content: "{{ kernel | to_json }}"
            dest: "{{ out }}/{{ inventory_hostname }}-{{ run }}.json"
            mode: "0600"
          delegate_to: localhost
          check_mode: false
      always:
        - fleetctl.sglang.lock: {state: released}
"""
KDIR = "/var/lib/fleetctl/kernels/verify_attention"


def active(lab, host: str) -> str | None:
    r = lab.ssh(host, f"if [ -L {KDIR}/current ]; then readlink {KDIR}/current; fi")
    assert r.returncode == 0, r.stderr
    return r.stdout.strip() or None


@pytest.mark.slow
def test_kernel_plugin_builds_tests_activates_and_the_cli_sees_it(ansible, server_lab, tmp_path):
    """fleetctl.sglang.kernel on one host: --check builds and activates nothing; a run builds (real
    torch extension build, CPU backend), passes the reference test and activates, and `fleetctl
    status` shows the active build and the ledger entry; a second run reuses it (changed: false);
    `fleetctl rollback` switches back."""
    host = "lab-02"
    kernels = kernel_variant(tmp_path, "ansible")  # a build key no other test builds
    out = ansible.tmp / "kernel"
    out.mkdir()
    play = ansible.tmp / "kernel.yml"
    play.write_text(KERNEL_PLAY)
    before = active(server_lab, host)

    def run(name: str, *args: str) -> dict:
        r = ansible.run("ansible-playbook", str(play), "--limit", host, *args,
                        "-e", f"kernels={kernels} out={out} run={name}", timeout=1200)
        assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
        return json.loads((out / f"{host}-{name}.json").read_text())

    chk = run("check", "--check")
    assert chk["changed"] is True and chk["reused"] is False and chk["previous"] == before
    assert "build" not in chk and "change_id" not in chk
    r = server_lab.ssh(host, f"test -e {KDIR}/{chk['build_key']} && echo built || echo none")
    assert r.stdout.strip() == "none" and active(server_lab, host) == before

    got = run("first")
    assert got["changed"] is True and got["reused"] is False and got["build_key"] == chk["build_key"]
    assert got["backend"] == "cpu" and got["build"]["ok"] is True and got["test"]["ok"] is True
    assert got["test"]["failures"] == [] and len(got["test"]["cases"]) > 10
    assert active(server_lab, host) == got["build_key"]
    _, _, st = server_lab.cli_json("status", host, rc=0)
    assert st[host]["kernels"]["verify_attention"] == got["build_key"]
    [entry] = [c for c in st[host]["changes"] if c["change_id"] == got["change_id"]]
    assert (entry["state"], entry["playbook"], entry["operator"]) == \
        ("applied", "kernel verify_attention", f"ansible@{host}")

    again = run("second")
    assert again["changed"] is False and again["reused"] is True and "build" not in again
    assert "change_id" not in again and active(server_lab, host) == got["build_key"]

    server_lab.cli_json("rollback", got["change_id"], host, "--yes", rc=0)
    assert active(server_lab, host) == before


def test_modules_refuse_a_ledger_of_a_newer_schema(ansible, server_lab):
    """A ledger with an entry of a newer schema than the collection's probes know is refused by
    the modules (they would misread it), and left as it was."""
    sd = "/var/tmp/fleetctl-newer-ledger"
    line = json.dumps({"change_id": "c9", "state": "applied", "schema": 99, "files": []})
    r = server_lab.ssh("lab-04", f"rm -rf {sd} && mkdir -m 700 {sd} && echo '{line}' > {sd}/ledger.jsonl")
    assert r.returncode == 0, r.stderr
    try:
        r = ansible.run("ansible", "lab-04", "-m", "fleetctl.sglang.patch", "-a",
                        f"state=rolled_back change_id=c9 state_dir={sd}")
        assert r.returncode == 2, r.stdout[-2000:]
        assert "schema 99, newer than this fleetctl's 1" in r.stdout and "upgrade fleetctl" in r.stdout, r.stdout[-2000:]
        assert server_lab.ssh("lab-04", f"cat {sd}/ledger.jsonl").stdout.strip() == line
    finally:
        server_lab.ssh("lab-04", f"rm -rf {sd}")
