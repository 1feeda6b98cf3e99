"""SGLang installed where its docs and tools put it, over real sshd on lab hosts (issue 31, cases
12 and 09; issue 30's container-only host):

- a local user's `uv tool install`, `pipx install` and `uv venv` + `uv pip install` project venvs,
  built by that user with the real uv and pipx, one of them running a server: as root each is an
  install asked as an unprivileged uid (the server's, the owner's: issue 48); through become as
  that user each is one install, with the same id;
- a hardened systemd unit (PrivateTmp=, ProtectSystem=strict: a mount namespace of its own, the
  unit's cgroup /system.slice/NAME.service, its unit file): a host install, changed by default
  apply and rolled back, never called a container;
- a host whose only SGLang is in a Podman container: apply names that install, what --install
  would do and how long it lasts, and the --export-patch it points to works.

What cannot exist here is named as a stand-in: the SGLang server (a process of SGLang's
router launcher that only waits, or the lab's stand-in server), systemd (not PID 1 on this
machine: its sandbox is made as systemd makes it, with unshare and the unit's cgroup), and the
dependencies of the SGLang wheel (the real 0.5.10 wheel repacked without its Requires-Dist, which
uv and pipx would otherwise resolve from an index)."""

from __future__ import annotations

import base64
import hashlib
import secrets
import shlex
import shutil
import zipfile
from pathlib import Path

import pytest
import yaml

from conftest import SERVER_LAB_ID, become_inventory, running_lab
from fleetctl import lab as labmod
from fleetctl.lab import base as labbase
from fleetctl.wheels import cache_dir, ensure_wheel

HOST = "lab-03"  # the session lab's SGLang 0.5.10 host, where the lab's sudo login sudoes without a password
TOOLS = cache_dir() / "venvs" / "install-tools"  # scripts/setup.sh: uv, pipx and the pip wheel pipx wants
RELEASE = "0.5.10"  # the lab's pure-Python release with the `sglang` console script uv and pipx install
ROUTER = "import time\ntime.sleep(600)\n"  # the stand-in server: SGLang's router launcher, waiting
PORT = 39131


def sh(lab, host: str, cmd: str, timeout: float = 120) -> str:
    r = lab.ssh(host, cmd, timeout=timeout)
    assert r.returncode == 0, (cmd, r.stdout, r.stderr)
    return r.stdout


def repack_without_requirements(wheel: Path, out: Path) -> Path:
    """The wheel `wheel` rewritten into directory `out` with no Requires-Dist (its RECORD's hash of
    METADATA made right): SGLang's own files, none of the dependencies an index would give."""
    dst = out / wheel.name
    with zipfile.ZipFile(wheel) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
        meta = next(n for n in zin.namelist() if n.endswith(".dist-info/METADATA"))
        text = b"".join(line for line in zin.read(meta).splitlines(True) if not line.startswith(b"Requires-Dist:"))
        digest = base64.urlsafe_b64encode(hashlib.sha256(text).digest()).rstrip(b"=").decode()
        for info in zin.infolist():
            data = text if info.filename == meta else zin.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                data = "".join(f"{meta},sha256={digest},{len(text)}\n" if line.startswith(meta + ",") else line + "\n"
                               for line in data.decode().splitlines()).encode()
            zout.writestr(info, data)
    return dst


def site(venv: str) -> str:
    return f"{venv}/lib/python3.11/site-packages/sglang"


