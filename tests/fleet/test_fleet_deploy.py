"""`fleetctl deploy kernel` on the lab with stand-in servers: real sshd, real torch extension
builds (the CPU backend) on each host, the reference test, activation, validation, rollback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from conftest import become_inventory, host_outcomes, kernel_variant
from fleetctl import lab as labmod
from fleetctl.engine.kernels.dispatch import text as dispatch_text
from fleetctl.engine.kernels.package import load_package
from fleetctl.probes.facts import torchver


KERNELS = Path(__file__).resolve().parents[2] / "kernels"
KDIR = "/var/lib/fleetctl-kernels/verify_attention"  # published builds, `current`, dispatch.json
PRIVATE = "/var/lib/fleetctl/kernels/verify_attention"  # where builds are made and tested


def deploy(lab, pattern, *args, kernels: Path | None = None):
    return lab.cli_json("deploy", "kernel", "verify_attention", pattern, "--yes", "--max-jobs", "2", *args,
                        env={"FLEETCTL_KERNELS_DIR": str(kernels or KERNELS)}, timeout=900)


def table_bytes(lab, host) -> str | None:
    """PUBLIC/verify_attention/dispatch.json's text on `host`, None when it is not there."""
    r = lab.ssh(host, f"if [ -f {KDIR}/dispatch.json ]; then cat {KDIR}/dispatch.json; else echo NONE; fi")
    assert r.returncode == 0, r.stderr
    return None if r.stdout == "NONE\n" else r.stdout


def active(lab, host):
    """The build key `current` points at on `host`, or None when there is no link (an ssh failure
    fails the test rather than reading as "no link")."""
    r = lab.ssh(host, f"if [ -L {KDIR}/current ]; then readlink {KDIR}/current; fi")
    assert r.returncode == 0, r.stderr
    return r.stdout.strip() or None


# The build's process tree: the torch.utils.cpp_extension child (its -c source names the module),
# ninja, the compiler driver and cc1plus.
BUILD_PROGRAMS = {"ninja", "cc1plus", "c++", "g++", "gcc", "cc", "as", "ld"}


def build_pids(lab, host) -> dict[int, str]:
    """{pid: command line} of the build processes on lab host `host`, found from the control side:
    only pids of that host (lab.pids, as this namespace numbers them), matched on /proc/PID/cmdline."""
    out = {}
    for pid in lab.pids(host):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:  # exited meanwhile
            continue
        cmd = b" ".join(argv).decode(errors="replace")
        if os.path.basename(argv[0].decode(errors="replace")) in BUILD_PROGRAMS or "torch.utils.cpp_extension" in cmd:
            out[pid] = cmd
    return out


def start_time(pid: int) -> str | None:
    """Field 22 of /proc/PID/stat (the start time, in clock ticks since boot; read past the comm
    field's last ")"), or None when no such process runs: with the pid, it names one process
    (a pid reused later has another start time)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def build_probe(lab, host) -> list[tuple[int, str]]:
    """[(pid, start time)] of the build's own Python child on `host` (the process that runs
    torch.utils.cpp_extension: probes/kernel/build.py runas.spawn) and of its probe (its parent,
    /proc/PID/status's PPid)."""
    pids = build_pids(lab, host)
    for pid, cmd in pids.items():
        if "torch.utils.cpp_extension" in cmd:
            try:
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue
            ppid = int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))
            found = [(pid, start_time(pid)), (ppid, start_time(ppid))]
            if ppid not in pids and all(t is not None for _, t in found):
                return found
    raise AssertionError(f"no build probe found on {host}: {pids}")


def kill_build(lab, host, timeout: float = 20) -> dict[int, str]:
    """SIGKILL every build process on `host` (new ones too, until none is left) and return what
    was killed; fails the test if any is still there after `timeout` s."""
    killed, deadline = {}, time.monotonic() + timeout
    while True:
        left = build_pids(lab, host)
        if not left:
            return killed
        assert time.monotonic() < deadline, f"build processes still alive on {host}: {left}"
        for pid, cmd in left.items():
            try:
                os.kill(pid, signal.SIGKILL)
                killed[pid] = cmd
            except ProcessLookupError:
                pass
        time.sleep(0.2)


