"""SGLang in a container, over real sshd and real rootful Podman (runc) on a lab host: inspect
exact against what the containerised server itself imports, the same answers through `podman
exec` and through nsenter, apply / validate / status / rollback inside (byte-identical), a run
killed inside undone by `recover` on the host, a recreated container reported as change lost,
and a read-only root file system refused."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time

import pytest
import yaml

from conftest import ROOT, SERVER_LAB_ID, Lab, running_lab
from fleetctl.engine import containers
from fleetctl import lab as labmod
from test_fleet_installs import IMPORTED  # the file `import sglang` really runs, asked of the process


# this module's own lab, derived from the session's server lab id (never another session's)
LAB_ID = (SERVER_LAB_ID + 100) % 256
RELEASE = "0.5.10"
INSTALL = f"podman:{labmod.CONTAINER_NAME}:{labmod.CHECKOUT}/python/sglang"
PYTHON = f"{labmod.VENV}/bin/python"


@pytest.fixture(scope="module")
def clab(lab_machine, tmp_path_factory):
    """One lab host (no server of its own) given lab.add_container_host: the stand-in server in
    a rootful Podman container of an image holding the lab's Python and an editable SGLang
    checkout; the image is built once per lab state dir."""
    if not shutil.which("podman"):
        pytest.fail("podman is not installed: run scripts/setup.sh")
    with running_lab(tmp_path_factory.mktemp("home-containers"), LAB_ID, [RELEASE], hosts=1) as up:
        labmod.add_container_host("lab-01", RELEASE, lab_id=LAB_ID, state_dir=up.state_dir)
        # not a latency test: one decode each (--repeat 1), so a generous slack
        up.add_host_vars("lab-01", {"fleetctl_latency_slack": 2.0})
        yield up


def in_container(lab: Lab, code: str, *args: str) -> str:
    """Run Python `code` in a one-off process in the container (its own interpreter, in /, as the
    server was started) through `podman exec` on the lab host; its stdout."""
    r = lab.ssh("lab-01", shlex.join(["podman", "exec", "-w", "/", labmod.CONTAINER_NAME, PYTHON, "-c", code, *args]),
                timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


def podman_field(lab: Lab, fmt: str) -> str:
    r = lab.ssh("lab-01", shlex.join(["podman", "inspect", "--format", fmt, labmod.CONTAINER_NAME]))
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


# {file relative to the package dir: sha256} of every file under it
DIGEST = """
import hashlib, json, os, sys
top = sys.argv[1]
out = {}
for d, _, files in os.walk(top):
    for f in files:
        p = os.path.join(d, f)
        with open(p, "rb") as fh:
            out[os.path.relpath(p, top)] = hashlib.sha256(fh.read()).hexdigest()