@pytest.fixture(scope="module")
def homes(lab):
    """HOST given a /home of its own (a tmpfs in its mount namespace: no other host's or lab's
    homes change) where the lab's become user U (no sudo rights) lays out, as U, with the real
    uv and pipx: a uv tool, a pipx venv, an idle uv project venv, and a uv project venv whose
    stand-in server runs as U from the project directory. Returns {user, uid, pid, venvs}."""
    if not (TOOLS / ".fleetctl-ready").exists():
        pytest.fail(f"{TOOLS} is missing: run scripts/setup.sh")
    users = labmod.become_users(lab.lab_id)
    user = users["nosudo"]
    hd = labbase.host_dir(lab.state_dir, HOST) / labbase.PRIVATE_DIRS["/tmp"]
    tools = hd / f"fc-tools-{secrets.token_hex(3)}"
    shutil.copytree(TOOLS, tools, symlinks=True)
    repack_without_requirements(ensure_wheel(RELEASE), tools / "wheels")
    t = f"/tmp/{tools.name}"
    sh(lab, HOST, f"chmod -R a+rX {t} && mount -t tmpfs -o mode=755 tmpfs /home && "
                  + " && ".join(f"mkdir -m 755 /home/{u} && chown {u}: /home/{u}" for u in users.values()))
    uid = int(sh(lab, HOST, f"id -u {user}"))
    home = f"/home/{user}"
    offline = f"--offline --no-index --find-links {t}/wheels"
    steps = [
        f"{t}/bin/uv tool install {offline} --python /usr/bin/python3.11 sglang",
        f"PYTHONPATH={t} PIP_NO_INDEX=1 PIP_FIND_LINKS={t}/wheels /usr/bin/python3.11 -m pipx install "
        "--python /usr/bin/python3.11 sglang",
        *(f"mkdir -p {home}/{p} && cd {home}/{p} && {t}/bin/uv venv --offline --python /usr/bin/python3.11 .venv && "
          f"{t}/bin/uv pip install {offline} --python .venv/bin/python sglang" for p in ("llm-serving", "llm")),
        f"mkdir {home}/llm/sglang_router && : > {home}/llm/sglang_router/__init__.py && "
        f"printf %s {shlex.quote(ROUTER)} > {home}/llm/sglang_router/launch_server.py",
        f"cd {home}/llm && setsid .venv/bin/python -m sglang_router.launch_server --port {PORT} "
        "</dev/null >/dev/null 2>&1 &",
    ]
    as_user = f"setpriv --reuid={uid} --regid={uid} --clear-groups env -i HOME={home} PATH=/usr/bin:/bin sh -ec"
    try:
        for step in steps:
            sh(lab, HOST, f"{as_user} {shlex.quote(step)}", timeout=300)
        pid = int(sh(lab, HOST, f"sleep 0.5; pgrep -u {uid} -f -n 'sglang_router.launch_server --port {PORT}'"))
        yield {"user": user, "uid": uid, "pid": pid, "sudo": users["sudo"],
               "venvs": {"uv tool": f"{home}/.local/share/uv/tools/sglang", "pipx": f"{home}/.local/share/pipx/venvs/sglang",
                         "project": f"{home}/llm-serving/.venv", "server": f"{home}/llm/.venv"}}
    finally:
        lab.ssh(HOST, f"pkill -9 -u {uid}; sleep 0.3; umount -l /home")
        shutil.rmtree(tools, ignore_errors=True)


def test_as_root_each_users_layout_is_inspected_as_its_owner(lab, homes):
    """Case 12 as root (issue 48): every tree the user's uv, pipx and project venvs hold is an
    install (one id each, the id the same tree has through become), asked as an unprivileged uid
    (runas): the server's as the server's own uid, the others as their owner; the server's install
    is the host's primary, as through become."""
    user, uid, pid, venvs = homes["user"], homes["uid"], homes["pid"], homes["venvs"]
    _, _, hosts = lab.cli_json("inspect", HOST, rc=0)
    h = hosts[HOST]
    assert h["not_inspected"] == []
    installs = {i["id"]: i for i in h["installs"]}
    assert set(installs) == {f"host:{site(v)}" for v in [*venvs.values(), labbase.VENV]}, sorted(installs)
    for name, venv in venvs.items():
        inst = installs[f"host:{site(venv)}"]
        assert inst["asked_as"]["uid"] == uid, (name, inst["asked_as"])
        assert (inst["sglang"]["version"], inst["sglang"]["install"]) == (RELEASE, "wheel")
    assert installs[f"host:{site(venvs['server'])}"]["asked_as"]["why"] == f"the effective uid of server pid {pid}"
    assert installs[f"host:{site(venvs['uv tool'])}"]["asked_as"]["why"].startswith("the owner of /home/")
    assert installs[f"host:{site(labbase.VENV)}"]["asked_as"] == {"uid": 65534, "why": "the unprivileged account nobody"}
    assert installs[f"host:{site(venvs['server'])}"]["servers"] == [pid]
    assert h["facts"]["sglang"]["package_dir"] == site(venvs["server"])  # the primary: the server's



def test_through_become_as_that_user_each_tree_is_one_install_with_the_same_id(lab, homes, tmp_path):
    """The same host through sudo as the venvs' owner (ansible_become_user): each tree is one
    install whose id is the one root saw, its package directory what the venv's own interpreter
    finds; the server runs from its project venv, the host's primary install."""
    user, pid, venvs = homes["user"], homes["pid"], homes["venvs"]
    inv = become_inventory(lab, tmp_path / "become.yaml",
                           **{HOST: {"ansible_user": homes["sudo"], "ansible_become_user": user}})
    _, _, hosts = lab.cli_json("inspect", HOST, "-i", inv, rc=0)
    h = hosts[HOST]
    assert h["not_inspected"] == []
    installs = {i["id"]: i for i in h["installs"]}
    found = sh(lab, HOST, "; ".join(
        f"{v}/bin/python -I -c 'import importlib.util; print(importlib.util.find_spec(\"sglang\").origin)'"
        for v in venvs.values()))
    for venv, origin in zip(venvs.values(), found.split()):
        inst = installs[f"host:{site(venv)}"]
        assert inst["sglang"]["package_dir"] == origin.rsplit("/", 1)[0] == site(venv)
        assert (inst["sglang"]["version"], inst["sglang"]["install"]) == (RELEASE, "wheel")
    assert {f"host:{site(v)}" for v in venvs.values()} <= set(installs) <= {
        f"host:{site(v)}" for v in [*venvs.values(), labbase.VENV]}
    assert installs[f"host:{site(venvs['server'])}"]["servers"] == [pid]
    assert h["facts"]["sglang"]["package_dir"] == site(venvs["server"])  # the primary: the server's


