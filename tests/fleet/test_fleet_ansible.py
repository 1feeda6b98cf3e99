"""The collection fleetctl.sglang run by ansible-core itself against the lab's real sshd hosts: the
same facts, diffs, ledger and rollbacks as the fleetctl CLI.

ansible-core runs from a venv per series fleetctl allows (2.18, 2.19: the newest patch of each,
pinned and built by scripts/setup.sh in <wheel cache>/venvs/ansible-core-SERIES); the shipped
example playbook runs on both, the other tests on the newest. The collection is built with
`fleetctl collection build --out` into a temporary ANSIBLE_COLLECTIONS_PATH; the inventory is
`fleetctl inventory export`'s, whose ansible_ssh_common_args name the lab's known_hosts
explicitly (HOME is never changed). Modules run with /usr/bin/python3 on the hosts unless the
inventory names another ansible_python_interpreter.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from conftest import kernel_variant
from fleetctl.wheels import cache_dir
from helpers.ledger import over_ssh as ledger


ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "playbooks" / "ansible" / "defrag-tier0.yml"
SERIES = ("2.18", "2.19")  # the ansible-core series fleetctl allows (pyproject's `ansible` extra)
NEWEST = SERIES[-1]


def venv_bin(series: str) -> Path:
    """The bin/ of scripts/setup.sh's venv holding ansible-core `series` (its newest patch)."""
    d = cache_dir() / "venvs" / f"ansible-core-{series}" / "bin"
    assert (d / "ansible-playbook").exists(), f"no ansible-core {series} venv at {d.parent}: run scripts/setup.sh"
    return d