@pytest.fixture(scope="module")
def deployed(server_lab):
    """The package deployed once to every host (four real builds)."""
    r, doc, hosts = deploy(server_lab, "all")
    assert r.returncode == 0, ({h: (v["status"], v.get("error")) for h, v in hosts.items()}, r.stderr[-3000:])
    return doc, hosts


def test_deploy_builds_tests_and_activates_everywhere(server_lab, deployed):
    doc, hosts = deployed
    keys = set()
    for name in server_lab.hosts:
        h = hosts[name]
        assert h["status"] == "changed" and h["backend"] == "cpu" and h["arch"] is None
        assert h["reused"] is False and h["build"]["ok"] is True
        assert h["test"]["ok"] is True
        assert h["validation"]["status"] == "passed"
        assert active(server_lab, name) == h["build_key"]
        keys.add(h["build_key"])
    assert len(keys) == 1  # same package, same torch, no GPU: one key
    # the activated kernel itself, on the host (review L6: the stand-in server never loads it):
    # the module `current` names imports and passes the package's own reference test there
    pkg = load_package(KERNELS, "verify_attention")
    tol = json.dumps({k: list(v) for k, v in pkg.tolerances.items()})
    r = server_lab.ssh("lab-02", f"cd {KDIR}/current/src && /opt/sglang/venv/bin/python {pkg.test} "
                       f"--module \"$(cat ../PASSED)\" --device cpu --reference {pkg.reference} "
                       f"--tolerances '{tol}' --seed 1", timeout=600)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-2000:])
    result = json.loads(r.stdout.splitlines()[-1])
    assert result["ok"] and result["seed"] == 1 and result["failures"] == [] and len(result["cases"]) > 10
    r = server_lab.ssh("lab-01", "tail -n 1 /var/lib/fleetctl/ledger.jsonl")
    entry = json.loads(r.stdout)
    assert (entry["change_id"], entry["state"]) == (doc["change_id"], "applied")
    key = keys.pop()
    assert entry["root"] == KDIR and [f["path"] for f in entry["files"]] == [f"{KDIR}/current", f"{KDIR}/dispatch.json"]
    assert entry["files"][0]["after_sha256"] == "link:" + key
    # no --route on a host without a GPU: the table routes nothing, and says so
    table = json.loads(table_bytes(server_lab, "lab-01"))
    assert table == hosts["lab-01"]["table"]
    assert (table["source"], table["all"], table["entries"], table["build"], table["backend"]) == ("none", False, [], key,
                                                                                                  "cpu")
    assert table["why"].startswith("no GPU to measure on")
    assert hosts["lab-01"]["published"] == f"{KDIR}/{key}"
    # the published copy: root's, 0755 dirs, no group/other write, PASSED names the published module
    r = server_lab.ssh("lab-01", f"find {KDIR}/{key} {KDIR}/dispatch.json -printf '%u:%g %m %y %p\\n'")
    rows = [line.split(" ", 3) for line in r.stdout.splitlines()]
    assert rows and all(o == "root:root" and y in "fd" and (m == "755" if y == "d" else m in ("644", "755"))
                        for o, m, y, _ in rows), r.stdout
    passed = server_lab.ssh("lab-01", f"cat {KDIR}/{key}/PASSED").stdout.strip()
    assert passed.startswith(f"{KDIR}/{key}/build/") and passed.endswith(".so"), passed
    assert server_lab.ssh("lab-01", "stat -c '%U %a' /var/lib/fleetctl-kernels/route-evidence").stdout.split() == [
        "root", "755"]  # review R4-5: no other user makes an entry in it


def test_second_deploy_reuses_the_build(server_lab, deployed):
    t0 = time.monotonic()
    r, doc, hosts = deploy(server_lab, "all")
    assert r.returncode == 0
    assert all(hosts[h]["status"] == "ok" and hosts[h]["reused"] for h in server_lab.hosts)
    assert all("build" not in hosts[h] for h in server_lab.hosts)
    assert time.monotonic() - t0 < 60


def test_failing_reference_test_is_not_activated(server_lab, deployed, tmp_path):
    def break_reference(d):
        ref = d / "reference.py"
        ref.write_text(ref.read_text() + "\n_orig = verify_attention_ref\n"
                       "def verify_attention_ref(*a, **k):\n    return _orig(*a, **k) * 1.01\n")

    before = active(server_lab, "lab-01")
    assert before is not None  # deployed: a vacuous None == None must not pass
    r, doc, hosts = deploy(server_lab, "lab-01", kernels=kernel_variant(tmp_path, "broken", break_reference))
    assert r.returncode == 2
    h = hosts["lab-01"]
    assert h["status"] == "failed" and "reference test failed, not activated" in h["error"]
    assert active(server_lab, "lab-01") == before