# --- case 09: a hardened systemd unit ------------------------------------------------------------

SERVICE_HOST = "lab-02"  # the server lab's SGLang 0.5.2 host, its stand-in server on 127.0.0.1:30000
STANDIN = "/opt/fleetctl-standin"
# what systemd does for PrivateTmp=yes and ProtectSystem=strict (systemd.exec(5)), for the command
# given: the unit's cgroup first, then a mount namespace of its own (propagation slave), a tmpfs /tmp,
# / and every mount under it read-only but /dev, /proc and /sys
SANDBOX = """#!/bin/sh
echo $$ > {cgroup}/cgroup.procs || exit 1
exec unshare --mount --propagation slave -- sh -c '
  mount -t tmpfs tmpfs /tmp &&
  for m in $(awk '"'"'{{print $5}}'"'"' /proc/self/mountinfo | sort -u); do
    case $m in /dev|/dev/*|/proc|/proc/*|/sys|/sys/*|/tmp) ;; *) mount -o remount,bind,ro "$m" 2>/dev/null ;; esac
  done
  exec "$@"' sh "$@"
"""
UNIT = """[Unit]
Description=SGLang (fleetctl lab stand-in server)

[Service]
ExecStart=/opt/sglang/venv/bin/python /opt/fleetctl-standin/server.py --host 127.0.0.1 --port 30000 \\
    --model-path fleetctl-standin/tiny --tp-size 1 --behavior /opt/fleetctl-standin/behavior.json
WorkingDirectory=/opt/fleetctl-standin
PrivateTmp=yes
ProtectSystem=strict
"""

IDLE_UNIT = """[Service]
ExecStart=/opt/sglang/venv/bin/python -m sglang.launch_server --port 30010
WorkingDirectory=/opt/sglang
User=root
"""


def test_a_hardened_systemd_unit_is_a_host_install_changed_by_default_and_never_a_container(server_lab, tmp_path):
    """Case 09: the stand-in server started as a unit with PrivateTmp=yes and ProtectSystem=strict
    runs (its mount namespace its own, its / read-only) in the cgroup of NAME.service, whose
    unit file is in /etc/systemd/system. inspect: one host install with the server under it
    (the unit named), no container; `apply defrag-tier0` changes it by default (the host writes
    the tree the service sees read-only) and restarts it the same way; rollback restores it."""
    lab, host = server_lab, SERVICE_HOST
    name = f"fc-sglang-{secrets.token_hex(3)}.service"
    idle = f"fc-sglang-idle-{secrets.token_hex(3)}.service"  # a unit file of a service that is not running
    cgroup = f"/sys/fs/cgroup/unified/system.slice/{name}"
    restart = f"LAUNCHER={STANDIN}/hardened.sh {STANDIN}/restart.sh"
    sh(lab, host, f"mkdir {cgroup} && printf %s {shlex.quote(SANDBOX.format(cgroup=cgroup))} > {STANDIN}/hardened.sh && "
                  f"chmod 755 {STANDIN}/hardened.sh && mount -t tmpfs -o mode=755 tmpfs /etc/systemd/system && "
                  f"printf %s {shlex.quote(UNIT)} > /etc/systemd/system/{name} && "
                  f"printf %s {shlex.quote(IDLE_UNIT)} > /etc/systemd/system/{idle} && {restart}")
    inv = yaml.safe_load(lab.inventory.read_text())
    inv["all"]["children"]["lab"]["hosts"][host]["fleetctl_restart_cmd"] = restart
    path = tmp_path / "hosts.yaml"
    path.write_text(yaml.safe_dump(inv))
    iid = f"host:{site(labbase.VENV)}"
    try:
        assert lab.server_healthy(host, timeout=120)
        pid = int(sh(lab, host, f"cat {STANDIN}/server.pid"))
        view = sh(lab, host, f"readlink /proc/self/ns/mnt /proc/{pid}/ns/mnt; cat /proc/{pid}/cgroup; "
                             f"awk '$5 == \"/\" {{print $6}}' /proc/{pid}/mountinfo")
        mine, its, *rest = view.split()
        assert mine != its and f"0::/system.slice/{name}" in rest and rest[-1].startswith("ro"), view

        _, _, hosts = lab.cli_json("inspect", host, "-i", str(path), rc=0)
        h = hosts[host]
        server = next(s for s in h["facts"]["servers"] if s["pid"] == pid)
        assert (server["unit"], server["install"], server["python"]) == (name, iid, f"{labbase.VENV}/bin/python")
        assert [(i["id"], i["servers"]) for i in h["installs"] if i["sglang"]["package_dir"] == site(labbase.VENV)] == [
            (iid, [pid])]
        assert h["not_inspected"] == [] and not [c for c in h["facts"]["containers"] if c["root"]["pid"] == pid]
        # the idle unit's interpreter, asked with its working directory first: the same tree, one install
        considered = {c["reason"]: c for c in h["facts"]["interpreter_discovery"]["considered"]}
        assert considered[f"systemd unit {idle}"]["sglang"] == next(s["release"] for s in lab.status if s["name"] == host)
        assert h["facts"]["sglang"]["package_dir"] == site(labbase.VENV)

        r, _, hosts = lab.cli_json("apply", "defrag-tier0", host, "-i", str(path), "--yes", rc=0)
        h = hosts[host]
        assert (h["status"], [c["install"] for c in h["changes"]], h["validation"]["status"]) == (
            "changed", [iid], "passed"), h
        assert "container" not in r.stdout + r.stderr and "recreated" not in r.stdout + r.stderr
        edited = sorted({f["path"] for f in h["plan"]["files"]})
        new_pid = int(sh(lab, host, f"cat {STANDIN}/server.pid"))
        assert new_pid != pid  # restarted, in the same sandbox: it sees the change, read-only
        inside = lab.ssh(host, f"nsenter -t {new_pid} -m sh -c "
                               f"{shlex.quote(f'grep -c fleetctl {edited[0]} && touch {edited[0]}')}")
        assert inside.stdout.split()[0] != "0" and "Read-only file system" in inside.stderr, inside
        # rolled back with the lab's own inventory: its restart handler starts the server as before
        lab.cli_json("rollback", "--last", host, "--yes", rc=0)
        assert sh(lab, host, f"grep -c 'fleetctl defrag-tier0:' {edited[0]} || true").strip() == "0"
    finally:
        lab.ssh(host, f"grep -q {name} /proc/$(cat {STANDIN}/server.pid)/cgroup && {STANDIN}/restart.sh; "
                      f"umount -l /etc/systemd/system; rm -f {STANDIN}/hardened.sh")
        assert lab.server_healthy(host, timeout=120)
        lab.ssh(host, f"rmdir {cgroup}")