class Ansible:
    """ansible / ansible-playbook of one ansible-core series against one lab (its inventory, or
    `inventory`: another fleetctl inventory of its hosts), with the collection at `path`."""

    def __init__(self, lab, tmp: Path, series: str, path: Path, inventory: Path | None = None):
        self.lab, self.tmp, self.bin = lab, tmp, venv_bin(series)
        r = lab.cli("inventory", "export", *(["-i", str(inventory)] if inventory else []))
        assert r.returncode == 0, r.stderr
        assert f"UserKnownHostsFile={lab.known_hosts}" in r.stdout
        self.inventory = tmp / f"inventory-{series}.yml"
        self.inventory.write_text(r.stdout)
        self.env = dict(lab.env, ANSIBLE_COLLECTIONS_PATH=str(path),
                        ANSIBLE_PYTHON_INTERPRETER="/usr/bin/python3", ANSIBLE_LOCAL_TEMP=str(tmp / "atmp"),
                        ANSIBLE_SSH_CONTROL_PATH_DIR=str(tmp / "cp"), ANSIBLE_FORKS="8", ANSIBLE_NOCOLOR="1",
                        ANSIBLE_RETRY_FILES_ENABLED="0")
        r = subprocess.run([str(self.bin / "ansible"), "--version"], capture_output=True, text=True, env=self.env)
        assert r.returncode == 0, r.stderr
        self.version = r.stdout.split("[core ", 1)[1].split("]", 1)[0]  # "ansible [core 2.19.14]"
        assert self.version.startswith(series + "."), r.stdout

    def run(self, prog: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        return subprocess.run([str(self.bin / prog), "-i", str(self.inventory), *args], capture_output=True,
                              text=True, env=self.env, timeout=timeout, cwd=self.tmp)


@pytest.fixture(scope="module")
def collections(server_lab, tmp_path_factory) -> Path:
    """The collection built for this checkout (`fleetctl collection build --out`), as an
    ANSIBLE_COLLECTIONS_PATH."""
    out = tmp_path_factory.mktemp("collections")
    r = server_lab.cli("collection", "build", "--out", str(out))
    assert r.returncode == 0, r.stderr
    return out


@pytest.fixture(scope="module")
def ansibles(server_lab, collections, tmp_path_factory) -> dict[str, Ansible]:
    """{series: Ansible} against the server lab, its stand-ins well-behaved: one an earlier test
    gave a behaviour, or one that is not healthy, is reset and restarted (a restart costs seconds
    of CPU: the others are left running)."""
    for h in server_lab.hosts:
        if h in server_lab.behaved or not server_lab.server_healthy(h):
            server_lab.set_behavior(h, {}, restart=True)
    tmp = tmp_path_factory.mktemp("ansible")
    return {s: Ansible(server_lab, tmp, s, collections) for s in SERIES}


@pytest.fixture(scope="module")
def ansible(ansibles) -> Ansible:
    """The newest series' Ansible, for the tests that run on one."""
    return ansibles[NEWEST]


def recap(stdout: str) -> dict[str, dict[str, int]]:
    """ansible-playbook's PLAY RECAP: {host: {"ok": n, "changed": n, "failed": n, ...}}."""
    out = {}
    for line in stdout.split("PLAY RECAP", 1)[1].splitlines():
        host, sep, counts = line.partition(" : ")
        if sep:
            out[host.strip()] = {k: int(v) for k, v in (c.split("=") for c in counts.split())}
    return out


def sha(lab, host: str, path: str) -> str:
    r = lab.ssh(host, f"sha256sum {path}")
    assert r.returncode == 0, r.stderr
    return r.stdout.split()[0]


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


MOVED = "/opt/sglang/env-moved"  # none of the facts probe's common venv locations (probes/facts/host.py)


@pytest.fixture(scope="module")
def moved_venv(lab, tmp_path_factory):
    """The lab without servers, its lab-03's SGLang venv moved to MOVED, which only the
    inventory's ansible_python_interpreter names: (host, its release, that fleetctl inventory,
    `fleetctl inspect`'s entry for the host). Moved back after."""
    host = "lab-03"
    release = next(h["release"] for h in lab.status if h["name"] == host)
    doc = yaml.safe_load(lab.inventory.read_text())
    doc["all"]["children"]["lab"]["hosts"][host]["ansible_python_interpreter"] = f"{MOVED}/bin/python"
    inventory = tmp_path_factory.mktemp("moved") / "inventory.yml"
    inventory.write_text(yaml.safe_dump(doc, sort_keys=False))
    r = lab.ssh(host, f"mv /opt/sglang/venv {MOVED}")
    assert r.returncode == 0, r.stderr
    try:
        _, _, cli = lab.cli_json("inspect", host, "-i", str(inventory), rc=0)
        yield host, release, inventory, cli[host]
    finally:
        r = lab.ssh(host, f"mv {MOVED} /opt/sglang/venv")
        assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("series", SERIES)
def test_inspect_module_asks_ansible_python_interpreter(series, moved_venv, lab, collections, tmp_path):
    """On a host where no server runs and SGLang's venv is where only ansible_python_interpreter
    names it, the inspect module (run by Ansible under that interpreter) finds that install, as
    `fleetctl inspect` on the same inventory does."""
    host, release, inventory, cli = moved_venv
    assert cli["facts"]["sglang"]["version"] == release  # the CLI asks the inventory's interpreter
    assert cli["facts"]["interpreter_discovery"]["python"] == f"{MOVED}/bin/python"
    ansible = Ansible(lab, tmp_path, series, collections, inventory)
    r = ansible.run("ansible", host, "-m", "fleetctl.sglang.inspect", "--tree", str(tmp_path / "tree"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    mod = json.loads((tmp_path / "tree" / host).read_text())
    assert (mod["facts"]["sglang"] or {}).get("version") == release, mod["facts"]["sglang_reason"]
    assert mod["facts"]["sglang_reason"] is None
    assert mod["facts"]["interpreter_discovery"]["python"] == f"{MOVED}/bin/python"
    assert [(i["id"], i["python"]["path"]) for i in mod["installs"]] == \
        [(i["id"], i["python"]["path"]) for i in cli["installs"]]
    assert mod["need_sort_origins"] == cli["need_sort_origins"]


# The gate's latency check against a machine shared with other test runs: the failing host here
# fails by its tokens, so latency is given room (the playbook's fleetctl_latency_tolerance).
LOADED = ("-e", "fleetctl_latency_tolerance=20")


@pytest.mark.parametrize("series", SERIES)
def test_example_playbook_check_apply_again_and_cli_rollback(series, ansibles, server_lab, cli_check):
    """playbooks/ansible/defrag-tier0.yml, as a new Ansible user runs it, on ansible-core 2.18
    and 2.19: `--check --diff` on every host prints the same unified diffs as `fleetctl apply
    --check --diff`, and only those, and writes nothing (no file, no ledger entry); applied on
    lab-03, its change is committed by the gate; a second run is changed=0; its ledger entry,
    written through Ansible, is read by `fleetctl status` and undone byte-identical by
    `fleetctl rollback`."""
    ansible = ansibles[series]
    files = {h: [f["path"] for f in cli_check[h]["plan"]["files"]] for h in server_lab.hosts}
    before = {h: {p: sha(server_lab, h, p) for p in files[h]} for h in server_lab.hosts}
    ledgers = {h: ledger(server_lab, h) for h in server_lab.hosts}

    r = ansible.run("ansible-playbook", str(EXAMPLE), "--check", "--diff", *LOADED)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    counts = recap(r.stdout)
    assert set(counts) == set(server_lab.hosts), r.stdout[-3000:]
    for host in server_lab.hosts:
        want = [f["diff"] for f in cli_check[host]["plan"]["files"]]
        for d in want:
            assert d in r.stdout  # what --diff prints is fleetctl's diff text
        # changed: the patch task alone (the lock's tasks are changed_when false; the baseline,
        # the restart handler and the gate do not run in check mode)
        assert (counts[host]["changed"], counts[host]["failed"], counts[host]["rescued"]) == (int(bool(want)), 0, 0)
        assert (cli_check[host]["status"] == "changed") == bool(want)
    assert sum(bool(f) for f in files.values()) == 3  # 0.4.6.post5 has no need_sort
    # no other diff: as many files' headers as the CLI planned
    assert sum(line.startswith("--- a/") for line in r.stdout.splitlines()) == sum(map(len, files.values()))
    # nothing written: every file as the CLI's check found it, no ledger entry
    assert before == {h: {f["path"]: f["pre_sha256"] for f in cli_check[h]["plan"]["files"]} for h in server_lab.hosts}
    assert {h: {p: sha(server_lab, h, p) for p in files[h]} for h in server_lab.hosts} == before
    assert {h: ledger(server_lab, h) for h in server_lab.hosts} == ledgers

    host = "lab-03"
    r = ansible.run("ansible-playbook", str(EXAMPLE), "--limit", host, *LOADED)
    assert r.returncode == 0 and recap(r.stdout)[host]["failed"] == 0, r.stdout[-4000:]
    assert {sha(server_lab, host, p) for p in files[host]}.isdisjoint(before[host].values())
    [new] = set(ledger(server_lab, host)) - set(ledgers[host])
    r = ansible.run("ansible-playbook", str(EXAMPLE), "--limit", host, *LOADED)
    assert r.returncode == 0 and recap(r.stdout)[host]["changed"] == 0, r.stdout[-4000:]
    assert set(ledger(server_lab, host)) - set(ledgers[host]) == {new}  # the second run wrote nothing
    _, _, st = server_lab.cli_json("status", host, rc=0)
    [entry] = [c for c in st[host]["changes"] if c["change_id"] == new]
    assert entry["state"] == "applied" and entry["operator"] == f"ansible@{host}"
    server_lab.cli_json("rollback", new, host, "--yes", rc=0)
    assert {p: sha(server_lab, host, p) for p in files[host]} == before[host]


def test_example_playbook_gate_failure_rolls_back_and_stops_the_rollout(ansible, server_lab, cli_check):
    """playbooks/ansible/defrag-tier0.yml: lab-01 (batch 1, 0.4.6.post5: nothing to change) is ok;
    lab-02 (batch 2) fails its gate (the restarted server decodes other tokens), is rolled back
    byte-identical, and max_fail_percentage stops the rollout before lab-03 and lab-04."""
    files = {h: [f["path"] for f in cli_check[h]["plan"]["files"]] for h in server_lab.hosts}
    before = {h: {p: sha(server_lab, h, p) for p in files[h]} for h in server_lab.hosts}
    ledgers = {h: ledger(server_lab, h) for h in server_lab.hosts}
    server_lab.set_behavior("lab-02", {"token_shift": 1}, restart=False)  # the handler's restart reads it
    try:
        r = ansible.run("ansible-playbook", str(EXAMPLE), *LOADED)
    finally:
        server_lab.set_behavior("lab-02", {}, restart=True)
    log = r.stdout[-6000:] + r.stderr[-2000:]
    assert r.returncode == 2, log
    assert "lab-02" in r.stdout and "rolled back: validation failed" in r.stdout, log
    assert "lab-03" not in r.stdout.split("PLAY RECAP")[0] and "lab-04" not in r.stdout.split("PLAY RECAP")[0], log
    assert recap(r.stdout)["lab-02"]["rescued"] == 1, log
    # lab-02: byte-identical, its new ledger entry rolled back; lab-03/04 untouched, no new entry
    for p, digest in before["lab-02"].items():
        assert sha(server_lab, "lab-02", p) == digest
    [new] = set(ledger(server_lab, "lab-02")) - set(ledgers["lab-02"])
    _, _, st = server_lab.cli_json("status", "lab-02")
    assert [c["state"] for c in st["lab-02"]["changes"] if c["change_id"] == new] == ["rolled-back"]
    for h in ("lab-03", "lab-04"):
        assert ledger(server_lab, h) == ledgers[h]
        assert {p: sha(server_lab, h, p) for p in files[h]} == before[h]


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
            route: "{{ route | default(omit) }}"
          register: kernel
      always:
        - ansible.builtin.copy:
            content: "{{ kernel | to_json }}"
            dest: "{{ out }}/{{ inventory_hostname }}-{{ run }}.json"
            mode: "0600"
          delegate_to: localhost
          check_mode: false
        - fleetctl.sglang.lock: {state: released}
"""
KDIR = "/var/lib/fleetctl-kernels/verify_attention"  # published builds, `current`, dispatch.json
PRIVATE = "/var/lib/fleetctl/kernels/verify_attention"  # where builds are made and tested (root's)


def active(lab, host: str) -> str | None:
    r = lab.ssh(host, f"if [ -L {KDIR}/current ]; then readlink {KDIR}/current; fi")
    assert r.returncode == 0, r.stderr
    return r.stdout.strip() or None


def table_text(lab, host: str) -> str | None:
    """KDIR/dispatch.json's text on `host`, None when it is not there."""
    r = lab.ssh(host, f"if [ -f {KDIR}/dispatch.json ]; then cat {KDIR}/dispatch.json; else echo NONE; fi")
    assert r.returncode == 0, r.stderr
    return None if r.stdout == "NONE\n" else r.stdout


def last_entry(lab, host: str) -> dict:
    r = lab.ssh(host, "tail -n 1 /var/lib/fleetctl/ledger.jsonl")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.slow
def test_kernel_plugin_builds_publishes_activates_with_its_table_and_the_cli_sees_it(ansible, server_lab, tmp_path):
    """fleetctl.sglang.kernel on one host, laid out as `fleetctl deploy kernel` lays it out:
    --check builds, publishes and activates nothing; a run builds privately (real torch
    extension build, CPU backend), passes the reference test, publishes the build and activates
    the `current` link and a dispatch table that routes nothing as one ledger change, and
    `fleetctl status` shows both; a second run reuses it (changed: false); `route: all` writes
    only the table (source operator); a bad route fails the task, naming it; `fleetctl
    rollback` puts the table, then the link and the table before, back."""
    host = "lab-02"
    kernels = kernel_variant(tmp_path, "ansible")  # a build key no other test builds
    out = ansible.tmp / "kernel"
    out.mkdir()
    play = ansible.tmp / "kernel.yml"
    play.write_text(KERNEL_PLAY)
    before, table_before = active(server_lab, host), table_text(server_lab, host)

    def run(name: str, *args: str, rc: int = 0) -> dict:
        r = ansible.run("ansible-playbook", str(play), "--limit", host, *args,
                        "-e", f"kernels={kernels} out={out} run={name}", timeout=1200)
        assert r.returncode == rc, r.stdout[-4000:] + r.stderr[-2000:]
        return json.loads((out / f"{host}-{name}.json").read_text())

    chk = run("check", "--check")
    key = chk["build_key"]
    assert chk["changed"] is True and chk["reused"] is False and chk["previous"] == before
    assert "build" not in chk and "change_id" not in chk and "published" not in chk
    assert (chk["table"]["source"], chk["table"]["build"], chk["table"]["all"]) == ("none", key, False)
    r = server_lab.ssh(host, f"for d in {KDIR}/{key} {PRIVATE}/{key}; do test -e $d && echo $d; done; echo end")
    assert r.stdout == "end\n", r.stdout
    assert active(server_lab, host) == before and table_text(server_lab, host) == table_before

    got = run("first")
    assert got["changed"] is True and got["reused"] is False and got["build_key"] == key
    assert got["backend"] == "cpu" and got["build"]["ok"] is True and got["test"]["ok"] is True
    assert got["test"]["failures"] == [] and len(got["test"]["cases"]) > 10
    assert got["published"] == f"{KDIR}/{key}" and active(server_lab, host) == key
    passed = server_lab.ssh(host, f"cat {KDIR}/{key}/PASSED").stdout.strip()
    assert passed.startswith(f"{KDIR}/{key}/build/") and passed.endswith(".so"), passed
    table = json.loads(table_text(server_lab, host))
    assert table == got["table"]
    assert (table["source"], table["build"], table["backend"], table["entries"]) == ("none", key, "cpu", [])
    assert "measured table comes from `fleetctl deploy kernel`" in table["why"]
    entry = last_entry(server_lab, host)
    assert (entry["change_id"], entry["root"]) == (got["change_id"], KDIR)
    assert [f["path"] for f in entry["files"]] == [f"{KDIR}/current", f"{KDIR}/dispatch.json"]
    _, _, st = server_lab.cli_json("status", host, rc=0)
    assert st[host]["kernels"]["verify_attention"] == key and st[host]["dispatch"]["verify_attention"] == table
    [change] = [c for c in st[host]["changes"] if c["change_id"] == got["change_id"]]
    assert (change["state"], change["playbook"], change["operator"]) == \
        ("applied", "kernel verify_attention", f"ansible@{host}")
    status = server_lab.cli("status", host, env={"COLUMNS": "900"}, timeout=300)
    assert f"verify_attention {key[:12]} (cpu): routes nothing (fleetctl.sglang.kernel measures nothing)" \
        in status.stdout, status.stdout

    again = run("second")
    assert again["changed"] is False and again["reused"] is True and "build" not in again
    assert "change_id" not in again and active(server_lab, host) == key and again["table"] == table

    routed = run("route", "-e", "route=all")
    assert routed["changed"] is True and routed["reused"] is True and "build" not in routed
    new = json.loads(table_text(server_lab, host))
    assert new == routed["table"] and (new["source"], new["route"], new["all"], new["build"]) == \
        ("operator", "all", True, key)
    entry = last_entry(server_lab, host)
    assert entry["change_id"] == routed["change_id"] and [f["path"] for f in entry["files"]] == [f"{KDIR}/dispatch.json"]
    status = server_lab.cli("status", host, env={"COLUMNS": "900"}, timeout=300)
    assert f"verify_attention {key[:12]} (cpu): routes all shapes (operator: --route all, {new['made']})" \
        in status.stdout, status.stdout

    bad = run("bad", "--check", "-e", "route=64:2:x:float32", rc=2)
    assert bad["failed"] is True and bad["msg"] == "route: '64:2:x:float32': draft_tokens must be a positive integer, not 'x'"

    server_lab.cli_json("rollback", routed["change_id"], host, "--yes", rc=0)
    assert json.loads(table_text(server_lab, host)) == table and active(server_lab, host) == key
    server_lab.cli_json("rollback", got["change_id"], host, "--yes", rc=0)
    assert active(server_lab, host) == before and table_text(server_lab, host) == table_before


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