# the lab hosts' torch is this machine's (the venvs see its site-packages)
NO_DEVICE = ("preflight refused the triton backend (--backend triton (the operator's choice)): no GPU answers "
             "nvidia-smi: the triton backend compiles for the host's GPU arch and its reference test runs on the "
             f"device; torch {torchver.importable()['version']} is a CPU build (torch.version.cuda is None): no "
             "device for the triton backend's reference test")


def test_triton_backend_without_a_gpu_is_refused_and_current_stays(server_lab, deployed):
    """`--backend triton` on a lab host (no GPU; its /opt/sglang/venv imports this machine's
    triton through --system-site-packages, so only the device is missing): refused at preflight
    for want of a device, in check mode and in a deploy, nothing uploaded, built or activated.
    Check mode without --backend says which backend and why, in JSON and in its table."""
    before = active(server_lab, "lab-01")
    assert before is not None
    builds = server_lab.ssh("lab-01", f"ls {KDIR}").stdout
    r, doc, hosts = deploy(server_lab, "lab-01", "--check")
    h = hosts["lab-01"]
    # ok: the key is the active one (changed only where the package was edited since `deployed`)
    assert (h["status"], h["backend"], h["why"]) == ("ok" if h["build_key"] == before else "changed", "cpu",
                                                     "no GPU answers nvidia-smi")
    table = server_lab.cli("deploy", "kernel", "verify_attention", "lab-01", "--check",
                           env={"FLEETCTL_KERNELS_DIR": str(KERNELS), "COLUMNS": "250"}, timeout=300)
    assert table.returncode == 0 and "no GPU answers nvidia-smi" in table.stdout, table.stdout
    for extra in (["--check"], []):
        r, doc, hosts = deploy(server_lab, "lab-01", "--backend", "triton", *extra)
        assert r.returncode == 2 and hosts["lab-01"]["status"] == "failed", extra
        assert hosts["lab-01"]["error"] == NO_DEVICE, extra
    assert active(server_lab, "lab-01") == before
    assert server_lab.ssh("lab-01", f"ls {KDIR}").stdout == builds


def test_failing_validation_switches_back(server_lab, deployed, tmp_path):
    before = active(server_lab, "lab-02")
    assert before is not None
    # validation failure is simulated: the stand-in server never loads the kernel, so its greedy
    # tokens are shifted by hand (the kernel itself is checked on the host in the test above)
    server_lab.set_behavior("lab-02", {"token_shift": 3}, restart=False)
    try:
        r, doc, hosts = deploy(server_lab, "lab-02", kernels=kernel_variant(tmp_path, "drift"))
    finally:
        server_lab.set_behavior("lab-02", {}, restart=True)
    assert r.returncode == 2
    h = hosts["lab-02"]
    assert h["status"] == "failed" and h["error"].startswith(f"switched back to {before}")
    assert h["validation"]["status"] == "failed"
    assert active(server_lab, "lab-02") == before


def cold(d: Path) -> None:
    """Make the variant's source one no compiler cache has seen (ccache, which torch puts before
    the compiler, with kbuild's CCACHE_BASEDIR: probes/kernel/build.py _cache_base): a definition, not
    a comment, so the preprocessed text differs too, and its build really compiles."""
    cpp = d / "csrc" / "verify_attention_cpu.cpp"
    cpp.write_text(cpp.read_text() + f'\n[[maybe_unused]] static const char fleetctl_cold_build[] = "{uuid.uuid4()}";\n')


WORK = "/tmp/fleetctl-child-*"  # a build's private directory on the host (probes/runas.py private_dir)