# --- issue 30: a host whose only SGLang is in a container ----------------------------------------

CONTAINER_LAB_ID = (SERVER_LAB_ID + 100) % 256  # test_fleet_containers' lab id (never up at once: module scope)
INSTALL = f"podman:{labmod.CONTAINER_NAME}:{labmod.CHECKOUT}/python/sglang"


@pytest.fixture(scope="module")
def container_only(lab_machine, tmp_path_factory):
    if not shutil.which("podman"):
        pytest.fail("podman is not installed: run scripts/setup.sh")
    with running_lab(tmp_path_factory.mktemp("home-container-only"), CONTAINER_LAB_ID, [RELEASE], hosts=1) as up:
        labmod.add_container_host("lab-01", RELEASE, lab_id=CONTAINER_LAB_ID, state_dir=up.state_dir)
        yield up


def test_apply_on_a_host_whose_only_sglang_is_in_a_container_names_it_and_what_install_would_do(container_only,
                                                                                                 tmp_path):
    """Issue 30: not "sglang is not installed": the container's install, what --install ID does
    inside it and that such a change lasts until the container is recreated, and --export-patch
    to bake it into the image, which then writes the patch. (The lab host's own /opt/sglang
    venv is hidden under a tmpfs for it, in the host's mount namespace: the container's is its own.)"""
    r = container_only.ssh("lab-01", "mount -t tmpfs -o mode=755 tmpfs /opt/sglang")
    assert r.returncode == 0, r.stderr
    _, _, hosts = container_only.cli_json("apply", "defrag-tier0", "lab-01", "--yes", rc=0)
    h = hosts["lab-01"]
    assert h["status"] == "skipped"
    assert h["skipped_reason"].startswith(
        f"not applicable without --install: sglang here is only in containers: {INSTALL} (container "
        f"{labmod.CONTAINER_NAME}, image ")
    assert h["skipped_reason"].endswith(
        f"--install {INSTALL} changes it inside its container, a change that lasts until the container is recreated "
        "(the change is in the container's writable layer, not its image): add --export-patch DIR to bake it into "
        "the image instead")
    out = tmp_path / "patches"
    container_only.cli_json("apply", "defrag-tier0", "lab-01", "--install", INSTALL, "--export-patch", str(out), rc=0)
    assert [p.name for p in out.iterdir()] == [f"defrag-tier0-sglang-{RELEASE}.patch"]