print(json.dumps(out))
"""
READ = "import sys; sys.stdout.write(open(sys.argv[1]).read())"


def digest(lab: Lab) -> dict:
    return json.loads(in_container(lab, DIGEST, f"{labmod.CHECKOUT}/python/sglang"))


def recreate(lab: Lab, read_only: bool = False) -> None:
    """Remove the container and run a new one of the same image (what a redeploy does)."""
    labmod.podman_in("lab-01", ["rm", "-f", labmod.CONTAINER_NAME], LAB_ID, lab.state_dir)
    image = f"{labmod.CONTAINER_IMAGE}:{RELEASE}"
    labmod.podman_in("lab-01", labmod.container_run_argv(image, read_only=read_only), LAB_ID, lab.state_dir)


def test_inspect_in_the_container_is_exact_and_nsenter_gives_the_same(clab, tmp_path):
    """The container install's id, root and package directory are what Podman and a one-off
    process in the container (sglang.__file__) say; entered with nsenter instead of `podman
    exec` (fleetctl_container_exec), inspect gives the same installs and call sites, and says
    it used nsenter."""
    r, _, hosts = clab.cli_json("inspect", "lab-01", rc=0)
    h = hosts["lab-01"]
    installs = {i["id"]: i for i in h["installs"]}
    assert INSTALL in installs, sorted(installs)
    inst = installs[INSTALL]
    assert inst["root"] == {
        "runtime": "podman", "container_id": podman_field(clab, "{{.Id}}"), "name": labmod.CONTAINER_NAME,
        "image": podman_field(clab, "{{.ImageName}}"), "image_id": podman_field(clab, "{{.Image}}"),
        "pid": int(podman_field(clab, "{{.State.Pid}}"))}
    imported = in_container(clab, IMPORTED).strip()
    assert inst["sglang"]["package_dir"] == os.path.dirname(imported) == f"{labmod.CHECKOUT}/python/sglang"
    assert (inst["sglang"]["version"], inst["sglang"]["install"]) == (RELEASE, "editable")
    assert inst["python"]["path"] == PYTHON
    assert inst["container"]["how"] == "podman" and inst["container"]["note"] is None
    assert containers.LASTS == inst["container"]["lasts"]
    server = next(s for s in h["facts"]["servers"] if s.get("install") == INSTALL)
    assert (server["pid"], server["port"], server["pid_in_container"]) == (inst["root"]["pid"], 30000, 1)
    assert inst["servers"] == [inst["root"]["pid"]]  # host pids, as podman inspect reports them
    assert inst["allocator_call_sites"] and inst["scan"]["error"] is None

    doc = yaml.safe_load(clab.inventory.read_text())
    doc["all"]["children"]["lab"]["hosts"]["lab-01"]["fleetctl_container_exec"] = "nsenter"
    inv2 = tmp_path / "nsenter.yaml"
    inv2.write_text(yaml.safe_dump(doc, sort_keys=False))
    _, _, hosts2 = clab.cli_json("inspect", "lab-01", "-i", str(inv2), rc=0)
    inst2 = next(i for i in hosts2["lab-01"]["installs"] if i["id"] == INSTALL)
    assert inst2["container"]["how"] == "nsenter" and "nsenter" in inst2["container"]["note"]
    for k in ("root", "python", "sglang", "allocator_call_sites", "need_sort_origins"):
        assert inst2[k] == inst[k], k
    assert inst2["scan"]["files"] == inst["scan"]["files"]


def test_apply_validate_status_rollback_inside_the_container(clab):
    """apply --install on the container install writes inside it (ledger and backups there, the
    host keeps a copy of the record keyed by container and image id), restarts the container,
    passes the smoke gate through the stand-in in it and says the change lasts until the
    container is recreated; validate and status work there; rollback gives the tree back
    byte-identical."""
    before = digest(clab)
    r, doc, hosts = clab.cli_json("apply", "defrag-tier0", "lab-01", "--install", INSTALL, "--yes", "--repeat", "1",
                                  timeout=600, rc=0)
    h = hosts["lab-01"]
    assert (h["status"], h["error"]) == ("changed", None)
    assert h["lasts"] == containers.LASTS and h["root"]["name"] == labmod.CONTAINER_NAME
    assert h["validation"]["status"] == "passed"
    assert [x["command"] for x in h["plan"]["handlers"]] == [f"podman restart {h['root']['container_id']}"]
    cid = doc["change_id"]
    after = digest(clab)
    changed = sorted(k for k in after if after[k] != before.get(k))
    assert changed and all(k.endswith(".py") for k in changed)
    ledger = [json.loads(x) for x in in_container(clab, READ, "/var/lib/fleetctl/ledger.jsonl").splitlines()]
    assert any(e.get("change_id") == cid for e in ledger)
    assert clab.ssh("lab-01", "test -e /var/lib/fleetctl/ledger.jsonl").returncode == 1  # none on the host
    record = clab.ssh("lab-01", "cat " + shlex.quote(containers.record_path("/var/lib/fleetctl", h["root"])))
    assert record.returncode == 0, record.stderr
    rec = json.loads(record.stdout)
    assert (rec["install"], rec["root"]["image_id"]) == (INSTALL, h["root"]["image_id"])
    assert [(c["change_id"], c["state"]) for c in rec["changes"]] == [(cid, "applied")]

    _, _, v = clab.cli_json("validate", "lab-01", "--install", INSTALL, "--repeat", "1", timeout=300, rc=0)
    assert v["lab-01"]["status"] == "ok" and len(v["lab-01"]["servers"]) == 1
    _, _, st = clab.cli_json("status", "lab-01", "--install", INSTALL, rc=0)
    assert [(c["change_id"], c["state"]) for c in st["lab-01"]["changes"]] == [(cid, "applied")]
    assert st["lab-01"]["lasts"] == containers.LASTS

    _, _, rb = clab.cli_json("rollback", cid, "lab-01", "--install", INSTALL, "--yes", timeout=300, rc=0)
    assert rb["lab-01"]["status"] == "changed" and rb["lab-01"]["lasts"] == containers.LASTS
    assert digest(clab) == before


LEDGER_STATES = ("import json, os, sys; p = '/var/lib/fleetctl/ledger.jsonl'; "
                 "sys.stdout.write(json.dumps({e['change_id']: e['state'] for e in map(json.loads, open(p))} "
                 "if os.path.exists(p) else {}))")


def ledger_in_container(lab: Lab) -> dict:
    """{change_id: its last state} of the ledger inside the container ({} before its first change)."""
    return json.loads(in_container(lab, LEDGER_STATES))


def ledger_while_running(lab: Lab) -> dict:
    """ledger_in_container, or {} while the container is not running (a restart handler's)."""
    r = lab.ssh("lab-01", shlex.join(["podman", "exec", "-w", "/", labmod.CONTAINER_NAME, PYTHON, "-c",
                                      LEDGER_STATES]), timeout=60)
    return json.loads(r.stdout) if r.returncode == 0 else {}


def test_a_run_killed_in_the_container_is_undone_by_recover_on_the_host(clab):
    """An apply on the container install SIGKILLed while its change is pending in the
    container's ledger (the server restarted into never being healthy, so the run waits in its
    gate, or is still restarting the container: then the kill leaves it stopped, or stuck
    stopping): `fleetctl recover` on the host, with no --install, finds the container by the
    record the host kept before the change began, restarts it when it is not running, undoes the change inside it (the
    tree byte-identical, the ledger rolled-back, the container restarted) and names the
    install; a second recover finds nothing pending (the soak's container fault, issue 54)."""
    before = digest(clab)
    cid = podman_field(clab, "{{.Id}}")
    behave = "import sys; open('/opt/fleetctl-standin/behavior.json', 'w').write(sys.argv[1])"
    in_container(clab, behave, json.dumps({"never_healthy": True}))  # read when the server starts again
    p = subprocess.Popen([sys.executable, "-m", "fleetctl.cli", "apply", "defrag-tier0", "lab-01", "--install",
                          INSTALL, "--yes", "--repeat", "1", "--health-timeout", "120"], env=clab.env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 180
        while not (pending := [c for c, st in ledger_while_running(clab).items() if st == "pending"]):
            assert time.monotonic() < deadline and p.poll() is None, "the apply never reached pending"
            time.sleep(0.3)
        os.kill(p.pid, signal.SIGKILL)
    finally:
        p.wait()
    stopped = podman_field(clab, "{{.State.Status}}") != "running"

    _, _, hosts = clab.cli_json("recover", "lab-01", "--yes", timeout=300, rc=0)
    h = hosts["lab-01"]
    assert (h["status"], h["error"]) == ("changed", None)
    assert [(c["change_id"], c["state"], c.get("install")) for c in h["recovered"]] == \
        [(pending[0], "rolled-back", INSTALL)]
    # a container the kill left stopped, or stuck stopping, is restarted first; then once more
    # after the change is undone
    assert [(x["name"], x["exit_code"]) for x in h["handlers"]] == [("restart sglang", 0)] * (1 + stopped)
    assert ledger_in_container(clab)[pending[0]] == "rolled-back"
    assert digest(clab) == before
    record = json.loads(clab.ssh("lab-01", "cat " + shlex.quote(containers.record_path(
        "/var/lib/fleetctl", {"container_id": cid, "image_id": podman_field(clab, "{{.Image}}")}))).stdout)
    assert (pending[0], "rolled-back") in [(c["change_id"], c["state"]) for c in record["changes"]]
    assert record["changing"] is False

    _, _, again = clab.cli_json("recover", "lab-01", "--yes", timeout=300, rc=0)
    assert (again["lab-01"]["status"], again["lab-01"]["recovered"]) == ("ok", [])
    assert again["lab-01"]["containers"] == []  # its record is no longer marked changing: nothing to enter
    in_container(clab, behave, "{}")
    labmod.podman_in("lab-01", ["restart", labmod.CONTAINER_NAME], LAB_ID, clab.state_dir)
    deadline = time.monotonic() + 60
    while not clab.server_healthy("lab-01"):
        assert time.monotonic() < deadline, "the container's server did not come back healthy"


def test_a_recreated_container_is_reported_as_change_lost(clab, tmp_path):
    """A change applied in the container, then the container removed and run again from the
    same image: status on the host says the change is lost."""
    book = yaml.safe_load((ROOT / "playbooks" / "defrag-tier0.yaml").read_text())
    book["validate"] = []  # no compile, reinspect or smoke decode: this test is about status
    shutil.copytree(ROOT / "playbooks" / "templates", tmp_path / "templates")
    (tmp_path / "quick.yaml").write_text(yaml.safe_dump(book, sort_keys=False))
    r, doc, hosts = clab.cli_json("apply", str(tmp_path / "quick.yaml"), "lab-01", "--install", INSTALL, "--yes",
                                  timeout=600, rc=0)
    assert hosts["lab-01"]["status"] == "changed", hosts["lab-01"]["error"]
    recreate(clab)
    _, _, st = clab.cli_json("status", "lab-01", rc=2)
    lost = st["lab-01"]["lost"]
    assert [(x["install"], x["changes"], x["problem"]) for x in lost] == [(INSTALL, [doc["change_id"]],
                                                                          containers.CHANGE_LOST)]
    assert containers.CHANGE_LOST in st["lab-01"]["error"]


def test_a_read_only_root_file_system_is_refused(clab):
    """apply on a container whose root file system is read-only is refused with the message
    that sends the operator to --export-patch, and nothing in it changes."""
    recreate(clab, read_only=True)  # its server need not be healthy: the refusal comes before any smoke
    before = digest(clab)
    _, _, hosts = clab.cli_json("apply", "defrag-tier0", "lab-01", "--install", INSTALL, "--yes",
                                timeout=600, rc=2)
    h = hosts["lab-01"]
    assert h["status"] == "failed" and containers.REFUSED in h["error"] and "read-only" in h["error"]
    assert digest(clab) == before