def test_killed_build_leaves_no_lock_that_blocks_the_next(server_lab, deployed, tmp_path):
    """A deploy killed mid-build (its probe too, so its private directory is left, torch's lock in
    it): the next deploy builds in a fresh private directory, as nobody, and nothing blocks it."""
    kernels = kernel_variant(tmp_path, "killed", cold)
    env = dict(server_lab.env, FLEETCTL_KERNELS_DIR=str(kernels))
    p = subprocess.Popen([sys.executable, "-m", "fleetctl.cli", "deploy", "kernel", "verify_attention", "lab-03",
                          "--yes", "--max-jobs", "1"], env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while server_lab.ssh("lab-03", f"ls {WORK}/build/lock 2>/dev/null").stdout.strip() == "":
            assert time.monotonic() < deadline and p.poll() is None, "the build never started"
            time.sleep(0.5)
        procs = build_probe(server_lab, "lab-03")
        os.kill(p.pid, signal.SIGKILL)
        # the host lock's holder ends the dead run's commands (connection/command.py _HOLD): the
        # probe dies of SIGTERM with its private directory left, and its child, torch's lock in
        # that directory held, with it (runas PR_SET_PDEATHSIG). Only then is the rest killed:
        # killed first, the child's end would let the probe remove the directory itself.
        deadline = time.monotonic() + 60
        while any(start_time(pid) == t for pid, t in procs):
            assert time.monotonic() < deadline, f"the build's child or probe outlived its run: {procs}"
            time.sleep(0.2)
        # what the child started (ninja, the compiler) is left running: it dies too (as when a
        # host's build is killed), only lab-03's processes, found from the control side (review
        # M5: never `pkill -f` by name)
        killed = kill_build(server_lab, "lab-03")
    finally:
        p.kill()
        p.wait()
    assert all(os.path.basename(cmd.split()[0]) in BUILD_PROGRAMS for cmd in killed.values()), killed
    assert build_pids(server_lab, "lab-03") == {}
    lock = server_lab.ssh("lab-03", f"stat -c %U {WORK}/build/lock")
    assert lock.returncode == 0 and "nobody" in lock.stdout, lock.stderr  # torch's lock is left, nobody's
    table_before = table_bytes(server_lab, "lab-03")
    assert table_before is not None
    r, doc, hosts = deploy(server_lab, "lab-03", kernels=kernels)
    h = hosts["lab-03"]
    assert h["status"] == "changed", h["error"]
    assert h["build"]["ran_as"] == {"uid": 65534, "why": "the unprivileged account nobody"}
    assert json.loads(table_bytes(server_lab, "lab-03"))["build"] == h["build_key"] != h["previous"]
    r = subprocess.run([sys.executable, "-m", "fleetctl.cli", "rollback", doc["change_id"], "lab-03", "--yes"],
                       env=server_lab.env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout
    # the link and the table are one change: both back, the table byte for byte
    assert active(server_lab, "lab-03") == hosts["lab-03"]["previous"]
    assert table_bytes(server_lab, "lab-03") == table_before


def test_route_all_writes_the_table_status_shows_it_and_rollback_restores_it(server_lab, deployed):
    """`--route all` on the key already active (the `deployed` fixture's, whose table routes
    nothing on this GPU-less host): check mode shows the table it would write and changes
    nothing; the deploy writes only dispatch.json (the link stays: one file in the ledger
    entry); `fleetctl status` shows the routed shapes and where the table came from; a rollback
    puts the table back byte for byte; another --route on the same key changes only the table."""
    host = "lab-04"
    key, before = active(server_lab, host), table_bytes(server_lab, host)
    assert key is not None and json.loads(before)["source"] == "none"
    r, doc, hosts = deploy(server_lab, host, "--check", "--route", "64:2:4:float32:8", "--route", "128:4:4:bfloat16")
    h = hosts[host]
    assert r.returncode == 0 and h["status"] == "changed" and h["check"] is True
    assert [(e["head_dim"], e["group"], e["draft_tokens"], e["dtype"], e["max_batch"]) for e in h["table"]["entries"]] \
        == [(64, 2, 4, "float32", 8), (128, 4, 4, "bfloat16", None)]
    assert table_bytes(server_lab, host) == before and active(server_lab, host) == key

    r, doc, hosts = deploy(server_lab, host, "--route", "all")
    h = hosts[host]
    assert r.returncode == 0 and h["status"] == "changed", host_outcomes(hosts)
    assert h["reused"] is True and "build" not in h and active(server_lab, host) == key
    table = json.loads(table_bytes(server_lab, host))
    assert table == h["table"]
    assert (table["source"], table["route"], table["all"], table["build"]) == ("operator", "all", True, key)
    entry = json.loads(server_lab.ssh(host, "tail -n 1 /var/lib/fleetctl/ledger.jsonl").stdout)
    assert entry["change_id"] == doc["change_id"] and [f["path"] for f in entry["files"]] == [f"{KDIR}/dispatch.json"]
    # status: exit 0 (the fixture's change, whose table this one replaced, is no drift), the routed shapes
    status = server_lab.cli("status", host, env={"COLUMNS": "900"}, timeout=300)
    assert status.returncode == 0, status.stdout
    assert f"verify_attention {key[:12]} (cpu): routes all shapes (operator: --route all, {table['made']})" \
        in status.stdout, status.stdout
    _, _, st = server_lab.cli_json("status", host)
    assert st[host]["dispatch"]["verify_attention"] == table and st[host]["kernels"]["verify_attention"] == key
    # the same --route again: nothing to do
    r, _, hosts = deploy(server_lab, host, "--route", "all")
    assert r.returncode == 0 and hosts[host]["status"] == "ok" and table_bytes(server_lab, host) == dispatch_text(table)

    server_lab.cli_json("rollback", doc["change_id"], host, "--yes", rc=0)
    assert table_bytes(server_lab, host) == before and active(server_lab, host) == key

    r, doc, hosts = deploy(server_lab, host, "--route", "64:2:4:float32")
    assert r.returncode == 0 and hosts[host]["status"] == "changed"
    assert json.loads(table_bytes(server_lab, host))["entries"][0]["max_batch"] is None
    status = server_lab.cli("status", host, env={"COLUMNS": "900"}, timeout=300)
    assert "routes 64:2:4:float32 any batch (operator: --route 64:2:4:float32," in status.stdout, status.stdout
    server_lab.cli_json("rollback", doc["change_id"], host, "--yes", rc=0)
    assert table_bytes(server_lab, host) == before


def test_rollback_and_deploy_as_a_sudo_user_reuse_the_build_like_root(server_lab, deployed, tmp_path):
    """Become (issue 16) for deploy kernel: rollback and deploy as the lab's sudo login (NOPASSWD
    on lab-03, the password on lab-04), through both connections. The deploy reuses the build the
    `deployed` fixture made (no compile here): its gather, preflight, state probes, the link swap
    through the change engine, the restart and the smoke gate all run under sudo, and give what
    root's deploy gave: the same build key active, changed, validation passed."""
    users = labmod.become_users(server_lab.lab_id)
    pw = labmod.become_password(server_lab.lab_id, server_lab.state_dir)
    hosts_ = ("lab-03", "lab-04")
    inv = become_inventory(server_lab, tmp_path / "become.yaml",
                           # latency is not what this test is about: a restart on a loaded machine is slow
                           **{h: {"ansible_user": users["sudo"], "ansible_become_password": pw,
                                  "fleetctl_latency_slack": 1.0} for h in hosts_})
    doc, root = deployed
    cid = doc["change_id"]
    for kind in ("paramiko", "ssh"):
        r, _, hosts = server_lab.cli_json("rollback", cid, "all", "--yes", "-i", inv, "-c", kind, rc=0)
        assert {h: (hosts[h]["status"], active(server_lab, h)) for h in hosts_} == {h: ("changed", None)
                                                                                  for h in hosts_}, kind
        r, d, hosts = deploy(server_lab, "all", "-i", inv, "-c", kind)
        assert r.returncode == 0, (kind, host_outcomes(hosts))
        for h in hosts_:
            e = hosts[h]
            assert (e["status"], e["reused"], e["build_key"], e["validation"]["status"]) == (
                "changed", True, root[h]["build_key"], "passed"), (kind, h, e)
            assert "build" not in e and active(server_lab, h) == root[h]["build_key"]
            ledger = server_lab.ssh(h, "tail -n 1 /var/lib/fleetctl/ledger.jsonl").stdout
            assert (json.loads(ledger)["change_id"], json.loads(ledger)["state"]) == (d["change_id"], "applied")
            owner = server_lab.ssh(h, f"stat -c %U {KDIR}/current").stdout.strip()
            assert owner == "root", (h, owner)  # written by root through sudo, not by the login
        assert pw not in r.stdout + r.stderr
        cid = d["change_id"]
